/*
 * test_api (see test_api.c): Resizes, compaction and implicit moves keeping contents, small
 * allocations, pinning.
 */
#include "api.h"

void test_resize_keeps_contents(void) {
  vmm_arena *a = make(32, 128, 0);
  moves_t mv;
  memset(&mv, 0, sizeof mv);
  OK(vmm_arena_set_move_callback(a, record_move, &mv));

  /* Growable: growth within the reservation never moves. */
  vmm_arena_id g;
  uint64_t p, q, sz;
  OK(vmm_arena_alloc_growable(a, K + 100, 4 * K, &g, &p));
  CHECK(p % 256 == 0 && p % K == 0);
  fill(p, K + 100, 1);
  OK(vmm_arena_resize(a, g, 3 * K + 5, &q));
  CHECK(q == p);
  CHECK(intact(p, K + 100, 1));
  fill(p + K + 100, 2 * K - 95, 2);
  OK(vmm_arena_query(a, g, &q, &sz));
  CHECK(q == p && sz == 3 * K + 5);
  /* Shrinking keeps the first bytes and the reservation. */
  OK(vmm_arena_resize(a, g, K / 2, &q));
  CHECK(q == p && intact(p, K / 2, 1));
  OK(vmm_arena_query(a, g, NULL, &sz));
  CHECK(sz == K / 2);
  CHECK(stats_of(a).mapped_bytes == K);
  OK(vmm_arena_resize(a, g, 4 * K, &q));
  CHECK(q == p && intact(p, K / 2, 1));
  CHECK(stats_of(a).mapped_bytes == 4 * K);
  CHECK(mv.count == 0);

  /* Growth beyond the reservation with a neighbour right after: a move by
   * remapping, reported once, contents intact at the new address and still
   * readable at the old one until release_retired. */
  fill(p, 4 * K, 3);
  vmm_arena_id n;
  uint64_t pn;
  OK(vmm_arena_alloc(a, K, &n, &pn));
  CHECK(pn == p + 4 * K);
  fill(pn, K, 4);
  vmm_arena_stats before = stats_of(a);
  OK(vmm_arena_resize(a, g, 6 * K, &q));
  CHECK(q != p);
  CHECK(intact(q, 4 * K, 3));
  CHECK(intact(p, 4 * K, 3)); /* the old range is retired, not unmapped */
  CHECK(intact(pn, K, 4));
  CHECK(mv.count == 1);
  CHECK(mv.id[0] == g && mv.old_ptr[0] == p && mv.new_ptr[0] == q && mv.size[0] == 6 * K);
  vmm_arena_stats after = stats_of(a);
  CHECK(after.moves == before.moves + 1);
  CHECK(after.retired_va_bytes == 4 * K);
  CHECK(after.live_bytes == 6 * K + K);
  CHECK(ptr_of(a, g) == q);
  OK(vmm_arena_release_retired(a));
  CHECK(stats_of(a).retired_va_bytes == 0);
  OK(vmm_arena_release_retired(a)); /* nothing to do is fine */
  fill(q + 4 * K, 2 * K, 5);
  CHECK(intact(q, 4 * K, 3) && intact(q + 4 * K, 2 * K, 5));

  CHECK(intact(ptr_of(a, g), 4 * K, 3));
  OK(vmm_arena_free(a, g));
  OK(vmm_arena_free(a, n));
  CHECK(stats_of(a).live_allocations == 0 && stats_of(a).live_bytes == 0);
  OK(vmm_arena_set_move_callback(a, NULL, NULL));
  vmm_arena_destroy(a);

  /* A plain allocation grows in place into free space after it, and moves
   * when its neighbour is in the way. */
  a = make(32, 128, 0);
  memset(&mv, 0, sizeof mv);
  OK(vmm_arena_set_move_callback(a, record_move, &mv));
  vmm_arena_id x, y;
  uint64_t px, py;
  OK(vmm_arena_alloc(a, 2 * K, &x, &px));
  fill(px, 2 * K, 6);
  OK(vmm_arena_alloc(a, K, &y, &py));
  CHECK(py == px + 2 * K);
  fill(py, K, 7);
  OK(vmm_arena_resize(a, y, 3 * K, &q)); /* free space after y */
  CHECK(q == py && intact(py, K, 7));
  CHECK(mv.count == 0);
  OK(vmm_arena_resize(a, x, 5 * K, &q));
  CHECK(q != px && intact(q, 2 * K, 6));
  CHECK(mv.count == 1 && mv.id[0] == x && mv.old_ptr[0] == px && mv.new_ptr[0] == q && mv.size[0] == 5 * K);
  px = q;
  OK(vmm_arena_resize(a, x, K, &q)); /* shrink */
  CHECK(q == px && intact(px, K, 6));
  CHECK(intact(py, K, 7));
  OK(vmm_arena_free(a, x));
  OK(vmm_arena_free(a, y));
  CHECK(stats_of(a).live_allocations == 0 && stats_of(a).live_bytes == 0);
  OK(vmm_arena_set_move_callback(a, NULL, NULL));
  vmm_arena_destroy(a);
}

