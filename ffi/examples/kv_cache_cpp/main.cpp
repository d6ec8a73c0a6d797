// kv_cache: a small KV-cache manager for an LLM inference runtime, built on
// vmm_arena through its C++17 wrapper (vmm_arena.hpp).
//
// Each running sequence keeps its KV cache in one growable allocation:
// - the prompt's tokens are allocated at admission, inside a reservation
//   sized for a typical sequence;
// - every decode step appends one token; the cache grows a block at a time,
//   in place while the reservation lasts;
// - a sequence that outgrows its reservation is moved by the arena by
//   remapping its physical chunks (no copy); the move callback refreshes
//   the pointer the runtime hands to its attention kernels;
// - a finished sequence frees its cache, whose chunks serve the next ones;
// - half the requests begin with the same system prompt, computed once into
//   an allocation of whole chunks: each of them maps those chunks at the
//   start of its own cache (alloc_shared, nothing copied), so its cache is
//   contiguous and it computes only the rest of its prompt; the system
//   prompt's own allocation is then quiesced (no more work through its
//   addresses), as a serving engine's cached entries are.
//
// On the host backend the "device" memory is ordinary process memory, so
// this program writes a tag into every token's slot through the pointer it
// holds and checks them all when the sequence finishes: a stale pointer
// (a move the callback missed) would fail the check.
#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <unordered_map>
#include <vector>

#include "vmm_arena.hpp"

namespace {

struct TokenTag {
  uint64_t request;
  uint64_t token;
};

struct Sequence {
  uint64_t request = 0;
  uint64_t shared = 0;  // leading tokens mapped from the system prompt
  vmm::Allocation kv;   // owns the cache
  uint64_t kv_ptr = 0;  // what the kernels use; refreshed on every move
  uint64_t tokens = 0;
  uint64_t target = 0;  // prompt + tokens to generate
  uint64_t admitted = 0;  // admission order, for preemption
};

class KvCacheManager {
 public:
  KvCacheManager(vmm::Arena &arena, uint64_t bytes_per_token, uint64_t block_tokens, uint64_t reserve_tokens)
      : arena_(arena), bytes_per_token_(bytes_per_token), block_tokens_(block_tokens),
        reserve_tokens_(reserve_tokens) {
    // Runs inside the arena call that moved (under its lock): only update
    // our own bookkeeping here, never call back into the arena.
    arena_.set_move_callback([this](const vmm::MoveEvent &e) {
      auto it = by_alloc_.find(e.id);
      if (it != by_alloc_.end()) {
        if (it->second->kv_ptr != e.old_ptr) stale_moves_++;
        it->second->kv_ptr = e.new_ptr;
        moves_++;
      }
    });
  }
  ~KvCacheManager() { arena_.clear_move_callback(); }

  // Computes the system prompt once (tagged as request 0); `tokens` fill
  // whole chunks, the unit alloc_shared maps.
  void set_system_prompt(uint64_t tokens) {
    system_ = arena_.alloc(tokens * bytes_per_token_);
    system_tokens_ = tokens;
    for (uint64_t t = 0; t < tokens; t++) {
      TokenTag tag{0, t};
      std::memcpy(reinterpret_cast<void *>(system_.ptr() + t * bytes_per_token_), &tag, sizeof tag);
    }
    // Nothing touches it through its own addresses again (sequences read
    // its chunks through theirs): whatever it gives up later is reused
    // without a device synchronize.
    system_.quiesce_on_stream(0);
  }

