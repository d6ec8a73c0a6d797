/* LD_PRELOAD mode: the CUDA runtime's raw allocation calls made inside a
 * region routed to the arenas of the PyTorch hooks.
 *
 * Built as libvmm_arena_preload.so (by ffi/build.rs next to libvmm_arena.so,
 * and by python/build.rs into the Python extension, which writes it out on
 * request). Run a program with LD_PRELOAD=libvmm_arena_preload.so and its
 * cudaMalloc/cudaFree/cudaMallocAsync/cudaFreeAsync (the runtime API's C
 * signatures and cudaError_t codes) come here first:
 *
 *  - an allocation made while the calling thread's tag is not 0 (inside a
 *    region: vmm_arena_torch_set_tag, or a Python region) goes to
 *    vmm_arena_torch_malloc: the arena of the current device (the real
 *    runtime's cudaGetDevice; 0 when no runtime is loaded or it has no
 *    usable device), with that tag, so the hooks' sleep/wake (pause/resume)
 *    cover it. One made with tag 0 (outside any region) goes to the real
 *    runtime, as torch_memory_saver's preload mode does, so memory outside
 *    regions stays ordinary cudaMalloc memory (legacy IPC handles work on
 *    it); with $VMM_ARENA_PRELOAD_ALL=1, or when no real runtime is loaded,
 *    it goes to the arena too (tag 0: never paused);
 *  - a free of a pointer the hooks handed out goes back to its arena
 *    (stream-ordered, on the free's stream: stream 0 for cudaFree); any
 *    other pointer goes to the real symbol (dlsym(RTLD_NEXT)), or is
 *    cudaErrorInvalidValue when there is none.
 *
 * The hooks are found once, at the first call: in the library named by
 * $VMM_ARENA_PRELOAD_HOOKS (dlopen'ed; the Python extension module, which
 * a Python process shares with `import vmm_arena`), or else among the
 * libraries already loaded (a program linked to libvmm_arena.so). With no
 * hooks every call goes to the real runtime. The real symbols are looked up
 * until found (a runtime may be loaded after the first call).
 *
 * This file links to nothing but libc/libdl, so a process that never loads
 * CUDA (a shell started by a preloaded parent) runs unchanged. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

/* The runtime API's types and the codes returned here. */
typedef int cudaError_t;
typedef void *cudaStream_t;
enum {
  cuda_success = 0,
  cuda_error_invalid_value = 1,
  cuda_error_memory_allocation = 2,
  cuda_error_unknown = 999,
};

#define EXPORT __attribute__((visibility("default")))

typedef void *(*hook_malloc_fn)(ssize_t size, int device, void *stream);
typedef int (*hook_release_fn)(void *ptr, void *stream);
typedef uint32_t (*hook_tag_fn)(void);
typedef cudaError_t (*real_malloc_fn)(void **ptr, size_t size);
typedef cudaError_t (*real_free_fn)(void *ptr);
typedef cudaError_t (*real_malloc_async_fn)(void **ptr, size_t size, cudaStream_t stream);
typedef cudaError_t (*real_free_async_fn)(void *ptr, cudaStream_t stream);
typedef cudaError_t (*real_get_device_fn)(int *device);

static struct {
  hook_malloc_fn malloc;
  hook_release_fn release;
  hook_tag_fn tag;
  int route_all;
} resolved;
static pthread_once_t resolve_once = PTHREAD_ONCE_INIT;

/* dlsym returns an object pointer; POSIX guarantees it converts to a
 * function pointer. */
#define LOOKUP(handle, name, type) ((type)(uintptr_t)dlsym((handle), (name)))

static void resolve(void) {
  const char *path = getenv("VMM_ARENA_PRELOAD_HOOKS");
  void *hooks = RTLD_DEFAULT; /* NULL, as a handle: search every loaded library */
  int found = 1;
  if (path != NULL && path[0] != '\0') {
    /* Kept open for the life of the process. */
    hooks = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    found = hooks != NULL;
  }
  if (found) {
    hook_malloc_fn m = LOOKUP(hooks, "vmm_arena_torch_malloc", hook_malloc_fn);
    hook_release_fn r = LOOKUP(hooks, "vmm_arena_torch_release", hook_release_fn);
    hook_tag_fn t = LOOKUP(hooks, "vmm_arena_torch_tag", hook_tag_fn);
    if (m != NULL && r != NULL && t != NULL) {
      resolved.malloc = m;
      resolved.release = r;
      resolved.tag = t;
    }
  }
  const char *all = getenv("VMM_ARENA_PRELOAD_ALL");
  resolved.route_all = all != NULL && strcmp(all, "1") == 0;
}

