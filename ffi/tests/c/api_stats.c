/*
 * test_api (see test_api.c): Stats and trim, the snapshot, move callbacks, poisoning after a panic,
 * driver failures.
 */
#include "api.h"

void test_stats_and_trim(void) {
  vmm_arena *a = make(16, 64, 0);
  /* Wrong struct_size: refused, nothing written. */
  const uint32_t bad[] = {0, 4, sizeof(vmm_arena_stats) - 8, sizeof(vmm_arena_stats) + 8, 0xFFFFFFFFu};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    vmm_arena_stats s;
    memset(&s, 0xAB, sizeof s);
    s.struct_size = bad[i];
    EXPECT(vmm_arena_stats_get(a, &s), VMM_ARENA_ERR_INVALID_ARGUMENT);
    CHECK(s.struct_size == bad[i]);
    const unsigned char *bytes = (const unsigned char *)&s;
    for (size_t b = sizeof s.struct_size; b < sizeof s; b++) CHECK(bytes[b] == 0xAB);
  }
  vmm_arena_stats s;
  memset(&s, 0xAB, sizeof s);
  s.struct_size = sizeof s;
  OK(vmm_arena_stats_get(a, &s));
  CHECK(s.struct_size == sizeof s && s.reserved0 == 0);
  CHECK(s.capacity_bytes == 16 * K && s.reserved_va_bytes == 64 * K);
  CHECK(s.live_allocations == 0 && s.live_bytes == 0 && s.mapped_bytes == 0 && s.pooled_bytes == 0);
  CHECK(s.free_va_bytes == 64 * K && s.largest_free_va_bytes == 64 * K);
  CHECK(s.retired_va_bytes == 0 && s.moves == 0 && s.driver_creates == 0 && s.peak_physical_bytes == 0);

  vmm_arena_id x, y, g;
  uint64_t p;
  OK(vmm_arena_alloc(a, 100, &x, &p));
  OK(vmm_arena_alloc(a, K + 1, &y, &p));
  OK(vmm_arena_alloc_growable(a, K, 8 * K, &g, &p));
  s = stats_of(a);
  CHECK(s.live_allocations == 3);
  CHECK(s.live_bytes == 100 + K + 1 + K);
  CHECK(s.mapped_bytes == 4 * K);
  CHECK(s.free_va_bytes == 64 * K - 11 * K); /* a growable's whole reservation counts */
  CHECK(s.driver_creates == 4);
  CHECK(s.driver_maps >= 1 && s.driver_access_calls >= 1);
  CHECK(s.peak_physical_bytes == 4 * K);
  OK(vmm_arena_free(a, x));
  OK(vmm_arena_free(a, y));
  OK(vmm_arena_free(a, g));
  s = stats_of(a);
  CHECK(s.live_allocations == 0 && s.mapped_bytes == 0 && s.pooled_bytes == 4 * K);
  CHECK(s.peak_physical_bytes == 4 * K && s.driver_releases == 0);

  uint64_t released = 0x1234;
  OK(vmm_arena_trim(a, K + 5, &released));
  CHECK(released == 3 * K);
  CHECK(stats_of(a).pooled_bytes == K);
  OK(vmm_arena_trim(a, 0, NULL)); /* out_released may be NULL */
  s = stats_of(a);
  CHECK(s.pooled_bytes == 0 && s.driver_releases == 4);
  OK(vmm_arena_trim(a, 0, &released));
  CHECK(released == 0);
  OK(vmm_arena_trim(a, UINT64_MAX, &released));
  CHECK(released == 0);
  vmm_arena_destroy(a);

  /* retain_bytes: the watermark of pooled memory kept on free. */
  vmm_arena_config c = host_config(16, 64, 0);
  c.retain_bytes = 0;
  OK(vmm_arena_create(&c, &a));
  OK(vmm_arena_alloc(a, 3 * K, &x, &p));
  OK(vmm_arena_free(a, x));
  s = stats_of(a);
  CHECK(s.pooled_bytes == 0 && s.driver_releases == 3);
  vmm_arena_destroy(a);
  c.retain_bytes = K;
  OK(vmm_arena_create(&c, &a));
  OK(vmm_arena_alloc(a, 3 * K, &x, &p));
  OK(vmm_arena_free(a, x));
  CHECK(stats_of(a).pooled_bytes == K);
  vmm_arena_destroy(a);
}