  // Admits a request with its prompt; false when memory is short now: the
  // physical memory left must cover the prompt plus a block of headroom for
  // every running sequence, so that admissions do not starve decoding.
  // A prompt that begins with the system prompt maps its chunks instead of
  // computing them.
  bool start(uint64_t request, uint64_t prompt_tokens, uint64_t generate_tokens, bool system_prompt) {
    uint64_t bytes = blocks_for(prompt_tokens) * block_tokens_ * bytes_per_token_;
    uint64_t shared = system_prompt ? system_tokens_ : 0;
    vmm::Stats s = arena_.stats();
    uint64_t headroom = (running_.size() + 1) * block_tokens_ * bytes_per_token_;
    if (s.mapped_bytes + bytes - shared * bytes_per_token_ + headroom > s.capacity_bytes) return false;
    uint64_t reserve = std::max(bytes, reserve_tokens_ * bytes_per_token_);
    auto r = shared ? arena_.try_alloc_shared(system_, 0, shared * bytes_per_token_, reserve)
                    : arena_.try_alloc_growable(bytes, reserve);
    if (r && shared) {
      auto grown = r->try_resize(bytes);  // room for the rest of the prompt
      if (!grown) r = vmm::Result<vmm::Allocation>(grown.status(), grown.message());
    }
    if (!r) {
      if (r.status() != vmm::Status::OutOfMemory && r.status() != vmm::Status::OutOfAddressSpace) r.value();
      return false;  // the scheduler retries later
    }
    auto seq = std::make_unique<Sequence>();
    seq->request = request;
    seq->kv = std::move(r).value();
    seq->kv_ptr = seq->kv.ptr();
    seq->shared = seq->tokens = shared;
    seq->target = prompt_tokens + generate_tokens;
    seq->admitted = ++admissions_;
    by_alloc_[seq->kv.id()] = seq.get();
    shared_tokens_ += shared;
    for (uint64_t t = shared; t < prompt_tokens; t++) write_token(*seq);  // prefill of the rest
    running_[request] = std::move(seq);
    return true;
  }

  // One decode step for a sequence; false when memory is short (the
  // scheduler then preempts someone).
  bool append_token(Sequence &seq) {
    uint64_t have = seq.kv.size();
    if ((seq.tokens + 1) * bytes_per_token_ > have) {
      auto r = seq.kv.try_resize(have + block_tokens_ * bytes_per_token_);
      if (!r) {
        if (r.status() != vmm::Status::OutOfMemory && r.status() != vmm::Status::OutOfAddressSpace) r.value();
        return false;
      }
      if (*r != seq.kv_ptr) stale_moves_++;  // the callback must have told us already
    }
    write_token(seq);
    return true;
  }

  // Checks every token of a finished (or preempted) sequence and frees it.
  void release(uint64_t request) {
    auto it = running_.find(request);
    Sequence &seq = *it->second;
    for (uint64_t t = 0; t < seq.tokens; t++) {
      TokenTag tag;
      std::memcpy(&tag, reinterpret_cast<const void *>(seq.kv_ptr + t * bytes_per_token_), sizeof tag);
      uint64_t owner = t < seq.shared ? 0 : seq.request;  // shared tokens are the system prompt's
      if (tag.request != owner || tag.token != t) corrupt_tokens_++;
    }
    by_alloc_.erase(seq.kv.id());
    seq.kv.free();
    running_.erase(it);
  }

  std::map<uint64_t, std::unique_ptr<Sequence>> &running() { return running_; }
  uint64_t moves() const { return moves_; }
  uint64_t shared_tokens() const { return shared_tokens_; }
  void free_system_prompt() { system_.free(); }
  uint64_t errors() const { return stale_moves_ + corrupt_tokens_; }

 private:
  uint64_t blocks_for(uint64_t tokens) const { return (tokens + block_tokens_ - 1) / block_tokens_ + (tokens == 0); }

  void write_token(Sequence &seq) {
    TokenTag tag{seq.request, seq.tokens};
    std::memcpy(reinterpret_cast<void *>(seq.kv_ptr + seq.tokens * bytes_per_token_), &tag, sizeof tag);
    seq.tokens++;
  }

  vmm::Arena &arena_;
  uint64_t bytes_per_token_, block_tokens_, reserve_tokens_;
  std::map<uint64_t, std::unique_ptr<Sequence>> running_;
  std::unordered_map<vmm::Id, Sequence *> by_alloc_;
  vmm::Allocation system_;
  uint64_t system_tokens_ = 0, shared_tokens_ = 0;
  uint64_t moves_ = 0, stale_moves_ = 0, corrupt_tokens_ = 0, admissions_ = 0;
};

uint64_t next_random(uint64_t &s) {
  s ^= s << 13;
  s ^= s >> 7;
  s ^= s << 17;
  return s;
}

}  // namespace

