/* A failed vmm_arena_resize_many changes no byte of any allocation: all or
 * nothing includes the contents. The batch shrinks x (4 -> 2 MiB), resizes
 * a 100 KiB small allocation s past its size class to 1.5 MiB (a copy into
 * a new chunk: the one x's shrink gave up) and grows y past the capacity.
 * It must fail with OUT_OF_MEMORY and leave x, s and y as they were. */
#include <stdint.h>
#include <string.h>

#include "check.h"

#define MIB ((uint64_t)1 << 20)

static uint8_t pattern(uint32_t seed, uint64_t i) {
  return (uint8_t)(seed * 131u + i * 7u + (i >> 9) + 1u);
}

static void fill(uint64_t ptr, uint64_t len, uint32_t seed) {
  uint8_t *p = (uint8_t *)(uintptr_t)ptr;
  for (uint64_t i = 0; i < len; i++) p[i] = pattern(seed, i);
}

static int intact(uint64_t ptr, uint64_t len, uint32_t seed) {
  const uint8_t *p = (const uint8_t *)(uintptr_t)ptr;
  for (uint64_t i = 0; i < len; i++)
    if (p[i] != pattern(seed, i)) return 0;
  return 1;
}

int main(void) {
  vmm_arena_config c;
  vmm_arena_config_default(&c);
  c.backend = VMM_ARENA_BACKEND_HOST;
  c.chunk_bytes = 2 * MIB;
  c.capacity_bytes = 8 * MIB; /* x's two chunks, s's slab, y's chunk */
  c.reserve_bytes = 128 * MIB;
  vmm_arena *a = NULL;
  OK(vmm_arena_create(&c, &a));
  vmm_arena_id ids[3];
  uint64_t ptrs[3], sizes[3] = {4 * MIB, 100 << 10, 2 * MIB};
  for (int i = 0; i < 3; i++) {
    OK(vmm_arena_alloc(a, sizes[i], &ids[i], &ptrs[i]));
    fill(ptrs[i], sizes[i], (uint32_t)i + 1);
  }
  uint64_t want[3] = {2 * MIB, 3 * MIB / 2, 64 * MIB};
  uint64_t out[3] = {7, 7, 7};
  EXPECT(vmm_arena_resize_many(a, ids, want, 3, out), VMM_ARENA_ERR_OUT_OF_MEMORY);
  CHECK(out[0] == 7 && out[1] == 7 && out[2] == 7);
  for (int i = 0; i < 3; i++) {
    uint64_t ptr = 0, size = 0;
    OK(vmm_arena_query(a, ids[i], &ptr, &size));
    CHECK(ptr == ptrs[i] && size == sizes[i]);
    CHECK(intact(ptrs[i], sizes[i], (uint32_t)i + 1));
  }
  for (int i = 0; i < 3; i++) OK(vmm_arena_free(a, ids[i]));
  vmm_arena_destroy(a);
  FINISH("test_batch_bytes");
}
