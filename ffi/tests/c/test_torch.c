/* PyTorch's pluggable-allocator entry points, on the host backend (selected
 * through VMM_ARENA_CONF, as a user would select the CUDA one). */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#include "check.h"

/* The prototypes PyTorch's CUDAPluggableAllocator expects (cudaStream_t is a pointer). */
void *vmm_arena_torch_malloc(ssize_t size, int device, void *stream);
void vmm_arena_torch_free(void *ptr, ssize_t size, int device, void *stream);
vmm_arena_status vmm_arena_torch_stats(int device, vmm_arena_stats *stats);
uint64_t vmm_arena_torch_bad_frees(int device);
uint64_t vmm_arena_torch_set_margin(uint64_t margin);

static vmm_arena_stats stats_of(int device) {
  vmm_arena_stats s;
  memset(&s, 0, sizeof s);
  s.struct_size = sizeof s;
  OK(vmm_arena_torch_stats(device, &s));
  return s;
}

int main(void) {
  CHECK(setenv("VMM_ARENA_CONF", "backend:host,capacity:256MiB,chunk:2MiB,retain:all", 1) == 0);

  /* Small and large allocations, written and read back. */
  enum { N = 64 };
  unsigned char *p[N];
  for (int i = 0; i < N; i++) {
    ssize_t size = (i % 4 == 0) ? (3 << 20) : (ssize_t)(100 + i * 1000);
    p[i] = vmm_arena_torch_malloc(size, 0, NULL);
    CHECK(p[i] != NULL);
    CHECK(((uintptr_t)p[i] & 255) == 0);
    memset(p[i], i, (size_t)size);
  }
  vmm_arena_stats s = stats_of(0);
  CHECK(s.live_allocations == N);
  for (int i = 0; i < N; i++) {
    ssize_t size = (i % 4 == 0) ? (3 << 20) : (ssize_t)(100 + i * 1000);
    CHECK(p[i][0] == (unsigned char)i && p[i][size - 1] == (unsigned char)i);
  }

  /* Nothing moves: PyTorch holds raw pointers. A compaction-worthy hole
   * pattern plus a large request must not relocate anything. */
  for (int i = 0; i < N; i += 2) vmm_arena_torch_free(p[i], 0, 0, NULL);
  void *big = vmm_arena_torch_malloc(16 << 20, 0, NULL);
  CHECK(big != NULL);
  for (int i = 1; i < N; i += 2) CHECK(p[i][0] == (unsigned char)i);
  CHECK(stats_of(0).moves == 0);

  /* A pointer that was never allocated, and a double free: reported,
   * counted, nothing corrupted. */
  int on_stack;
  vmm_arena_torch_free(&on_stack, 4, 0, NULL);
  CHECK(vmm_arena_torch_bad_frees(0) == 1);
  CHECK(strstr(vmm_arena_last_error(), "not allocated here") != NULL);
  vmm_arena_torch_free(p[0], 0, 0, NULL); /* freed above already */
  CHECK(vmm_arena_torch_bad_frees(0) == 2);
  for (int i = 1; i < N; i += 2) CHECK(p[i][0] == (unsigned char)i);
  CHECK(stats_of(0).live_allocations == N / 2 + 1);

  /* Zero and negative sizes give NULL; freeing NULL is a no-op. */
  CHECK(vmm_arena_torch_malloc(0, 0, NULL) == NULL);
  CHECK(vmm_arena_torch_malloc(-5, 0, NULL) == NULL);
  vmm_arena_torch_free(NULL, 0, 0, NULL);

  /* Out of memory is NULL with a reason, and the allocator keeps working. */
  CHECK(vmm_arena_torch_malloc((ssize_t)1 << 40, 0, NULL) == NULL);
  CHECK(strstr(vmm_arena_last_error(), "out of memory") != NULL);

  /* A second device gets its own arena. */
  void *d1 = vmm_arena_torch_malloc(1000, 1, NULL);
  CHECK(d1 != NULL);
  CHECK(stats_of(1).live_allocations == 1);
  vmm_arena_torch_free(d1, 1000, 1, NULL);
  CHECK(stats_of(1).live_allocations == 0);

  for (int i = 1; i < N; i += 2) vmm_arena_torch_free(p[i], 0, 0, NULL);
  vmm_arena_torch_free(big, 0, 0, NULL);
  CHECK(stats_of(0).live_allocations == 0);
  CHECK(vmm_arena_torch_bad_frees(0) == 2);

  /* A margin, on a fresh arena (device 2, 256 MiB): a request leaving less
   * of the capacity free is refused with a reason and changes nothing;
   * freed memory counts as free again; 0 turns the margin off. */
  CHECK(vmm_arena_torch_set_margin((uint64_t)250 << 20) == 0);
  void *fits = vmm_arena_torch_malloc(4 << 20, 2, NULL); /* leaves 252 MiB */
  CHECK(fits != NULL);
  CHECK(vmm_arena_torch_malloc(4 << 20, 2, NULL) == NULL); /* would leave 248 */
  CHECK(strstr(vmm_arena_last_error(), "under the margin") != NULL);
  CHECK(stats_of(2).live_allocations == 1);
  vmm_arena_torch_free(fits, 0, 2, NULL);
  void *again = vmm_arena_torch_malloc(4 << 20, 2, NULL);
  CHECK(again != NULL);
  CHECK(vmm_arena_torch_set_margin(0) == (uint64_t)250 << 20);
  void *after = vmm_arena_torch_malloc(4 << 20, 2, NULL);
  CHECK(after != NULL);
  vmm_arena_torch_free(again, 0, 2, NULL);
  vmm_arena_torch_free(after, 0, 2, NULL);
  CHECK(stats_of(2).live_allocations == 0);

  /* A bad configuration is an error, not a crash (device 7 is new). */
  CHECK(setenv("VMM_ARENA_CONF", "backend:tpu", 1) == 0);
  CHECK(vmm_arena_torch_malloc(100, 7, NULL) == NULL);
  CHECK(strstr(vmm_arena_last_error(), "unknown backend") != NULL);
  FINISH("test_torch");
}