void test_compaction_keeps_contents(void) {
  vmm_arena *a = make(32, 32, 0);
  moves_t mv;
  memset(&mv, 0, sizeof mv);
  OK(vmm_arena_set_move_callback(a, record_move, &mv));
  vmm_arena_id ids[12];
  uint64_t ptrs[12];
  for (uint32_t i = 0; i < 12; i++) {
    OK(vmm_arena_alloc(a, (i % 3 + 1) * K - 7, &ids[i], &ptrs[i]));
    fill(ptrs[i], (i % 3 + 1) * K - 7, 100 + i);
  }
  for (uint32_t i = 0; i < 12; i += 2) OK(vmm_arena_free(a, ids[i]));
  OK(vmm_arena_pin(a, ids[9]));
  vmm_arena_stats before = stats_of(a);
  vmm_arena_compact_report r;
  memset(&r, 0xEE, sizeof r);
  OK(vmm_arena_compact(a, &r));
  vmm_arena_stats after = stats_of(a);
  CHECK(r.moved_allocations >= 1);
  CHECK((int)r.moved_allocations == mv.count);
  CHECK(after.moves == before.moves + r.moved_allocations);
  CHECK(r.largest_free_va_before == before.largest_free_va_bytes);
  CHECK(r.largest_free_va_after == after.largest_free_va_bytes);
  CHECK(r.largest_free_va_after > r.largest_free_va_before);
  CHECK(after.retired_va_bytes == 0);
  uint64_t moved_bytes = 0;
  for (int e = 0; e < mv.count; e++) {
    CHECK(mv.id[e] != ids[9]); /* pinned: never moved */
    moved_bytes += (mv.size[e] + K - 1) / K * K;
  }
  CHECK(r.moved_bytes == moved_bytes);
  for (uint32_t i = 1; i < 12; i += 2) {
    uint64_t p = ptr_of(a, ids[i]);
    CHECK(intact(p, (i % 3 + 1) * K - 7, 100 + i));
    for (int e = mv.count - 1; e >= 0; e--) /* the last event tells where it went */
      if (mv.id[e] == ids[i]) {
        CHECK(mv.new_ptr[e] == p);
        break;
      }
  }
  CHECK(ptr_of(a, ids[9]) == ptrs[9]);
  OK(vmm_arena_compact(a, NULL)); /* report may be NULL */
  for (uint32_t i = 1; i < 12; i += 2) OK(vmm_arena_free(a, ids[i]));
  vmm_arena_destroy(a);
}

/* Fragments an arena whose address space equals its capacity: 16 one-chunk
 * allocations, every other one freed. */
static void fragment(vmm_arena *a, vmm_arena_id ids[16], uint64_t ptrs[16]) {
  for (uint32_t i = 0; i < 16; i++) {
    OK(vmm_arena_alloc(a, K, &ids[i], &ptrs[i]));
    fill(ptrs[i], K, 200 + i);
  }
  for (uint32_t i = 0; i < 16; i += 2) OK(vmm_arena_free(a, ids[i]));
  CHECK(stats_of(a).largest_free_va_bytes == K);
}

