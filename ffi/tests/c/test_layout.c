/* The block-in-chunk KV layout through the C ABI, on the host backend:
 * the layout of a geometry, token offsets, and block tables that stay
 * right across growth and a move (compaction), with the bytes written
 * through token offsets read back through the block table the way a paged
 * kernel reads them (base + block × chunk + layer offset + row). */
#include <stdint.h>
#include <string.h>

#include "check.h"

enum { K = 64 << 10 };

/* 4 layers, 2 KV heads of 16 fp16 elements: a token is 4 × 2 × 64 = 512
 * bytes of keys and values, so a 64 KiB chunk holds 128 tokens. */
static const vmm_arena_kv_geometry G = {4, 2, 16, 2};

static vmm_arena_kv_layout layout_of(uint64_t chunk, uint64_t block_tokens) {
  vmm_arena_kv_layout l;
  memset(&l, 0, sizeof l);
  l.struct_size = sizeof l;
  OK(vmm_arena_kv_layout_get(&G, chunk, block_tokens, &l));
  return l;
}

/* The base from the snapshot's "base" field, to check vmm_arena_va_range
 * against. */
static uint64_t snapshot_base(vmm_arena *a) {
  size_t need = 0;
  OK(vmm_arena_snapshot_json(a, NULL, 0, &need));
  char *buf = malloc(need);
  CHECK(buf != NULL);
  OK(vmm_arena_snapshot_json(a, buf, need, &need));
  const char *at = strstr(buf, "\"base\":");
  CHECK(at != NULL);
  uint64_t base = strtoull(at + 7, NULL, 10);
  free(buf);
  return base;
}

static uint64_t base_of(vmm_arena *a) {
  uint64_t base = 0, bytes = 0;
  OK(vmm_arena_va_range(a, &base, &bytes));
  CHECK(base == snapshot_base(a) && base != 0 && bytes > 0);
  return base;
}

static size_t table(vmm_arena *a, vmm_arena_id id, int32_t *blocks, size_t cap) {
  size_t n = 0;
  OK(vmm_arena_block_table(a, id, NULL, 0, &n));
  CHECK(n <= cap);
  OK(vmm_arena_block_table(a, id, blocks, cap, &n));
  return n;
}

static uint8_t mark(uint32_t layer, uint32_t value, uint64_t token) {
  return (uint8_t)(1 + layer * 37 + value * 101 + token * 7);
}

/* Writes every (layer, K/V, token) row's first byte through the token
 * offsets from the allocation's address. */
static void write_rows(uint64_t ptr, const vmm_arena_kv_layout *l, uint64_t tokens) {
  for (uint32_t layer = 0; layer < G.layers; layer++)
    for (uint32_t v = 0; v < 2; v++)
      for (uint64_t t = 0; t < tokens; t++) {
        uint64_t off = 0;
        OK(vmm_arena_kv_token_offset(&G, l->chunk_bytes, l->block_tokens, layer, v, t, &off));
        *(uint8_t *)(uintptr_t)(ptr + off) = mark(layer, v, t);
      }
}

/* Reads them back as a paged kernel does: block b of the table, layer's K
 * (or V) slab, row within the block. */
static void read_paged(uint64_t base, const int32_t *blocks, size_t n, const vmm_arena_kv_layout *l, uint64_t tokens) {
  uint64_t row = (uint64_t)G.kv_heads * G.head_dim * G.dtype_bytes;
  CHECK(n == (tokens + l->block_tokens - 1) / l->block_tokens);
  for (uint32_t layer = 0; layer < G.layers; layer++)
    for (uint32_t v = 0; v < 2; v++)
      for (uint64_t t = 0; t < tokens; t++) {
        uint64_t b = t / l->block_tokens, within = t % l->block_tokens;
        uint64_t slab = (2 * (uint64_t)layer + v) * l->slab_bytes;
        uint64_t at = base + (uint64_t)blocks[b] * l->chunk_bytes + slab + within * row;
        if (*(const uint8_t *)(uintptr_t)at != mark(layer, v, t)) {
          CHECK(!"a row read through the block table differs from the one written");
        }
      }
}