static void ensure_resolved(void) { (void)pthread_once(&resolve_once, resolve); }

/* The real symbol `name` (the next definition after this library), cached
 * once found. */
static void *real_symbol(const char *name, void **cache) {
  void *f = __atomic_load_n(cache, __ATOMIC_ACQUIRE);
  if (f == NULL) {
    f = dlsym(RTLD_NEXT, name);
    if (f != NULL) __atomic_store_n(cache, f, __ATOMIC_RELEASE);
  }
  return f;
}

#define REAL(name, type)                                            \
  __extension__({                                                   \
    static void *cache_;                                            \
    (type)(uintptr_t)real_symbol(#name, &cache_);                   \
  })

/* Whether an allocation goes to the arenas (see the top of the file). */
static int to_arena(int have_real) {
  if (resolved.malloc == NULL) return 0;
  return resolved.route_all || !have_real || resolved.tag() != 0;
}

/* The real runtime's current device; 0 when no runtime is loaded, or when
 * it has no usable device (no driver: the arena then decides, e.g. on the
 * host backend). */
static int current_device(void) {
  real_get_device_fn get = LOOKUP(RTLD_DEFAULT, "cudaGetDevice", real_get_device_fn);
  int device = 0;
  if (get == NULL || get(&device) != cuda_success) return 0;
  return device;
}

static cudaError_t arena_malloc(void **ptr, size_t size, cudaStream_t stream) {
  if (ptr == NULL) return cuda_error_invalid_value;
  if (size == 0) {
    *ptr = NULL;
    return cuda_success;
  }
  if (size > (size_t)SSIZE_MAX) return cuda_error_memory_allocation;
  void *p = resolved.malloc((ssize_t)size, current_device(), stream);
  if (p == NULL) return cuda_error_memory_allocation;
  *ptr = p;
  return cuda_success;
}

/* 1: the hooks freed it; 0: not theirs; -1: theirs, but the free failed. */
static int arena_release(void *ptr, cudaStream_t stream) {
  return resolved.release != NULL ? resolved.release(ptr, stream) : 0;
}

static cudaError_t release_status(int released) {
  return released > 0 ? cuda_success : cuda_error_unknown;
}

EXPORT cudaError_t cudaMalloc(void **ptr, size_t size) {
  ensure_resolved();
  real_malloc_fn real = REAL(cudaMalloc, real_malloc_fn);
  if (to_arena(real != NULL)) return arena_malloc(ptr, size, NULL);
  return real != NULL ? real(ptr, size) : cuda_error_memory_allocation;
}

EXPORT cudaError_t cudaFree(void *ptr) {
  if (ptr == NULL) return cuda_success;
  ensure_resolved();
  int released = arena_release(ptr, NULL);
  if (released != 0) return release_status(released);
  real_free_fn real = REAL(cudaFree, real_free_fn);
  return real != NULL ? real(ptr) : cuda_error_invalid_value;
}

EXPORT cudaError_t cudaMallocAsync(void **ptr, size_t size, cudaStream_t stream) {
  ensure_resolved();
  real_malloc_async_fn real = REAL(cudaMallocAsync, real_malloc_async_fn);
  if (to_arena(real != NULL)) return arena_malloc(ptr, size, stream);
  return real != NULL ? real(ptr, size, stream) : cuda_error_memory_allocation;
}

EXPORT cudaError_t cudaFreeAsync(void *ptr, cudaStream_t stream) {
  if (ptr == NULL) return cuda_success;
  ensure_resolved();
  int released = arena_release(ptr, stream);
  if (released != 0) return release_status(released);
  real_free_async_fn real = REAL(cudaFreeAsync, real_free_async_fn);
  return real != NULL ? real(ptr, stream) : cuda_error_invalid_value;
}

/* 1 when the hooks were found (allocations in regions go to the arenas),
 * else 0. */
EXPORT int vmm_arena_preload_active(void) {
  ensure_resolved();
  return resolved.malloc != NULL;
}