void test_implicit_moves_and_address_space(void) {
  vmm_arena_id ids[16], id;
  uint64_t ptrs[16], p;
  moves_t mv;

  /* Implicit moves make room: the allocation succeeds. */
  vmm_arena *a = make(16, 16, 0);
  memset(&mv, 0, sizeof mv);
  OK(vmm_arena_set_move_callback(a, record_move, &mv));
  fragment(a, ids, ptrs);
  OK(vmm_arena_alloc(a, 2 * K, &id, &p));
  CHECK(mv.count >= 1);
  fill(p, 2 * K, 1);
  for (uint32_t i = 1; i < 16; i += 2) CHECK(intact(ptr_of(a, ids[i]), K, 200 + i));
  CHECK(stats_of(a).moves == (uint64_t)mv.count);
  vmm_arena_destroy(a);

  /* With VMM_ARENA_FLAG_NO_IMPLICIT_MOVES: out of address space, the arena
   * unchanged; compaction (explicit) makes room. */
  a = make(16, 16, VMM_ARENA_FLAG_NO_IMPLICIT_MOVES);
  memset(&mv, 0, sizeof mv);
  OK(vmm_arena_set_move_callback(a, record_move, &mv));
  fragment(a, ids, ptrs);
  vmm_arena_stats before = stats_of(a);
  id = 0x77;
  EXPECT(vmm_arena_alloc(a, 2 * K, &id, &p), VMM_ARENA_ERR_OUT_OF_ADDRESS_SPACE);
  EXPECT(vmm_arena_alloc_growable(a, K, 2 * K, &id, &p), VMM_ARENA_ERR_OUT_OF_ADDRESS_SPACE);
  CHECK(id == 0x77);
  vmm_arena_stats after = stats_of(a);
  CHECK(memcmp(&before, &after, sizeof before) == 0);
  CHECK(mv.count == 0);
  /* The resized allocation itself may still move. */
  uint64_t q;
  OK(vmm_arena_resize(a, ids[15], K, &q));
  CHECK(q == ptrs[15]);
  OK(vmm_arena_compact(a, NULL));
  CHECK(mv.count >= 1);
  OK(vmm_arena_alloc(a, 2 * K, &id, &p));
  for (uint32_t i = 1; i < 16; i += 2) CHECK(intact(ptr_of(a, ids[i]), K, 200 + i));
  vmm_arena_destroy(a);

  /* Pinned allocations in the way: out of address space; unpinned, fine. */
  a = make(16, 16, 0);
  for (uint32_t i = 0; i < 16; i++) {
    OK(vmm_arena_alloc(a, K, &ids[i], &ptrs[i]));
    fill(ptrs[i], K, 300 + i);
    OK(vmm_arena_pin(a, ids[i]));
  }
  for (uint32_t i = 0; i < 16; i += 2) OK(vmm_arena_free(a, ids[i]));
  before = stats_of(a);
  EXPECT(vmm_arena_alloc(a, 2 * K, &id, &p), VMM_ARENA_ERR_OUT_OF_ADDRESS_SPACE);
  after = stats_of(a);
  CHECK(memcmp(&before, &after, sizeof before) == 0);
  OK(vmm_arena_compact(a, NULL)); /* moves nothing: all pinned */
  CHECK(stats_of(a).moves == 0);
  for (uint32_t i = 1; i < 16; i += 2) OK(vmm_arena_unpin(a, ids[i]));
  OK(vmm_arena_alloc(a, 2 * K, &id, &p));
  for (uint32_t i = 1; i < 16; i += 2) CHECK(intact(ptr_of(a, ids[i]), K, 300 + i));
  vmm_arena_destroy(a);
}

/* Small allocations share chunks (slabs); they move with their slab and
 * are copied when they outgrow their size class. Every move is reported,
 * every byte kept. */