void test_snapshot(void) {
  vmm_arena *a = make(16, 64, 0);
  vmm_arena_id g, n, x;
  uint64_t p, q;
  OK(vmm_arena_alloc_growable(a, K, 2 * K, &g, &p));
  OK(vmm_arena_alloc(a, K, &n, &p));
  OK(vmm_arena_alloc(a, K, &x, &p));
  OK(vmm_arena_free(a, x));
  OK(vmm_arena_resize(a, g, 4 * K, &q)); /* moves: leaves a retired range */

  size_t need = 0;
  OK(vmm_arena_snapshot_json(a, NULL, 0, &need)); /* the size query */
  CHECK(need > 2);
  size_t len = 0;
  OK(vmm_arena_snapshot_json(a, NULL, need - 1, &len)); /* too small: buf may be NULL */
  CHECK(len == need);
  char *buf = (char *)malloc(need + 16);
  CHECK(buf != NULL);
  memset(buf, 'X', need + 16);
  len = 0;
  OK(vmm_arena_snapshot_json(a, buf, need - 1, &len)); /* too small: nothing written */
  CHECK(len == need);
  for (size_t i = 0; i < need + 16; i++) CHECK(buf[i] == 'X');
  len = 0;
  OK(vmm_arena_snapshot_json(a, buf, need, &len)); /* exactly enough */
  CHECK(len == need);
  CHECK(strlen(buf) == need - 1);
  CHECK(buf[need] == 'X');
  CHECK(buf[0] == '{' && buf[need - 2] == '}');
  CHECK(strstr(buf, "\"ranges\"") && strstr(buf, "\"stats\"") && strstr(buf, "\"live\"") &&
        strstr(buf, "\"free\"") && strstr(buf, "\"retired\""));
  OK(vmm_arena_snapshot_json(a, buf, need + 16, &len)); /* more than enough */
  CHECK(len == need && strlen(buf) == need - 1);
  /* NULL where it is needed. */
  len = 0x55;
  EXPECT(vmm_arena_snapshot_json(a, NULL, need, &len), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_snapshot_json(a, NULL, SIZE_MAX, &len), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_snapshot_json(a, buf, need, NULL), VMM_ARENA_ERR_INVALID_ARGUMENT);
  CHECK(len == 0x55);
  free(buf);
  vmm_arena_destroy(a);
}

/* A callback that calls back into its own arena. */
typedef struct {
  vmm_arena *arena, *other;
  int calls;
  vmm_arena_status alloc_status, query_status, stats_status, compact_status, other_status;
  char last_error[512];
  char destroy_error[512];
} reentry_t;

static void reenter(void *user, vmm_arena_id id, uint64_t old_ptr, uint64_t new_ptr, uint64_t size) {
  (void)old_ptr;
  (void)new_ptr;
  (void)size;
  reentry_t *r = (reentry_t *)user;
  r->calls++;
  vmm_arena_id nid;
  uint64_t p;
  vmm_arena_stats s;
  memset(&s, 0, sizeof s);
  s.struct_size = sizeof s;
  r->alloc_status = vmm_arena_alloc(r->arena, K, &nid, &p);
  snprintf(r->last_error, sizeof r->last_error, "%s", vmm_arena_last_error());
  r->query_status = vmm_arena_query(r->arena, id, &p, NULL);
  r->stats_status = vmm_arena_stats_get(r->arena, &s);
  r->compact_status = vmm_arena_compact(r->arena, NULL);
  vmm_arena_destroy(r->arena); /* refused: the arena is in use */
  snprintf(r->destroy_error, sizeof r->destroy_error, "%s", vmm_arena_last_error());
  /* Another arena is fine. */
  r->other_status = vmm_arena_alloc(r->other, K, &nid, &p);
  if (r->other_status == VMM_ARENA_OK) r->other_status = vmm_arena_free(r->other, nid);
}