int main() {
  const uint64_t MiB = 1 << 20;
  // A tiny model: 8 KiB of K and V per token; 2 MiB chunks hold 256 tokens.
  const uint64_t bytes_per_token = 8 << 10, block_tokens = 64, reserve_tokens = 512;
  vmm::Arena arena(vmm::Config::host(96 * MiB).retain(16 * MiB));
  KvCacheManager kv(arena, bytes_per_token, block_tokens, reserve_tokens);
  const uint64_t system_tokens = 256;  // one chunk
  kv.set_system_prompt(system_tokens);

  std::deque<uint64_t> waiting;
  std::map<uint64_t, std::pair<uint64_t, uint64_t>> requests;  // prompt, generate
  uint64_t rng = 0x2545F4914F6CDD1Dull;
  const uint64_t total_requests = 96;
  for (uint64_t r = 1; r <= total_requests; r++) {
    // Even requests begin with the system prompt.
    requests[r] = {16 + next_random(rng) % 400 + (r % 2 ? 0 : system_tokens), 32 + next_random(rng) % 1200};
    waiting.push_back(r);
  }

  uint64_t steps = 0, finished = 0, preempted = 0, generated = 0, saved_peak = 0;
  while (finished < total_requests) {
    steps++;
    // Admit while memory allows, at most 24 running.
    while (!waiting.empty() && kv.running().size() < 24) {
      uint64_t r = waiting.front();
      if (!kv.start(r, requests[r].first, requests[r].second, r % 2 == 0)) break;
      vmm::Stats now = arena.stats();  // live_bytes counts a shared chunk per holder, mapped_bytes once
      saved_peak = std::max(saved_peak, now.live_bytes > now.mapped_bytes ? now.live_bytes - now.mapped_bytes : 0);
      waiting.pop_front();
    }
    // One decode step for every running sequence.
    std::vector<uint64_t> done, starved;
    for (auto &entry : kv.running()) {
      Sequence &seq = *entry.second;
      if (!kv.append_token(seq)) {
        starved.push_back(seq.request);
        continue;
      }
      generated++;
      if (seq.tokens >= seq.target) done.push_back(seq.request);
    }
    for (uint64_t r : done) {
      kv.release(r);
      finished++;
    }
    // Out of memory: preempt the latest admitted sequence (it is recomputed
    // from its prompt later), as runtimes do.
    if (!starved.empty() && done.empty()) {
      uint64_t victim = 0, latest = 0;
      for (auto &entry : kv.running())
        if (entry.second->admitted > latest) latest = entry.second->admitted, victim = entry.first;
      kv.release(victim);
      waiting.push_front(victim);
      preempted++;
    }
    if (steps > 100000) {
      std::fprintf(stderr, "kv_cache: no progress\n");
      return 1;
    }
  }

  kv.free_system_prompt();
  vmm::Stats s = arena.stats();
  std::printf("kv_cache: %" PRIu64 " system-prompt tokens mapped instead of computed, nothing copied; live bytes "
              "passed mapped bytes by up to %" PRIu64 " MiB (a shared chunk is mapped once)\n",
              kv.shared_tokens(), saved_peak / MiB);
  std::printf("kv_cache: %" PRIu64 " requests, %" PRIu64 " tokens generated in %" PRIu64 " steps, %" PRIu64
              " preemptions\n",
              total_requests, generated, steps, preempted);
  std::printf("kv_cache: %" PRIu64 " moves by remapping (callback saw %" PRIu64 "), peak physical %" PRIu64
              " MiB of %" PRIu64 " MiB, %" PRIu64 " chunks created, %" PRIu64 " released\n",
              s.moves, kv.moves(), s.peak_physical_bytes / MiB, s.capacity_bytes / MiB, s.driver_creates,
              s.driver_releases);
  bool ok = kv.errors() == 0 && s.moves == kv.moves() && s.live_allocations == 0 && s.moves > 0 &&
            kv.shared_tokens() > 0 && saved_peak > 0 && s.mapped_bytes == 0;
  std::printf("kv_cache: %s (%" PRIu64 " stale pointers or corrupt tokens)\n", ok ? "OK" : "FAILED", kv.errors());
  return ok ? 0 : 1;
}
