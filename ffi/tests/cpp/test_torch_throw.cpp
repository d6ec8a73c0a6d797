// vmm_arena_torch_malloc_or_throw, the hook PyTorch is pointed at: a
// failure throws std::bad_alloc (PyTorch then raises at the allocation)
// instead of returning NULL, which PyTorch would use as address 0.
#include <sys/types.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#include "check.h"

extern "C" {
void *vmm_arena_torch_malloc_or_throw(ssize_t size, int device, void *stream);
void vmm_arena_torch_free(void *ptr, ssize_t size, int device, void *stream);
vmm_arena_status vmm_arena_torch_stats(int device, vmm_arena_stats *stats);
}

namespace {

uint64_t live(int device) {
  vmm_arena_stats s;
  std::memset(&s, 0, sizeof s);
  s.struct_size = sizeof s;
  OK(vmm_arena_torch_stats(device, &s));
  return s.live_allocations;
}

// The what() of the bad_alloc that `size` throws, or "" when none.
std::string thrown(ssize_t size) {
  try {
    void *p = vmm_arena_torch_malloc_or_throw(size, 0, nullptr);
    vmm_arena_torch_free(p, size, 0, nullptr);
  } catch (const std::bad_alloc &e) {
    return e.what();
  }
  return "";
}

}  // namespace

int main() {
  CHECK(setenv("VMM_ARENA_CONF", "backend:host,capacity:64MiB,chunk:2MiB", 1) == 0);

  // A normal size works and is usable memory.
  auto *p = static_cast<unsigned char *>(vmm_arena_torch_malloc_or_throw(3 << 20, 0, nullptr));
  CHECK(p != nullptr && (reinterpret_cast<uintptr_t>(p) & 255) == 0);
  std::memset(p, 0x5a, 3 << 20);
  CHECK(p[(3 << 20) - 1] == 0x5a);
  CHECK(live(0) == 1);

  // Beyond the capacity: an exception with the reason, no allocation.
  std::string what = thrown(ssize_t{1} << 40);
  CHECK(what.find("vmm_arena: ") == 0);
  CHECK(what.find("out of memory") != std::string::npos);
  CHECK(live(0) == 1);
  // A negative size is refused the same way (PyTorch passes a size_t).
  CHECK(!thrown(-5).empty());
  // A bad configuration too (device 3 gets a new arena).
  CHECK(setenv("VMM_ARENA_CONF", "backend:tpu", 1) == 0);
  bool caught = false;
  try {
    (void)vmm_arena_torch_malloc_or_throw(100, 3, nullptr);
  } catch (const std::bad_alloc &e) {
    caught = std::string(e.what()).find("unknown backend") != std::string::npos;
  }
  CHECK(caught);

  // Size 0 is NULL without an exception, as PyTorch allows.
  CHECK(thrown(0).empty());
  CHECK(vmm_arena_torch_malloc_or_throw(0, 0, nullptr) == nullptr);

  // The allocator keeps working after a failure.
  void *q = vmm_arena_torch_malloc_or_throw(1000, 0, nullptr);
  CHECK(q != nullptr);
  vmm_arena_torch_free(q, 1000, 0, nullptr);
  vmm_arena_torch_free(p, 3 << 20, 0, nullptr);
  CHECK(live(0) == 0);
  FINISH("test_torch_throw");
}
