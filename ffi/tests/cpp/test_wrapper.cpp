// The header-only C++17 wrapper (vmm_arena.hpp) on the host backend:
// RAII, move semantics, exceptions and their non-throwing twins, the
// std::function move callback, and use from several std::threads.
#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "vmm_arena.hpp"
#include "check.h"

namespace {

constexpr uint64_t K = 64 << 10;

static_assert(!std::is_copy_constructible<vmm::Arena>::value, "move-only");
static_assert(!std::is_copy_assignable<vmm::Arena>::value, "move-only");
static_assert(std::is_nothrow_move_constructible<vmm::Arena>::value, "movable");
static_assert(!std::is_copy_constructible<vmm::Allocation>::value, "move-only");
static_assert(std::is_nothrow_move_constructible<vmm::Allocation>::value, "movable");
static_assert(std::is_nothrow_move_assignable<vmm::Allocation>::value, "movable");
static_assert(static_cast<uint32_t>(vmm::Status::Pinned) == VMM_ARENA_ERR_PINNED, "same values");

vmm::Config small(uint64_t cap_chunks = 32, uint64_t reserve_chunks = 128) {
  return vmm::Config::host().capacity(cap_chunks * K).reserve(reserve_chunks * K).chunk(K);
}

template <class F>
vmm::Status thrown_status(F &&f) {
  try {
    f();
  } catch (const vmm::Error &e) {
    CHECK(std::strlen(e.what()) > 0);
    CHECK(std::string(e.what()).find(vmm::status_name(e.status())) != std::string::npos);
    return e.status();
  }
  return vmm::Status::Ok;
}

void fill(uint64_t ptr, uint64_t len, uint8_t seed) {
  auto *p = reinterpret_cast<uint8_t *>(static_cast<uintptr_t>(ptr));
  for (uint64_t i = 0; i < len; i++) p[i] = static_cast<uint8_t>(seed + i * 13);
}

bool intact(uint64_t ptr, uint64_t len, uint8_t seed) {
  const auto *p = reinterpret_cast<const uint8_t *>(static_cast<uintptr_t>(ptr));
  for (uint64_t i = 0; i < len; i++)
    if (p[i] != static_cast<uint8_t>(seed + i * 13)) return false;
  return true;
}

void test_config_and_creation() {
  vmm::Config d;
  CHECK(d.raw().backend == VMM_ARENA_BACKEND_CUDA);
  CHECK(d.raw().retain_bytes == UINT64_MAX);
  CHECK(d.raw().struct_size == sizeof(vmm_arena_config));
  vmm::Config c = small().no_implicit_moves().retain(3 * K);
  CHECK(c.raw().flags == VMM_ARENA_FLAG_NO_IMPLICIT_MOVES);
  CHECK(c.raw().retain_bytes == 3 * K);
  CHECK(c.no_implicit_moves(false).raw().flags == 0);

  // Throwing and non-throwing creation.
  CHECK(thrown_status([] { vmm::Arena a(small().chunk(1000)); }) == vmm::Status::InvalidArgument);
  auto bad = vmm::Arena::create(small().capacity(1));
  CHECK(!bad && bad.status() == vmm::Status::InvalidArgument);
  CHECK(bad.message().find("VMM_ARENA_ERR_INVALID_ARGUMENT") != std::string::npos);
  CHECK(thrown_status([&] { (void)bad.value(); }) == vmm::Status::InvalidArgument);
  auto good = vmm::Arena::create(small());
  CHECK(good.ok() && good.message().empty());
  vmm::Arena a = std::move(good).value();
  CHECK(static_cast<bool>(a) && a.get() != nullptr);

  // CUDA: unsupported here, or a real device.
  auto cuda = vmm::Arena::create(vmm::Config::cuda(0, 64ull << 20));
  CHECK(cuda.ok() || cuda.status() == vmm::Status::Unsupported);
  CHECK(thrown_status([] { vmm::Arena x(vmm::Config::cuda(1000)); }) == vmm::Status::Unsupported);

  // Arena move: the handle travels, the moved-from arena is empty.
  vmm::Arena b = std::move(a);
  CHECK(!a && b);
  vmm::Arena c2(small());
  c2 = std::move(b);
  CHECK(!b && c2);
  CHECK(c2.stats().capacity_bytes == 32 * K);
}

void test_allocations_raii() {
  vmm::Arena arena(small());
  {
    vmm::Allocation x = arena.alloc(100);
    CHECK(x && x.id() != 0);
    CHECK(x.size() == 100);
    CHECK(x.ptr() % 256 == 0);
    std::memcpy(x.as<char>(), "hello", 6);
    CHECK(std::strcmp(x.as<char>(), "hello") == 0);
    CHECK(arena.stats().live_allocations == 1);
    vmm::Allocation y = std::move(x);  // ownership moves
    CHECK(!x && y);
    CHECK(arena.stats().live_allocations == 1);
    vmm::Allocation z = arena.alloc(K);
    z = std::move(y);  // z's old allocation is freed
    CHECK(arena.stats().live_allocations == 1);
    CHECK(std::strcmp(z.as<char>(), "hello") == 0);
  }
  CHECK(arena.stats().live_allocations == 0);  // freed by the destructors

  vmm::Allocation r = arena.alloc(K);
  vmm::Id id = r.release();
  CHECK(!r && id != 0);
  CHECK(arena.stats().live_allocations == 1);
  vmm::Allocation adopted = vmm::Allocation::adopt(arena.get(), id);
  adopted.free();
  CHECK(!adopted && arena.stats().live_allocations == 0);
  adopted.reset();  // empty: nothing happens
  // A freed or made-up id: UnknownAllocation.
  vmm::Allocation stale = vmm::Allocation::adopt(arena.get(), id);
  CHECK(thrown_status([&] { (void)stale.ptr(); }) == vmm::Status::UnknownAllocation);
  CHECK(thrown_status([&] { stale.free(); }) == vmm::Status::UnknownAllocation);
  CHECK(!stale);
  vmm::Allocation bogus = vmm::Allocation::adopt(arena.get(), 0x123456789ull);
  CHECK(bogus.try_resize(K).status() == vmm::Status::UnknownAllocation);
  bogus.reset();  // errors ignored

  // Bad sizes, out of memory.
  CHECK(thrown_status([&] { arena.alloc(0); }) == vmm::Status::InvalidArgument);
  CHECK(thrown_status([&] { arena.alloc_growable(2 * K, K); }) == vmm::Status::InvalidArgument);
  CHECK(thrown_status([&] { arena.alloc(33 * K); }) == vmm::Status::OutOfMemory);
  auto t = arena.try_alloc(33 * K);
  CHECK(!t && t.status() == vmm::Status::OutOfMemory);
  CHECK(t.message().find("VMM_ARENA_ERR_OUT_OF_MEMORY") != std::string::npos);
  auto ok = arena.try_alloc_growable(K, 4 * K);
  CHECK(ok.ok() && ok->size() == K);
  CHECK(arena.try_alloc_growable(0, K).status() == vmm::Status::InvalidArgument);
}

void test_growth_moves_and_callback() {
  vmm::Arena arena(small());
  // Pointers refreshed by the move callback, as a runtime would.
  std::map<vmm::Id, uint64_t> where;
  int events = 0;
  arena.set_move_callback([&](const vmm::MoveEvent &e) {
    CHECK(where.count(e.id) == 1 && where[e.id] == e.old_ptr);
    where[e.id] = e.new_ptr;
    events++;
  });
  vmm::Allocation g = arena.alloc_growable(K, 2 * K);
  vmm::Allocation n = arena.alloc(K);
  where[g.id()] = g.ptr();
  where[n.id()] = n.ptr();
  CHECK(n.ptr() == g.ptr() + 2 * K);
  fill(g.ptr(), K, 7);
  uint64_t p0 = g.ptr();
  CHECK(g.resize(2 * K) == p0);  // within the reservation
  CHECK(events == 0);
  uint64_t p1 = g.resize(5 * K);  // beyond: moves
  CHECK(p1 != p0 && events == 1 && where[g.id()] == p1 && g.ptr() == p1);
  CHECK(intact(p1, K, 7));
  CHECK(arena.stats().retired_va_bytes > 0);
  arena.release_retired();
  CHECK(arena.stats().retired_va_bytes == 0);

  // Pinned: no move, an exception carrying the status.
  vmm::Allocation h = arena.alloc_growable(K, K);
  vmm::Allocation m = arena.alloc(K);
  where[h.id()] = h.ptr();
  where[m.id()] = m.ptr();
  CHECK(m.ptr() == h.ptr() + K);
  {
    vmm::PinGuard pin(h);
    vmm::PinGuard pin_m(m);  // m cannot move out of h's way either
    CHECK(thrown_status([&] { h.resize(4 * K); }) == vmm::Status::Pinned);
    CHECK(h.try_resize(4 * K).status() == vmm::Status::Pinned);
  }
  CHECK(h.try_resize(4 * K).ok());
  CHECK(where[h.id()] == h.ptr());

  // Compaction, reported through the same callback.
  std::vector<vmm::Allocation> many;
  for (int i = 0; i < 10; i++) {
    many.push_back(arena.alloc(K));
    where[many.back().id()] = many.back().ptr();
    fill(many.back().ptr(), K, static_cast<uint8_t>(i));
  }
  for (int i = 0; i < 10; i += 2) many[i].reset();
  int before = events;
  vmm::CompactReport r = arena.compact();
  CHECK(static_cast<int>(r.moved_allocations) == events - before);
  CHECK(r.largest_free_va_after >= r.largest_free_va_before);
  for (int i = 1; i < 10; i += 2) {
    CHECK(many[i].ptr() == where[many[i].id()]);
    CHECK(intact(many[i].ptr(), K, static_cast<uint8_t>(i)));
  }
  auto tr = arena.try_compact();
  CHECK(tr.ok());

  // A callback that calls back into its arena gets InvalidArgument.
  vmm_arena_status inner = VMM_ARENA_OK;
  vmm_arena *raw = arena.get();
  arena.set_move_callback([&](const vmm::MoveEvent &e) {
    uint64_t p = 0;
    inner = vmm_arena_query(raw, e.id, &p, nullptr);
  });
  // No cached chunk left to adopt elsewhere: qn is placed by best fit,
  // right after q (placement prefers a longer free range where it would
  // adopt cached chunks).
  arena.trim();
  vmm::Allocation q = arena.alloc_growable(K, K);
  vmm::Allocation qn = arena.alloc(K);
  CHECK(qn.ptr() == q.ptr() + K);
  q.resize(3 * K);
  CHECK(inner == VMM_ARENA_ERR_INVALID_ARGUMENT);

  // Removing the callback.
  arena.clear_move_callback();
  uint64_t moves = arena.stats().moves;
  vmm::Allocation s = arena.alloc_growable(K, K);
  vmm::Allocation sn = arena.alloc(K);
  CHECK(sn.ptr() == s.ptr() + K);
  s.resize(3 * K);
  CHECK(arena.stats().moves == moves + 1);

  // Moving the arena keeps its callback alive.
  int after_move = 0;
  arena.set_move_callback([&](const vmm::MoveEvent &) { after_move++; });
  g.reset();
  n.reset();
  h.reset();
  m.reset();
  many.clear();
  q.reset();
  qn.reset();
  s.reset();
  sn.reset();
  vmm::Arena moved = std::move(arena);
  vmm::Allocation u = moved.alloc_growable(K, K);
  vmm::Allocation un = moved.alloc(K);
  CHECK(un.ptr() == u.ptr() + K);
  u.resize(3 * K);
  CHECK(after_move == 1);
}

void test_stats_trim_snapshot() {
  vmm::Arena arena(small());
  {
    vmm::Allocation a = arena.alloc(3 * K);
    vmm::Stats s = arena.stats();
    CHECK(s.live_allocations == 1 && s.mapped_bytes == 3 * K && s.live_bytes == 3 * K);
    auto ts = arena.try_stats();
    CHECK(ts.ok() && ts->mapped_bytes == 3 * K);
  }
  CHECK(arena.stats().pooled_bytes == 3 * K);
  CHECK(arena.trim(K) == 2 * K);
  CHECK(arena.trim() == K);
  CHECK(arena.stats().pooled_bytes == 0);
  vmm::Allocation keep = arena.alloc(K);
  std::string json = arena.snapshot_json();
  CHECK(!json.empty() && json.front() == '{' && json.back() == '}');
  CHECK(json.find("\"ranges\"") != std::string::npos && json.find("\"live\"") != std::string::npos);
  CHECK(json.find('\0') == std::string::npos);
}

void test_sleep_wake() {
  static_assert(static_cast<uint32_t>(vmm::Status::Asleep) == 9, "ABI value");
  vmm::Arena arena(small(8, 32));
  vmm::Allocation weights = arena.alloc(2 * K);
  vmm::Allocation kv = arena.alloc_growable(K, 4 * K);
  vmm::Allocation tiny = arena.alloc(64);
  uint64_t wp = weights.ptr();
  std::memset(reinterpret_cast<void *>(wp), 0x5a, 2 * K);
  weights.set_tag(1);
  kv.set_tag(2);
  // Every allocation takes a tag (test_tags.cpp); its own is a no-op.
  tiny.set_tag(0);
  CHECK(tiny.try_set_tag(0).ok());
  CHECK(thrown_status([&] { arena.sleep(1, 4); }) == vmm::Status::InvalidArgument);
  arena.sleep(1, vmm::sleep_backup);
  CHECK(arena.try_sleep(2).ok());
  CHECK(arena.stats().mapped_bytes == K);  // the tiny one's slab
  CHECK(thrown_status([&] { kv.resize(2 * K); }) == vmm::Status::Asleep);
  CHECK(thrown_status([&] { weights.pin(); }) == vmm::Status::Asleep);
  CHECK(weights.ptr() == wp);
  // The trainer's turn: most of the capacity, then gone.
  {
    vmm::Allocation trainer = arena.alloc(7 * K);
    CHECK(arena.try_wake(vmm::all_tags).status() == vmm::Status::OutOfMemory);
  }
  arena.wake(1);
  const unsigned char *p = reinterpret_cast<const unsigned char *>(wp);
  CHECK(p[0] == 0x5a && p[2 * K - 1] == 0x5a);
  CHECK(thrown_status([&] { kv.pin(); }) == vmm::Status::Asleep);
  CHECK(arena.try_wake(vmm::all_tags).ok());
  kv.resize(3 * K);
  weights.pin();
  arena.sleep(vmm::all_tags);
  kv.free();  // frees a sleeping allocation
  arena.wake(vmm::all_tags);
  CHECK(arena.stats().live_allocations == 2);
}

void test_prefetch_stream_free_resize_many() {
  vmm::Arena arena(small(16, 64));
  vmm::Allocation g = arena.alloc_growable(K, 8 * K);
  vmm::Allocation h = arena.alloc_growable(K, 8 * K);
  arena.set_prefetch(K, 2 * K);
  arena.maintain();
  CHECK(arena.try_maintain().ok());
  std::vector<uint64_t> ptrs = arena.resize_many({g.id(), h.id()}, {3 * K, 2 * K});
  CHECK(ptrs.size() == 2 && ptrs[0] == g.ptr() && ptrs[1] == h.ptr());
  CHECK(g.size() == 3 * K && h.size() == 2 * K);
  CHECK(thrown_status([&] { arena.resize_many({g.id(), g.id()}, {K, K}); }) == vmm::Status::InvalidArgument);
  CHECK(thrown_status([&] { arena.resize_many({g.id()}, {K, K}); }) == vmm::Status::InvalidArgument);
  CHECK(thrown_status([&] { arena.resize_many({g.id()}, {100 * K}); }) == vmm::Status::OutOfMemory);
  CHECK(g.size() == 3 * K);
  g.free_on_stream(0);
  CHECK(!g);
  CHECK(arena.stats().live_allocations == 1);
  // Admission map-ahead: the next growable allocation's place is mapped
  // (from the pool) by maintain; a bad count throws, the target stays.
  arena.set_prefetch(3 * K, 0);
  // (A reservation of 16 chunks: no freed place fits it, so nothing
  // cached waits where it lands but the window.)
  arena.set_admission_prefetch(16 * K, 2 * K, 1);
  CHECK(thrown_status([&] { arena.set_admission_prefetch(16 * K, 2 * K, 65); }) == vmm::Status::InvalidArgument);
  arena.maintain();
  const vmm_arena_stats before = arena.stats();
  vmm::Allocation admitted = arena.alloc_growable(2 * K, 16 * K);
  const vmm_arena_stats after = arena.stats();
  // Its chunks were mapped and made accessible by maintain: the
  // allocation adopts them with no map and no access call.
  CHECK(after.driver_maps == before.driver_maps && after.driver_access_calls == before.driver_access_calls);
  CHECK(after.pooled_bytes == before.pooled_bytes - 2 * K);
  fill(admitted.ptr(), 2 * K, 3);
  CHECK(intact(admitted.ptr(), 2 * K, 3));
  arena.set_admission_prefetch(0, 0, 0);
  // The background thread, through the config.
  CHECK((small(8, 32).background().raw().flags & VMM_ARENA_FLAG_BACKGROUND) != 0);
  CHECK((small(8, 32).background().background(false).raw().flags & VMM_ARENA_FLAG_BACKGROUND) == 0);
#ifndef VMM_ARENA_CALLS_SERIALIZED  // scripts/tsan.sh: a library thread TSan cannot follow
  vmm::Arena bg(small(8, 32).background());
  bg.set_prefetch(2 * K, 0);
#endif
}

void test_resize_on_stream() {
  vmm::Arena arena(small(8, 32));
  vmm::Allocation g = arena.alloc_growable(K, 4 * K);
  vmm::Allocation n = arena.alloc(K);
  uint64_t p0 = g.ptr();
  CHECK(n.ptr() == p0 + 4 * K);
  fill(p0, K, 9);
  CHECK(g.resize_on_stream(3 * K, 0) == p0);  // growth within the reservation
  CHECK(g.size() == 3 * K && intact(p0, K, 9) && arena.stats().mapped_bytes == 4 * K);
  CHECK(g.resize_on_stream(K / 2, 7) == p0);  // a shrink of whole chunks, on stream 7
  CHECK(g.size() == K / 2 && intact(p0, K / 2, 9) && arena.stats().mapped_bytes == 2 * K);
  CHECK(std::string(arena.snapshot_json()).find("\"stream_shrinks\":0,") != std::string::npos);  // host
  uint64_t p1 = g.resize_on_stream(6 * K, 0);  // beyond the reservation: moves
  CHECK(p1 != p0 && g.ptr() == p1 && intact(p1, K / 2, 9) && arena.stats().moves == 1);
  // Errors: as resize's, thrown or returned.
  CHECK(thrown_status([&] { g.resize_on_stream(0, 0); }) == vmm::Status::InvalidArgument);
  CHECK(thrown_status([&] { g.resize_on_stream(100 * K, 0); }) == vmm::Status::OutOfMemory);
  auto t = g.try_resize_on_stream(100 * K, 3);
  CHECK(!t && t.status() == vmm::Status::OutOfMemory);
  CHECK(t.message().find("vmm_arena_resize_on_stream") != std::string::npos);
  CHECK(g.try_resize_on_stream(UINT64_MAX, 0).status() == vmm::Status::InvalidArgument);
  auto ok = g.try_resize_on_stream(2 * K, 3);
  CHECK(ok.ok() && *ok == p1 && g.size() == 2 * K);
  vmm::Allocation bogus = vmm::Allocation::adopt(arena.get(), 0x123456789ull);
  CHECK(thrown_status([&] { bogus.resize_on_stream(K, 0); }) == vmm::Status::UnknownAllocation);
  CHECK(bogus.try_resize_on_stream(K, 0).status() == vmm::Status::UnknownAllocation);
  bogus.reset();
  g.set_tag(1);
  arena.sleep(1, VMM_ARENA_SLEEP_BACKUP);
  CHECK(thrown_status([&] { g.resize_on_stream(K, 0); }) == vmm::Status::Asleep);
  arena.wake(1);
  CHECK(g.resize_on_stream(K, 0) == p1 && intact(p1, K / 2, 9));
}

// A number from the snapshot's stats ("key":value).
uint64_t snapshot_stat(const vmm::Arena &arena, const char *key) {
  const std::string json = arena.snapshot_json();
  const std::string pat = std::string("\"") + key + "\":";
  size_t at = json.find(pat, json.find("\"stats\""));
  CHECK(at != std::string::npos);
  return std::stoull(json.substr(at + pat.size()));
}

void test_quiesce_on_stream() {
  vmm::Arena arena(small(8, 32));
  vmm::Allocation g = arena.alloc_growable(3 * K, 4 * K);
  vmm::Allocation n = arena.alloc(K);
  uint64_t p0 = g.ptr();
  fill(p0, 3 * K, 11);
  g.quiesce_on_stream(0);
  CHECK(g.try_quiesce_on_stream(5).ok());  // a second promise changes nothing
  CHECK(g.ptr() == p0 && g.size() == 3 * K && intact(p0, 3 * K, 11));
  CHECK(snapshot_stat(arena, "idle_cached_bytes") == 0 && snapshot_stat(arena, "quiesces") == 0);  // host
  // A shrink keeps the promise: the dropped chunks are idle at once.
  CHECK(g.resize(2 * K) == p0 && intact(p0, 2 * K, 11));
  CHECK(snapshot_stat(arena, "idle_cached_bytes") == K);
  g.free();
  CHECK(!g && snapshot_stat(arena, "idle_cached_bytes") == 3 * K);
  // Growth works and ends it: nothing idle at the free.
  vmm::Allocation h = arena.alloc_growable(K, 4 * K);
  uint64_t ph = h.ptr();
  fill(ph, K, 12);
  h.quiesce_on_stream(3);
  CHECK(h.resize(3 * K) == ph && intact(ph, K, 12));
  arena.trim(0);
  h.free();
  CHECK(snapshot_stat(arena, "cached_mapped_bytes") == 3 * K && snapshot_stat(arena, "idle_cached_bytes") == 0);
  // Errors, thrown or returned: unknown, asleep.
  vmm::Allocation bogus = vmm::Allocation::adopt(arena.get(), 0x123456789ull);
  CHECK(thrown_status([&] { bogus.quiesce_on_stream(0); }) == vmm::Status::UnknownAllocation);
  auto t = bogus.try_quiesce_on_stream(0);
  CHECK(!t && t.status() == vmm::Status::UnknownAllocation);
  CHECK(t.message().find("vmm_arena_quiesce_on_stream") != std::string::npos);
  bogus.release();
  vmm::Allocation s = arena.alloc_growable(2 * K, 2 * K);
  s.set_tag(4);
  arena.sleep(4, VMM_ARENA_SLEEP_BACKUP);
  CHECK(thrown_status([&] { s.quiesce_on_stream(0); }) == vmm::Status::Asleep);
  CHECK(s.try_quiesce_on_stream(0).status() == vmm::Status::Asleep);
  arena.wake(4);
  CHECK(s.try_quiesce_on_stream(0).ok());
  vmm::Allocation tiny = arena.alloc(100);  // small: nothing to record, fine
  tiny.quiesce_on_stream(0);
  CHECK(arena.stats().live_allocations == 3);
  // unquiesce ends it without growth: a later shrink's chunk is not idle.
  arena.trim(0);
  s.unquiesce();
  CHECK(s.resize(K) == s.ptr());
  CHECK(snapshot_stat(arena, "idle_cached_bytes") == 0 && snapshot_stat(arena, "cached_mapped_bytes") == K);
  vmm::Allocation bogus2 = vmm::Allocation::adopt(arena.get(), 0x123456789ull);
  CHECK(thrown_status([&] { bogus2.unquiesce(); }) == vmm::Status::UnknownAllocation);
  auto u = bogus2.try_unquiesce();
  CHECK(!u && u.status() == vmm::Status::UnknownAllocation);
  bogus2.release();
}

void test_alloc_shared() {
  vmm::Arena arena(small(8, 32));
  vmm::Allocation prefix = arena.alloc(3 * K);
  std::memset(prefix.as<void>(), 0x3c, 3 * K);
  // The prefix's first two chunks, mapped again, in a growable allocation.
  vmm::Allocation req = arena.alloc_shared(prefix, 0, 2 * K, 6 * K);
  CHECK(req.size() == 2 * K && req.ptr() != prefix.ptr());
  CHECK(std::memcmp(req.as<void>(), prefix.as<void>(), 2 * K) == 0);
  CHECK(arena.stats().mapped_bytes == 3 * K);  // nothing new
  req.as<unsigned char>()[K] = 0x11;
  CHECK(prefix.as<unsigned char>()[K] == 0x11);
  req.resize(5 * K);  // its own chunks after the shared ones
  std::memset(req.as<unsigned char>() + 2 * K, 0x22, 3 * K);
  CHECK(prefix.as<unsigned char>()[2 * K] == 0x3c);
  CHECK(arena.stats().mapped_bytes == 6 * K);
  CHECK(thrown_status([&] { arena.alloc_shared(prefix, 0, K + 1, 2 * K); }) == vmm::Status::InvalidArgument);
  CHECK(arena.try_alloc_shared(prefix, 2 * K, 2 * K, 2 * K).status() == vmm::Status::InvalidArgument);
  auto second = arena.try_alloc_shared(req.id(), K, K, K);  // a share of a share
  CHECK(second.ok());
  prefix.free();  // the sharers keep the chunks
  CHECK(req.as<unsigned char>()[K] == 0x11);
  CHECK(arena.stats().mapped_bytes == 5 * K);
}

void test_threads() {
  vmm::Arena arena(small(96, 160));
  std::atomic<uint64_t> moves{0};
  arena.set_move_callback([&](const vmm::MoveEvent &) { moves++; });
  std::vector<std::thread> threads;
  std::atomic<int> soft_failures{0};
  for (int t = 0; t < 6; t++) {
    threads.emplace_back([&, t] {
      for (int it = 0; it < 120; it++) {
        auto r = (it % 2) ? arena.try_alloc(K + it) : arena.try_alloc_growable(K + it, 3 * K);
        if (!r) {
          CHECK(r.status() == vmm::Status::OutOfMemory || r.status() == vmm::Status::OutOfAddressSpace);
          soft_failures++;
          continue;
        }
        vmm::Allocation a = std::move(r).value();
        uint8_t seed = static_cast<uint8_t>(t * 31 + it);
        {
          vmm::PinGuard pin(a);  // not moved while we touch it
          fill(a.ptr(), K, seed);
        }
        auto grown = a.try_resize(4 * K + it);
        if (!grown) {
          CHECK(grown.status() == vmm::Status::OutOfMemory || grown.status() == vmm::Status::OutOfAddressSpace);
          soft_failures++;
        }
        if (it % 20 == t) (void)arena.try_compact();
        vmm::PinGuard pin(a);
        CHECK(intact(a.ptr(), K, seed));
      }
    });
  }
  for (auto &th : threads) th.join();
  vmm::Stats s = arena.stats();
  CHECK(s.live_allocations == 0);
  CHECK(s.moves == moves.load());
  std::printf("test_wrapper: threads: %llu moves, %d soft failures\n", static_cast<unsigned long long>(s.moves),
              soft_failures.load());
}

// Several threads installing move callbacks at once while another thread
// keeps moving allocations: the callback the C library holds must always be
// the one the wrapper keeps alive (issue 16: it was once freed by the other
// installer, a heap-use-after-free in the trampoline).
void test_concurrent_callback_installs() {
  vmm::Arena arena(small(64, 256));
  std::atomic<uint64_t> calls{0};
  std::atomic<bool> stop{false};
  std::thread mover([&] {
    // Bounded as well as stopped: under a sanitizer's or Valgrind's
    // scheduling the installers may get the lock only rarely while the
    // mover runs; once its rounds are done they finish on their own.
    for (int round = 0; round < 2000 && !stop.load(); round++) {
      vmm::Allocation g = arena.alloc_growable(K, K);
      vmm::Allocation n = arena.alloc(K);  // right after g: g's growth must move
      g.resize(3 * K);
      g.reset();
      n.reset();
      arena.release_retired();
      // Lets the installers at the lock between rounds: a scheduler that
      // runs one thread at a time (Valgrind's) would otherwise hand the
      // mover most rounds, and the test would crawl.
      std::this_thread::yield();
    }
  });
  std::vector<std::thread> installers;
  for (int t = 0; t < 4; t++) {
    installers.emplace_back([&, t] {
      for (int it = 0; it < 5000; it++) {
        // A capture large enough to live on the heap, so that a freed
        // callback is a freed allocation that ASan sees being used.
        std::vector<uint64_t> tag(8, static_cast<uint64_t>(t * 1000 + it));
        if (it % 50 == 49) {
          arena.clear_move_callback();
        } else {
          arena.set_move_callback([&calls, tag](const vmm::MoveEvent &) { calls += tag.size() == 8 ? 1 : 0; });
        }
      }
    });
  }
  for (auto &th : installers) th.join();
  stop = true;
  mover.join();
  // The callback installed last is alive and is the one called.
  uint64_t before = calls.load();
  arena.set_move_callback([&](const vmm::MoveEvent &) { calls++; });
  vmm::Allocation g = arena.alloc_growable(K, K);
  vmm::Allocation n = arena.alloc(K);
  g.resize(3 * K);
  CHECK(calls.load() == before + 1);
  std::printf("test_wrapper: concurrent callback installs: %llu moves, %llu callback calls\n",
              static_cast<unsigned long long>(arena.stats().moves), static_cast<unsigned long long>(calls.load()));
}

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IONBF, 0);
  std::printf("test_wrapper: config_and_creation\n");
  test_config_and_creation();
  std::printf("test_wrapper: allocations_raii\n");
  test_allocations_raii();
  std::printf("test_wrapper: growth_moves_and_callback\n");
  test_growth_moves_and_callback();
  std::printf("test_wrapper: stats_trim_snapshot\n");
  test_stats_trim_snapshot();
  std::printf("test_wrapper: sleep_wake\n");
  test_sleep_wake();
  std::printf("test_wrapper: prefetch_stream_free_resize_many\n");
  test_prefetch_stream_free_resize_many();
  std::printf("test_wrapper: resize_on_stream\n");
  test_resize_on_stream();
  std::printf("test_wrapper: quiesce_on_stream\n");
  test_quiesce_on_stream();
  std::printf("test_wrapper: alloc_shared\n");
  test_alloc_shared();
  std::printf("test_wrapper: threads\n");
  test_threads();
  std::printf("test_wrapper: concurrent_callback_installs\n");
  test_concurrent_callback_installs();
  FINISH("test_wrapper");
}
