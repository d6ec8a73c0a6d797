// The throw behind vmm_arena_torch_malloc_or_throw (torch_hooks.rs).
//
// PyTorch does not check the pointer a pluggable allocator returns; it does
// turn a C++ exception thrown by the hook into a Python error at the
// allocation. Rust cannot throw one, so it calls this function, declared
// "C-unwind" on the Rust side: the exception passes one Rust frame that holds
// nothing to drop.
#include <new>
#include <string>

namespace {

// A std::bad_alloc (what callers of an allocator expect) with the reason.
class ArenaOutOfMemory : public std::bad_alloc {
 public:
  explicit ArenaOutOfMemory(std::string message) : message_(std::move(message)) {}
  const char *what() const noexcept override { return message_.c_str(); }

 private:
  std::string message_;
};

}  // namespace

extern "C" __attribute__((visibility("hidden"))) [[noreturn]] void vmm_arena_py_throw_bad_alloc(const char *what) {
  throw ArenaOutOfMemory(std::string("vmm_arena: ") + (what ? what : "allocation failed"));
}