void test_callbacks(void) {
  vmm_arena *a = make(32, 64, 0);
  vmm_arena *b = make(4, 8, 0);
  reentry_t r;
  memset(&r, 0, sizeof r);
  r.arena = a;
  r.other = b;
  OK(vmm_arena_set_move_callback(a, reenter, &r));
  vmm_arena_id g, n;
  uint64_t p, pn, q;
  OK(vmm_arena_alloc_growable(a, K, K, &g, &p));
  OK(vmm_arena_alloc(a, K, &n, &pn));
  CHECK(pn == p + K);
  fill(p, K, 11);
  OK(vmm_arena_resize(a, g, 2 * K, &q)); /* moves: the callback runs */
  CHECK(r.calls == 1);
  CHECK(r.alloc_status == VMM_ARENA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(r.last_error, "callback") != NULL);
  CHECK(r.query_status == VMM_ARENA_ERR_INVALID_ARGUMENT);
  CHECK(r.stats_status == VMM_ARENA_ERR_INVALID_ARGUMENT);
  CHECK(r.compact_status == VMM_ARENA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(r.destroy_error, "callback") != NULL);
  CHECK(r.other_status == VMM_ARENA_OK);
  /* The arena survived its callback's destroy and its state is consistent. */
  CHECK(ptr_of(a, g) == q && intact(q, K, 11));
  CHECK(stats_of(a).live_allocations == 2);

  /* Replacing the callback; removing it. */
  moves_t mv;
  memset(&mv, 0, sizeof mv);
  OK(vmm_arena_set_move_callback(a, record_move, &mv));
  vmm_arena_id h, m;
  uint64_t ph, pm;
  OK(vmm_arena_alloc_growable(a, K, K, &h, &ph));
  OK(vmm_arena_alloc(a, K, &m, &pm));
  CHECK(pm == ph + K);
  OK(vmm_arena_resize(a, h, 2 * K, &q));
  CHECK(q != ph && mv.count == 1 && mv.id[0] == h && r.calls == 1);
  OK(vmm_arena_set_move_callback(a, NULL, NULL));
  vmm_arena_stats before = stats_of(a);
  OK(vmm_arena_alloc_growable(a, K, K, &h, &ph));
  OK(vmm_arena_alloc(a, K, &m, &pm));
  CHECK(pm == ph + K);
  OK(vmm_arena_resize(a, h, 2 * K, &q));
  CHECK(q != ph && mv.count == 1 && r.calls == 1);
  CHECK(stats_of(a).moves == before.moves + 1);
  vmm_arena_destroy(a);
  vmm_arena_destroy(b);
}

void test_poison(void) {
  vmm_arena *a = make(16, 64, 0);
  vmm_arena *b = make(16, 64, 0);
  vmm_arena_id x, id = 0x42;
  uint64_t p, v = 0x43;
  size_t len = 0x44;
  OK(vmm_arena_alloc(a, K, &x, &p));
  EXPECT(vmm_arena_testing_panic(a), VMM_ARENA_ERR_INTERNAL);
  CHECK(strstr(vmm_arena_last_error(), "panic") != NULL);
  EXPECT(vmm_arena_testing_panic(NULL), VMM_ARENA_ERR_INTERNAL);

  const vmm_arena_status I = VMM_ARENA_ERR_INTERNAL;
  vmm_arena_stats s;
  memset(&s, 0, sizeof s);
  s.struct_size = sizeof s;
  EXPECT(vmm_arena_alloc(a, K, &id, &p), I);
  EXPECT(vmm_arena_alloc_growable(a, K, 2 * K, &id, &p), I);
  EXPECT(vmm_arena_free(a, x), I);
  EXPECT(vmm_arena_resize(a, x, 2 * K, &v), I);
  EXPECT(vmm_arena_query(a, x, &v, NULL), I);
  EXPECT(vmm_arena_pin(a, x), I);
  EXPECT(vmm_arena_unpin(a, x), I);
  EXPECT(vmm_arena_compact(a, NULL), I);
  EXPECT(vmm_arena_release_retired(a), I);
  EXPECT(vmm_arena_trim(a, 0, &v), I);
  EXPECT(vmm_arena_stats_get(a, &s), I);
  EXPECT(vmm_arena_set_move_callback(a, record_move, NULL), I);
  EXPECT(vmm_arena_snapshot_json(a, NULL, 0, &len), I);
  CHECK(strstr(vmm_arena_last_error(), "poisoned") != NULL);
  CHECK(id == 0x42 && v == 0x43 && len == 0x44 && s.live_allocations == 0);
  /* The function's own argument checks come first. */
  EXPECT(vmm_arena_alloc(a, K, NULL, &p), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_stats_get(a, NULL), VMM_ARENA_ERR_INVALID_ARGUMENT);
  /* Other arenas are not affected; destroy still releases everything. */
  OK(vmm_arena_alloc(b, K, &id, &p));
  vmm_arena_destroy(a);
  OK(vmm_arena_free(b, id));
  vmm_arena_destroy(b);
}

