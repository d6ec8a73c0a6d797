/* A stand-in for the CUDA runtime's allocation calls (libfake_cudart.so),
 * linked by test_preload: the "real" symbols that libvmm_arena_preload.so
 * passes foreign pointers on to (dlsym(RTLD_NEXT)) and asks for the current
 * device. Its memory is malloc's; it counts the calls that reach it. */
#include <stddef.h>
#include <stdlib.h>

static int current_device;
static int mallocs_seen;
static int frees_seen;

void fake_cudart_set_device(int device) { current_device = device; }
int fake_cudart_mallocs(void) { return mallocs_seen; }
int fake_cudart_frees(void) { return frees_seen; }

/* A negative device stands for "no usable device": cudaErrorInsufficientDriver. */
int cudaGetDevice(int *device) {
  if (current_device < 0) return 35;
  *device = current_device;
  return 0;
}

int cudaMalloc(void **ptr, size_t size) {
  mallocs_seen++;
  *ptr = malloc(size);
  return *ptr != NULL ? 0 : 2;
}

int cudaFree(void *ptr) {
  frees_seen++;
  free(ptr);
  return 0;
}
