// Tags at allocation time through the C++17 wrapper, on the host backend:
// alloc_tagged / alloc_growable_tagged, small allocations of two tags in
// separate slabs, one tag asleep with the other's bytes intact, set_tag
// moving a small allocation and its refusals as exceptions and Results.
#include <cstdint>
#include <cstring>

#include "vmm_arena.hpp"
#include "check.h"

namespace {

constexpr uint64_t K = 64 << 10;

template <class F>
vmm::Status thrown_status(F &&f) {
  try {
    f();
  } catch (const vmm::Error &e) {
    return e.status();
  }
  return vmm::Status::Ok;
}

bool holds(uint64_t p, unsigned char seed, size_t n) {
  const unsigned char *b = reinterpret_cast<const unsigned char *>(static_cast<uintptr_t>(p));
  for (size_t i = 0; i < n; i++)
    if (b[i] != seed) return false;
  return true;
}

void two_tags() {
  vmm::Arena arena(vmm::Config::host().capacity(8 * K).reserve(32 * K).chunk(K));
  vmm::Allocation w = arena.alloc_tagged(1000, 1);
  vmm::Allocation k = arena.alloc_tagged(1000, 2);
  vmm::Allocation g = arena.alloc_growable_tagged(K, 4 * K, 1);
  CHECK(w.ptr() / K != k.ptr() / K);
  std::memset(w.as<unsigned char>(), 0x44, 1000);
  std::memset(k.as<unsigned char>(), 0x55, 1000);
  uint64_t wp = w.ptr();
  arena.sleep(1, vmm::sleep_backup);
  CHECK(holds(k.ptr(), 0x55, 1000));
  CHECK(thrown_status([&] { w.resize(5000); }) == vmm::Status::Asleep);
  CHECK(thrown_status([&] { w.set_tag(2); }) == vmm::Status::Asleep);
  CHECK(!w.try_set_tag(2).ok());
  arena.wake(1);
  CHECK(w.ptr() == wp);
  CHECK(holds(wp, 0x44, 1000));
  // set_tag moves a small allocation into the other tag's slab.
  w.set_tag(2);
  CHECK(w.ptr() / K == k.ptr() / K);
  CHECK(holds(w.ptr(), 0x44, 1000));
  k.pin();
  CHECK(thrown_status([&] { k.set_tag(3); }) == vmm::Status::Pinned);
  k.unpin();
  auto r = arena.try_alloc_tagged(100 * K, 9);
  CHECK(!r.ok() && r.status() == vmm::Status::OutOfMemory);
  CHECK(arena.try_alloc_growable_tagged(2 * K, K, 9).status() == vmm::Status::InvalidArgument);
}

}  // namespace

int main() {
  two_tags();
  FINISH("test_tags_cpp");
}