void test_driver_failures(void) {
  vmm_arena_config c = host_config(16, 32, 0);
  vmm_arena *f = NULL;
  OK(vmm_arena_testing_create_faulty(&c, &f));
  uint64_t chunks0, maps0, chunks1, maps1;
  vmm_arena_id id = 0x31, g, n;
  uint64_t p = 0x32, pg, pn, q;

  /* A failing create: DRIVER, nothing changed. */
  vmm_arena_stats before = stats_of(f);
  OK(vmm_arena_testing_driver_objects(f, &chunks0, &maps0));
  OK(vmm_arena_testing_fail_nth(f, CALL_ANY, 1, FAULT_DRIVER));
  EXPECT(vmm_arena_alloc(f, 2 * K, &id, &p), VMM_ARENA_ERR_DRIVER);
  CHECK(strstr(vmm_arena_last_error(), "injected") != NULL);
  CHECK(id == 0x31 && p == 0x32);
  vmm_arena_stats after = stats_of(f);
  OK(vmm_arena_testing_driver_objects(f, &chunks1, &maps1));
  CHECK(after.live_allocations == before.live_allocations && after.mapped_bytes == before.mapped_bytes &&
        after.pooled_bytes == before.pooled_bytes);
  CHECK(chunks1 == chunks0 && maps1 == maps0);
  /* The driver out of memory: OUT_OF_MEMORY. */
  OK(vmm_arena_testing_fail_nth(f, CALL_CREATE, 2, FAULT_OOM));
  EXPECT(vmm_arena_alloc(f, 2 * K, &id, &p), VMM_ARENA_ERR_OUT_OF_MEMORY);
  OK(vmm_arena_testing_driver_objects(f, &chunks1, &maps1));
  CHECK(chunks1 == chunks0 && maps1 == maps0);
  OK(vmm_arena_testing_fail_nth(f, CALL_ANY, 0, FAULT_DRIVER)); /* clear */

  /* A failing move leaves the allocation where and as it was. */
  OK(vmm_arena_alloc_growable(f, K, 2 * K, &g, &pg));
  OK(vmm_arena_alloc(f, K, &n, &pn));
  CHECK(pn == pg + 2 * K);
  fill(pg, K, 21);
  before = stats_of(f);
  OK(vmm_arena_testing_driver_objects(f, &chunks0, &maps0));
  for (uint64_t nth = 1; nth <= 3; nth++) {
    OK(vmm_arena_testing_fail_nth(f, CALL_ANY, nth, FAULT_DRIVER));
    q = 0x33;
    EXPECT(vmm_arena_resize(f, g, 5 * K, &q), VMM_ARENA_ERR_DRIVER);
    CHECK(q == 0x33 && ptr_of(f, g) == pg && intact(pg, K, 21));
    after = stats_of(f);
    CHECK(memcmp(&before.live_allocations, &after.live_allocations, 11 * sizeof(uint64_t)) == 0);
    OK(vmm_arena_testing_driver_objects(f, &chunks1, &maps1));
    CHECK(chunks1 == chunks0 && maps1 == maps0);
  }
  OK(vmm_arena_testing_fail_nth(f, CALL_ANY, 0, FAULT_DRIVER));
  OK(vmm_arena_resize(f, g, 5 * K, &q));
  CHECK(q != pg && intact(q, K, 21));

  /* A failing unmap of the retired range: DRIVER, and a retry works. */
  CHECK(stats_of(f).retired_va_bytes > 0);
  OK(vmm_arena_testing_fail_nth(f, CALL_UNMAP, 1, FAULT_DRIVER));
  EXPECT(vmm_arena_release_retired(f), VMM_ARENA_ERR_DRIVER);
  CHECK(stats_of(f).retired_va_bytes > 0);
  OK(vmm_arena_release_retired(f));
  CHECK(stats_of(f).retired_va_bytes == 0);

  /* A failing compaction keeps every allocation and its contents. */
  vmm_arena_id ids[8];
  uint64_t ptrs[8];
  for (uint32_t i = 0; i < 8; i++) {
    OK(vmm_arena_alloc(f, K, &ids[i], &ptrs[i]));
    fill(ptrs[i], K, 40 + i);
  }
  for (uint32_t i = 0; i < 8; i += 2) OK(vmm_arena_free(f, ids[i]));
  before = stats_of(f);
  OK(vmm_arena_testing_fail_nth(f, CALL_MAP, 2, FAULT_DRIVER));
  EXPECT(vmm_arena_compact(f, NULL), VMM_ARENA_ERR_DRIVER);
  after = stats_of(f);
  CHECK(after.moves == before.moves && after.live_allocations == before.live_allocations);
  for (uint32_t i = 1; i < 8; i += 2) CHECK(ptr_of(f, ids[i]) == ptrs[i] && intact(ptrs[i], K, 40 + i));
  OK(vmm_arena_compact(f, NULL));
  for (uint32_t i = 1; i < 8; i += 2) CHECK(intact(ptr_of(f, ids[i]), K, 40 + i));

  /* Hook arguments. */
  vmm_arena *plain = make(4, 8, 0);
  EXPECT(vmm_arena_testing_fail_nth(plain, CALL_ANY, 1, FAULT_DRIVER), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_testing_fail_nth(f, 99, 1, FAULT_DRIVER), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_testing_fail_nth(f, CALL_ANY, 1, 7), VMM_ARENA_ERR_INVALID_ARGUMENT);
  vmm_arena_destroy(plain);
  vmm_arena_destroy(f);
}