void test_small_allocations(void) {
  vmm_arena *a = make(32, 32, 0);
  moves_t mv;
  memset(&mv, 0, sizeof mv);
  OK(vmm_arena_set_move_callback(a, record_move, &mv));
  enum { N = 40 };
  vmm_arena_id ids[N];
  uint64_t ptrs[N], sizes[N];
  vmm_arena_id big[8];
  uint64_t bp;
  for (uint32_t i = 0; i < N; i++) {
    sizes[i] = 1 + (i * 977u) % 6000;
    OK(vmm_arena_alloc(a, sizes[i], &ids[i], &ptrs[i]));
    CHECK(ptrs[i] % 256 == 0);
    fill(ptrs[i], sizes[i], 500 + i);
    if (i % 5 == 0) OK(vmm_arena_alloc(a, K, &big[i / 5], &bp)); /* interleave whole chunks */
  }
  for (uint32_t i = 0; i < N; i++)
    for (uint32_t j = i + 1; j < N; j++) /* no two objects overlap */
      CHECK(ptrs[i] + sizes[i] <= ptrs[j] || ptrs[j] + sizes[j] <= ptrs[i]);
  for (uint32_t b = 0; b < 8; b += 2) OK(vmm_arena_free(a, big[b]));
  for (uint32_t i = 0; i < N; i += 3) OK(vmm_arena_free(a, ids[i]));
  vmm_arena_stats before = stats_of(a);
  OK(vmm_arena_compact(a, NULL));
  vmm_arena_stats after = stats_of(a);
  CHECK(after.moves - before.moves == (uint64_t)mv.count);
  for (uint32_t i = 1; i < N; i++) {
    if (i % 3 == 0) continue;
    uint64_t p = ptr_of(a, ids[i]);
    CHECK(intact(p, sizes[i], 500 + i));
    uint64_t want = ptrs[i];
    for (int e = 0; e < mv.count && e < 256; e++)
      if (mv.id[e] == ids[i]) {
        CHECK(mv.old_ptr[e] == want); /* events chain from the old address */
        want = mv.new_ptr[e];
      }
    CHECK(want == p);
  }

  printf("  compaction moved %d objects and chunks\n", mv.count);
  /* Outgrowing the size class: a move (copy) that keeps the bytes. */
  vmm_arena_id s1;
  uint64_t p1, q;
  OK(vmm_arena_alloc(a, 100, &s1, &p1));
  fill(p1, 100, 77);
  OK(vmm_arena_resize(a, s1, 200, &q)); /* within its class: in place */
  CHECK(q == p1 && intact(p1, 100, 77));
  int events = mv.count;
  uint64_t moves = stats_of(a).moves;
  OK(vmm_arena_resize(a, s1, 5000, &q));
  CHECK(q % 256 == 0 && intact(q, 100, 77));
  CHECK(stats_of(a).moves - moves == (uint64_t)(mv.count - events));
  if (q != p1) CHECK(mv.count > events && mv.id[mv.count - 1] == s1 && mv.new_ptr[mv.count - 1] == q);
  /* Beyond every class: whole chunks, chunk-aligned once >= a chunk. */
  OK(vmm_arena_resize(a, s1, 3 * K, &q));
  CHECK(q % K == 0 && intact(q, 100, 77));
  OK(vmm_arena_query(a, s1, &q, &bp));
  CHECK(bp == 3 * K);
  /* Pinned small objects stay; growing one out of its class is PINNED. */
  vmm_arena_id s2;
  uint64_t p2;
  OK(vmm_arena_alloc(a, 300, &s2, &p2));
  OK(vmm_arena_pin(a, s2));
  EXPECT(vmm_arena_resize(a, s2, 20000, &q), VMM_ARENA_ERR_PINNED);
  CHECK(ptr_of(a, s2) == p2);
  OK(vmm_arena_unpin(a, s2));
  OK(vmm_arena_resize(a, s2, 20000, &q));
  EXPECT(vmm_arena_free(a, s2), VMM_ARENA_OK);
  EXPECT(vmm_arena_free(a, s2), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
  vmm_arena_destroy(a);
}

void test_pin(void) {
  vmm_arena *a = make(32, 64, 0);
  vmm_arena_id g, n, last;
  uint64_t p, pn, q, plast;
  OK(vmm_arena_alloc_growable(a, K, 2 * K, &g, &p));
  OK(vmm_arena_alloc(a, K, &n, &pn));
  CHECK(pn == p + 2 * K);
  fill(p, K, 9);
  OK(vmm_arena_pin(a, g));
  OK(vmm_arena_pin(a, g)); /* twice is fine */
  OK(vmm_arena_resize(a, g, 2 * K, &q)); /* within its reservation: in place */
  CHECK(q == p);
  q = 0x99;
  OK(vmm_arena_pin(a, n)); /* its neighbour cannot move out of the way */
  EXPECT(vmm_arena_resize(a, g, 3 * K, &q), VMM_ARENA_ERR_PINNED);
  CHECK(q == 0x99 && ptr_of(a, g) == p && intact(p, K, 9));
  CHECK(strstr(vmm_arena_last_error(), "pinned") != NULL);
  OK(vmm_arena_compact(a, NULL));
  CHECK(ptr_of(a, g) == p);
  OK(vmm_arena_unpin(a, n));
  OK(vmm_arena_unpin(a, g));
  OK(vmm_arena_unpin(a, g)); /* unpinning an unpinned allocation is fine */
  OK(vmm_arena_resize(a, g, 3 * K, &q));
  CHECK(q != p && intact(q, K, 9));
  /* A pinned allocation with free space after it grows where it stands. */
  OK(vmm_arena_alloc(a, K, &last, &plast));
  OK(vmm_arena_pin(a, last));
  OK(vmm_arena_resize(a, last, 3 * K, &q));
  CHECK(q == plast);
  vmm_arena_destroy(a);
}