static void layout_arithmetic(void) {
  vmm_arena_kv_layout l = layout_of(K, 0);
  CHECK(l.chunk_bytes == K && l.block_tokens == 128);
  CHECK(l.slab_bytes == 128 * 64 && l.used_bytes == K && l.unused_bytes == 0);
  l = layout_of(K, 100);
  CHECK(l.block_tokens == 100 && l.used_bytes == 100 * 512 && l.unused_bytes == K - 100 * 512);
  uint64_t off = 0;
  OK(vmm_arena_kv_token_offset(&G, K, 100, 1, 1, 205, &off));
  /* token 205: block 2, row 5; layer 1's values: slab 3. */
  CHECK(off == 2 * (uint64_t)K + 3 * l.slab_bytes + 5 * 64);

  /* Refusals. */
  vmm_arena_kv_geometry zero = {0, 2, 16, 2};
  EXPECT(vmm_arena_kv_layout_get(&zero, K, 0, &l), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_kv_layout_get(NULL, K, 0, &l), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_kv_layout_get(&G, K, 0, NULL), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_kv_layout_get(&G, 256, 0, &l), VMM_ARENA_ERR_INVALID_ARGUMENT); /* no token fits */
  EXPECT(vmm_arena_kv_layout_get(&G, K, 129, &l), VMM_ARENA_ERR_INVALID_ARGUMENT);
  l.struct_size = 8;
  EXPECT(vmm_arena_kv_layout_get(&G, K, 0, &l), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_kv_token_offset(&G, K, 0, 4, 0, 0, &off), VMM_ARENA_ERR_INVALID_ARGUMENT); /* layer */
  EXPECT(vmm_arena_kv_token_offset(&G, K, 0, 0, 2, 0, &off), VMM_ARENA_ERR_INVALID_ARGUMENT); /* value */
  EXPECT(vmm_arena_kv_token_offset(&G, K, 0, 0, 0, UINT64_MAX, &off), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_kv_token_offset(&G, K, 0, 0, 0, 0, NULL), VMM_ARENA_ERR_INVALID_ARGUMENT);
}

