/* LD_PRELOAD mode: run under LD_PRELOAD=libvmm_arena_preload.so with
 * VMM_ARENA_CONF=backend:host,... (ffi/tests/c_programs.rs does, once as
 * is and once with VMM_ARENA_PRELOAD_ALL=1), linked to libvmm_arena and to
 * libfake_cudart.so (the "real" runtime). Raw cudaMalloc/cudaFree resolved
 * as any library would get them land, inside a tag, in the PyTorch hooks'
 * arenas, carry the tag, sleep and wake with it; outside a tag they go to
 * the real runtime (to the arena with VMM_ARENA_PRELOAD_ALL=1); foreign
 * pointers reach the real cudaFree. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#include "check.h"

void *vmm_arena_torch_malloc(ssize_t size, int device, void *stream);
vmm_arena_status vmm_arena_torch_stats(int device, vmm_arena_stats *stats);
uint64_t vmm_arena_torch_bad_frees(int device);
uint32_t vmm_arena_torch_set_tag(uint32_t tag);
vmm_arena_status vmm_arena_torch_sleep(int device, uint32_t tag, uint32_t flags);
vmm_arena_status vmm_arena_torch_wake(int device, uint32_t tag);

void fake_cudart_set_device(int device);
int fake_cudart_mallocs(void);
int fake_cudart_frees(void);

typedef int (*malloc_fn)(void **ptr, size_t size);
typedef int (*free_fn)(void *ptr);
typedef int (*malloc_async_fn)(void **ptr, size_t size, void *stream);
typedef int (*free_async_fn)(void *ptr, void *stream);
typedef int (*active_fn)(void);

#define LOOKUP(name, type) ((type)(uintptr_t)dlsym(RTLD_DEFAULT, (name)))

static vmm_arena_stats stats_of(int device) {
  vmm_arena_stats s;
  memset(&s, 0, sizeof s);
  s.struct_size = sizeof s;
  OK(vmm_arena_torch_stats(device, &s));
  return s;
}

static int all_bytes(const unsigned char *p, size_t n, unsigned char v) {
  for (size_t i = 0; i < n; i++)
    if (p[i] != v) return 0;
  return 1;
}

int main(void) {
  const char *conf = getenv("VMM_ARENA_CONF");
  CHECK(conf != NULL && strstr(conf, "backend:host") != NULL);
  const char *all_env = getenv("VMM_ARENA_PRELOAD_ALL");
  /* Whether allocations outside a tag come to the arena too. */
  const int all = all_env != NULL && strcmp(all_env, "1") == 0;

  /* What a library calling the runtime resolves: the preloaded symbols. */
  malloc_fn cuda_malloc = LOOKUP("cudaMalloc", malloc_fn);
  free_fn cuda_free = LOOKUP("cudaFree", free_fn);
  malloc_async_fn cuda_malloc_async = LOOKUP("cudaMallocAsync", malloc_async_fn);
  free_async_fn cuda_free_async = LOOKUP("cudaFreeAsync", free_async_fn);
  active_fn active = LOOKUP("vmm_arena_preload_active", active_fn);
  CHECK(cuda_malloc != NULL && cuda_free != NULL && cuda_malloc_async != NULL && cuda_free_async != NULL);
  CHECK(active != NULL && active() == 1);

  /* Outside any tag: the real runtime's memory (the arena's, tag 0, with
   * VMM_ARENA_PRELOAD_ALL=1). */
  enum { MIB = 1 << 20 };
  unsigned char *outside = NULL;
  CHECK(cuda_malloc((void **)&outside, 3 * MIB) == 0 && outside != NULL);
  memset(outside, 0x11, 3 * MIB);
  const uint64_t outside_in_arena = all ? 1 : 0;
  CHECK(stats_of(0).live_allocations == outside_in_arena);
  CHECK(fake_cudart_mallocs() == (all ? 0 : 1));

  /* Under tag 5: a backed-up allocation and an async one, in the arena. */
  uint32_t previous = vmm_arena_torch_set_tag(5);
  unsigned char *weights = NULL, *cache = NULL;
  CHECK(cuda_malloc((void **)&weights, 4 * MIB) == 0);
  CHECK(cuda_malloc_async((void **)&cache, 4 * MIB, NULL) == 0);
  CHECK(vmm_arena_torch_set_tag(previous) == 5);
  memset(weights, 0x5a, 4 * MIB);
  memset(cache, 0x77, 4 * MIB);
  vmm_arena_stats awake = stats_of(0);
  CHECK(awake.live_allocations == outside_in_arena + 2);
  CHECK(fake_cudart_mallocs() == (all ? 0 : 1));

  /* The tag's sleep covers both, and only them. */
  OK(vmm_arena_torch_sleep(0, 5, VMM_ARENA_SLEEP_BACKUP));
  vmm_arena_stats asleep = stats_of(0);
  CHECK(asleep.mapped_bytes + 8 * MIB <= awake.mapped_bytes);
  CHECK(all_bytes(outside, 3 * MIB, 0x11));
  OK(vmm_arena_torch_wake(0, 5));
  CHECK(stats_of(0).mapped_bytes == awake.mapped_bytes);
  CHECK(all_bytes(weights, 4 * MIB, 0x5a) && all_bytes(cache, 4 * MIB, 0x77));

  /* Frees of the arena's pointers go back to it. */
  CHECK(cuda_free(weights) == 0);
  CHECK(cuda_free_async(cache, NULL) == 0);
  CHECK(stats_of(0).live_allocations == outside_in_arena);

  /* A pointer the arena did not hand out reaches the real cudaFree, and is
   * not a bad free of the hooks. */
  void *foreign = malloc(64);
  CHECK(foreign != NULL);
  const int frees_before = fake_cudart_frees();
  CHECK(cuda_free(foreign) == 0);
  CHECK(fake_cudart_frees() == frees_before + 1);
  CHECK(vmm_arena_torch_bad_frees(0) == 0);

  /* The runtime's argument rules, inside a tag (the arena's answers). */
  previous = vmm_arena_torch_set_tag(5);
  CHECK(cuda_malloc(NULL, 10) == 1);
  void *zero = outside;
  CHECK(cuda_malloc(&zero, 0) == 0 && zero == NULL);
  CHECK(cuda_free(NULL) == 0 && cuda_free_async(NULL, NULL) == 0);
  /* Out of memory: cudaErrorMemoryAllocation, the pointer untouched. */
  void *huge = outside;
  CHECK(cuda_malloc(&huge, (size_t)1 << 40) == 2 && huge == outside);
  CHECK(stats_of(0).live_allocations == outside_in_arena);

  /* The device is the runtime's current one. */
  fake_cudart_set_device(1);
  void *on_one = NULL;
  CHECK(cuda_malloc(&on_one, 1000) == 0);
  fake_cudart_set_device(0);
  CHECK(stats_of(1).live_allocations == 1);
  CHECK(cuda_free(on_one) == 0);
  CHECK(stats_of(1).live_allocations == 0);

  /* A runtime without a usable device (no driver): device 0's arena. */
  fake_cudart_set_device(-1);
  void *no_device = NULL;
  CHECK(cuda_malloc(&no_device, 1000) == 0);
  fake_cudart_set_device(0);
  CHECK(stats_of(0).live_allocations == outside_in_arena + 1);
  CHECK(cuda_free(no_device) == 0);
  CHECK(vmm_arena_torch_set_tag(previous) == 5);

  CHECK(cuda_free(outside) == 0);
  CHECK(stats_of(0).live_allocations == 0);
  /* The stand-in runtime saw only what was outside a tag and the foreign
   * pointer. */
  CHECK(fake_cudart_mallocs() == (all ? 0 : 1) && fake_cudart_frees() == (all ? 1 : 2));
  FINISH("test_preload");
}
