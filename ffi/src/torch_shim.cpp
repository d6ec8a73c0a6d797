// The throwing allocation hook for PyTorch's CUDAPluggableAllocator.
//
// PyTorch does not check the pointer its pluggable allocator returns: a NULL
// from vmm_arena_torch_malloc becomes a tensor at address 0 and an illegal
// address error later. PyTorch does turn a C++ exception thrown by the hook
// into a Python error at the allocation, so this hook throws on failure.
//
// The exception starts here, in C++, after the Rust function has returned:
// it never unwinds through Rust frames. Compiled by build.rs into the shared
// library only (PyTorch loads a .so); the static library has no C++ runtime
// dependency.
#include <sys/types.h>

#include <cstddef>
#include <new>
#include <string>

extern "C" void *vmm_arena_torch_malloc(ssize_t size, int device, void *stream);
extern "C" const char *vmm_arena_last_error(void);

namespace {

// A std::bad_alloc (what PyTorch and callers expect of an allocator) that
// carries the library's reason.
class TorchOutOfMemory : public std::bad_alloc {
 public:
  explicit TorchOutOfMemory(std::string message) : message_(std::move(message)) {}
  const char *what() const noexcept override { return message_.c_str(); }

 private:
  std::string message_;
};

}  // namespace

// Like vmm_arena_torch_malloc, but a failure for a non-zero size throws
// std::bad_alloc (what(): "vmm_arena: " and the last error) instead of
// returning NULL. Size 0 returns NULL, as PyTorch allows.
extern "C" __attribute__((visibility("default"))) void *vmm_arena_torch_malloc_or_throw(ssize_t size, int device,
                                                                                         void *stream) {
  void *p = vmm_arena_torch_malloc(size, device, stream);
  if (p == nullptr && size != 0) {
    throw TorchOutOfMemory(std::string("vmm_arena: ") + vmm_arena_last_error());
  }
  return p;
}