static void tables_follow_growth_and_moves(void) {
  vmm_arena_config c;
  vmm_arena_config_default(&c);
  c.backend = VMM_ARENA_BACKEND_HOST;
  c.capacity_bytes = 32 * K;
  c.reserve_bytes = 32 * K;
  c.chunk_bytes = K;
  vmm_arena *a = NULL;
  OK(vmm_arena_create(&c, &a));
  uint64_t base = base_of(a);
  vmm_arena_kv_layout l = layout_of(K, 0);
  int32_t blocks[32];

  /* A hole in front, then a request of 300 tokens (3 blocks) growable to 8. */
  vmm_arena_id hole, kv, small;
  uint64_t hp, p, sp;
  OK(vmm_arena_alloc(a, 10 * K, &hole, &hp));
  OK(vmm_arena_alloc_growable(a, 3 * K, 8 * K, &kv, &p));
  write_rows(p, &l, 300);
  size_t n = table(a, kv, blocks, 32);
  CHECK(n == 3 && blocks[0] == (int32_t)((p - base) / K) && blocks[1] == blocks[0] + 1 && blocks[2] == blocks[0] + 2);
  read_paged(base, blocks, n, &l, 300);

  /* Growth in place appends entries. */
  OK(vmm_arena_resize(a, kv, 5 * K, &p));
  n = table(a, kv, blocks, 32);
  CHECK(n == 5);
  write_rows(p, &l, 600);
  read_paged(base, blocks, n, &l, 600);

  /* A move (compaction closes the hole in front): every entry changes, the
   * rows read the same through the new table. */
  int32_t before = blocks[0];
  OK(vmm_arena_free(a, hole));
  OK(vmm_arena_compact(a, NULL));
  n = table(a, kv, blocks, 32);
  CHECK(n == 5 && blocks[0] != before);
  read_paged(base, blocks, n, &l, 600);

  /* Too small a buffer: nothing written, the count given. */
  int32_t one[1] = {-7};
  size_t count = 0;
  OK(vmm_arena_block_table(a, kv, one, 1, &count));
  CHECK(count == 5 && one[0] == -7);

  /* Refusals: a small allocation (in a slab), an unknown id, NULL out. */
  OK(vmm_arena_alloc(a, 100, &small, &sp));
  EXPECT(vmm_arena_block_table(a, small, blocks, 32, &count), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_block_table(a, 12345, blocks, 32, &count), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
  EXPECT(vmm_arena_block_table(a, kv, blocks, 32, NULL), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_block_table(a, kv, NULL, 32, &count), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_block_table(NULL, kv, blocks, 32, &count), VMM_ARENA_ERR_INVALID_ARGUMENT);
  OK(vmm_arena_free(a, small));
  OK(vmm_arena_free(a, kv));
  vmm_arena_destroy(a);
}

/* An engine's paged block pool: a block is a one-chunk allocation, its
 * block-table entry (ptr - base) / chunk. Freed blocks' chunks stay mapped
 * where they lie, so a second wave needing no more blocks at once makes no
 * driver call and takes the same chunks. */
static void block_pool_of_one_chunk_allocations(void) {
  vmm_arena_config c;
  vmm_arena_config_default(&c);
  c.backend = VMM_ARENA_BACKEND_HOST;
  c.capacity_bytes = 32 * K;
  c.reserve_bytes = 64 * K;
  c.chunk_bytes = K;
  vmm_arena *a = NULL;
  OK(vmm_arena_create(&c, &a));
  uint64_t base = 0, bytes = 0;
  OK(vmm_arena_va_range(a, &base, NULL));
  OK(vmm_arena_va_range(a, NULL, &bytes));
  OK(vmm_arena_va_range(a, NULL, NULL));
  CHECK(bytes == 64 * K);
  EXPECT(vmm_arena_va_range(NULL, &base, &bytes), VMM_ARENA_ERR_INVALID_ARGUMENT);

  enum { N = 20 };
  vmm_arena_id ids[N];
  uint64_t ptrs[N];
  int seen[64] = {0};
  for (int i = 0; i < N; i++) {
    OK(vmm_arena_alloc(a, K, &ids[i], &ptrs[i]));
    int32_t entry = -1;
    size_t n = 0;
    OK(vmm_arena_block_table(a, ids[i], &entry, 1, &n));
    CHECK(n == 1 && (uint64_t)entry == (ptrs[i] - base) / K);
    seen[entry] = 1;
    *(uint64_t *)(uintptr_t)ptrs[i] = (uint64_t)i;
  }
  for (int i = 0; i < N; i += 2) OK(vmm_arena_free(a, ids[i])); /* out of order */
  for (int i = 1; i < N; i += 2) OK(vmm_arena_free(a, ids[i]));
  vmm_arena_stats before;
  memset(&before, 0, sizeof before);
  before.struct_size = sizeof before;
  OK(vmm_arena_stats_get(a, &before));
  for (int i = 0; i < N - 3; i++) {
    OK(vmm_arena_alloc(a, K, &ids[i], &ptrs[i]));
    CHECK(seen[(ptrs[i] - base) / K]);
  }
  vmm_arena_stats after;
  memset(&after, 0, sizeof after);
  after.struct_size = sizeof after;
  OK(vmm_arena_stats_get(a, &after));
  CHECK(after.driver_creates == before.driver_creates && after.driver_maps == before.driver_maps);
  CHECK(after.driver_unmaps == before.driver_unmaps && after.driver_releases == before.driver_releases);
  for (int i = 0; i < N - 3; i++) OK(vmm_arena_free(a, ids[i]));
  vmm_arena_destroy(a);
}

int main(void) {
  layout_arithmetic();
  tables_follow_growth_and_moves();
  block_pool_of_one_chunk_allocations();
  FINISH("test_layout");
}
