// The C++ wrapper's stream-ordered allocations (alloc_on_stream,
// alloc_growable_on_stream and their non-throwing twins) on the host
// backend: RAII, bytes, reuse of memory freed on the same stream (no new
// chunk), growth on the stream, and errors thrown or returned.
#include <cstdint>
#include <cstring>
#include <string>

#include "vmm_arena.hpp"
#include "check.h"

namespace {

constexpr uint64_t K = 64 << 10;
constexpr uint64_t S = 7;

vmm::Config small() { return vmm::Config::host().capacity(8 * K).reserve(64 * K).chunk(K); }

template <class F>
vmm::Status thrown_status(F &&f) {
  try {
    f();
  } catch (const vmm::Error &e) {
    return e.status();
  }
  return vmm::Status::Ok;
}

bool all(uint64_t p, uint64_t len, unsigned char v) {
  const unsigned char *b = reinterpret_cast<const unsigned char *>(static_cast<uintptr_t>(p));
  for (uint64_t i = 0; i < len; i++)
    if (b[i] != v) return false;
  return true;
}

void test_stream_allocations() {
  vmm::Arena arena(small());
  {
    vmm::Allocation x = arena.alloc_on_stream(3 * K, S);
    CHECK(x.ptr() % K == 0 && x.size() == 3 * K);
    std::memset(reinterpret_cast<void *>(static_cast<uintptr_t>(x.ptr())), 0x5a, 3 * K);
    x.free_on_stream(S);
  }
  uint64_t creates = arena.stats().driver_creates;
  vmm::Allocation y = arena.alloc_on_stream(3 * K, S);
  CHECK(arena.stats().driver_creates == creates);  // the chunks freed on S serve it
  vmm::Allocation g = arena.alloc_growable_on_stream(K, 16 * K, S);
  uint64_t gp = g.ptr();
  CHECK(g.resize_on_stream(4 * K, S) == gp);
  std::memset(reinterpret_cast<void *>(static_cast<uintptr_t>(gp)), 0x22, 4 * K);
  CHECK(all(gp, 4 * K, 0x22));
  CHECK(arena.stats().live_allocations == 2);
  // Errors: as alloc's and alloc_growable's, thrown or returned.
  CHECK(thrown_status([&] { arena.alloc_on_stream(0, S); }) == vmm::Status::InvalidArgument);
  CHECK(thrown_status([&] { arena.alloc_on_stream(100 * K, S); }) == vmm::Status::OutOfMemory);
  CHECK(thrown_status([&] { arena.alloc_growable_on_stream(2 * K, K, S); }) == vmm::Status::InvalidArgument);
  auto t = arena.try_alloc_on_stream(100 * K, S);
  CHECK(!t && t.status() == vmm::Status::OutOfMemory);
  CHECK(t.message().find("vmm_arena_alloc_on_stream") != std::string::npos);
  CHECK(arena.try_alloc_growable_on_stream(2 * K, K, S).status() == vmm::Status::InvalidArgument);
  auto ok = arena.try_alloc_growable_on_stream(K, 2 * K, S);
  CHECK(ok.ok() && ok->size() == K);
  CHECK(arena.stats().live_allocations == 3);
}

}  // namespace

int main() {
  test_stream_allocations();
  FINISH("test_wrapper_stream");
}
