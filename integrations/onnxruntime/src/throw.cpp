// The one piece of the allocator written in C++: ONNX Runtime's OrtAllocator
// interface has no way to return an error from Alloc, and ONNX Runtime does
// not check the pointer it gets (a null one is written through). It does
// catch C++ exceptions around kernels and at its C API boundary and turns
// them into an OrtStatus, so a refused allocation is reported by throwing.

#include <new>
#include <string>

namespace {

class ArenaAllocationError : public std::bad_alloc {
 public:
  explicit ArenaAllocationError(const char* message) : message_(message) {}
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  std::string message_;
};

}  // namespace

// Called from Rust (declared "C-unwind" there); the exception unwinds
// through the Rust Alloc frame, which holds nothing that needs dropping,
// into ONNX Runtime.
extern "C" [[noreturn]] void vmm_ort_throw_allocation_error(const char* message) {
  throw ArenaAllocationError(message);
}
