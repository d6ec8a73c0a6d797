/*
 * test_api (see test_api.c): Stream-ordered frees and prefetch, resize_on_stream, quiesce_on_stream.
 */
#include "api.h"

#ifdef VMM_ARENA_FLAG_BACKGROUND
/* A number from the snapshot's stats ("key":value), or UINT64_MAX if absent. */
static uint64_t snapshot_stat(vmm_arena *a, const char *key) {
  static char buf[1 << 16];
  size_t len = 0;
  OK(vmm_arena_snapshot_json(a, buf, sizeof buf, &len));
  CHECK(len <= sizeof buf);
  char pat[96];
  snprintf(pat, sizeof pat, "\"%s\":", key);
  const char *at = strstr(strstr(buf, "\"stats\""), pat);
  if (at == NULL) return UINT64_MAX;
  return strtoull(at + strlen(pat), NULL, 10);
}

/* Stream-ordered frees, prefetch, the background flag (the next contract's
 * additions) and vmm_arena_resize_many (the project header's). */
void test_stream_free_and_prefetch(void) {
  const vmm_arena_status INV = VMM_ARENA_ERR_INVALID_ARGUMENT;
  EXPECT(vmm_arena_free_on_stream(NULL, 1, 0), INV);
  EXPECT(vmm_arena_set_prefetch(NULL, K, K), INV);
  EXPECT(vmm_arena_maintain(NULL), INV);
  vmm_arena *a = make(16, 64, 0);
  /* Host backend: a stream-ordered free frees at once. */
  vmm_arena_id x, y;
  uint64_t px, py;
  OK(vmm_arena_alloc(a, 2 * K, &x, &px));
  OK(vmm_arena_free_on_stream(a, x, 0));
  EXPECT(vmm_arena_free_on_stream(a, x, 0), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
  EXPECT(vmm_arena_free_on_stream(a, 0, 0), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
  CHECK(strstr(vmm_arena_last_error(), "0x0") != NULL);
  OK(vmm_arena_alloc(a, 2 * K, &y, &py));
  CHECK(py == px); /* its chunks served at once */
  CHECK(snapshot_stat(a, "pending_free_bytes") == 0);
  OK(vmm_arena_free(a, y));

  /* Prefetch: precreated chunks, then growth into mapped-ahead ones with no
   * driver call on this thread. */
  vmm_arena_id g;
  uint64_t pg, q;
  OK(vmm_arena_trim(a, 0, NULL));
  OK(vmm_arena_alloc_growable(a, K, 8 * K, &g, &pg));
  OK(vmm_arena_set_prefetch(a, 2 * K, 3 * K));
  OK(vmm_arena_maintain(a));
  CHECK(snapshot_stat(a, "prefetched_bytes") == 5 * K);
  CHECK(snapshot_stat(a, "maintain_driver_calls") > 0);
  uint64_t calls = snapshot_stat(a, "caller_driver_calls");
  fill(pg, K, 41);
  OK(vmm_arena_resize(a, g, 4 * K, &q));
  CHECK(q == pg && intact(pg, K, 41));
  CHECK(snapshot_stat(a, "caller_driver_calls") == calls);
  OK(vmm_arena_set_prefetch(a, 0, 0));
  OK(vmm_arena_maintain(a)); /* nothing to do */

  /* resize_many: arguments, all or nothing, addresses. */
  vmm_arena_id h, ids[3];
  uint64_t ph, sizes[3], out[3] = {7, 7, 7};
  OK(vmm_arena_alloc_growable(a, K, 4 * K, &h, &ph));
  fill(ph, K, 42);
  OK(vmm_arena_resize_many(a, NULL, NULL, 0, NULL)); /* nothing to do */
  EXPECT(vmm_arena_resize_many(NULL, ids, sizes, 0, out), INV);
  ids[0] = g, ids[1] = h, sizes[0] = 5 * K, sizes[1] = 2 * K;
  EXPECT(vmm_arena_resize_many(a, NULL, sizes, 2, out), INV);
  EXPECT(vmm_arena_resize_many(a, ids, NULL, 2, out), INV);
  EXPECT(vmm_arena_resize_many(a, ids, sizes, 2, NULL), INV);
  ids[1] = g;
  EXPECT(vmm_arena_resize_many(a, ids, sizes, 2, out), INV); /* the same id twice */
  CHECK(strstr(vmm_arena_last_error(), "twice") != NULL);
  ids[1] = h, sizes[1] = 0;
  EXPECT(vmm_arena_resize_many(a, ids, sizes, 2, out), INV);
  ids[1] = 0xDEAD, sizes[1] = K;
  EXPECT(vmm_arena_resize_many(a, ids, sizes, 2, out), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
  CHECK(strstr(vmm_arena_last_error(), "0xdead") != NULL);
  ids[1] = h, sizes[1] = 100 * K; /* beyond the capacity: nothing changes */
  EXPECT(vmm_arena_resize_many(a, ids, sizes, 2, out), VMM_ARENA_ERR_OUT_OF_MEMORY);
  CHECK(out[0] == 7 && out[1] == 7);
  uint64_t size = 0;
  OK(vmm_arena_query(a, g, NULL, &size));
  CHECK(size == 4 * K);
  ids[2] = x; /* freed above */
  sizes[1] = 3 * K, sizes[2] = K;
  EXPECT(vmm_arena_resize_many(a, ids, sizes, 3, out), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
  OK(vmm_arena_resize_many(a, ids, sizes, 2, out));
  OK(vmm_arena_query(a, g, &q, &size));
  CHECK(q == out[0] && size == 5 * K);
  OK(vmm_arena_query(a, h, &q, &size));
  CHECK(q == out[1] && size == 3 * K && intact(out[1], K, 42) && intact(out[0], K, 41));
  OK(vmm_arena_free(a, g));
  OK(vmm_arena_free(a, h));
  vmm_arena_destroy(a);

  /* A failed prefetch call is the driver's status, and counted. */
  vmm_arena_config c = host_config(8, 32, 0);
  OK(vmm_arena_testing_create_faulty(&c, &a));
  OK(vmm_arena_set_prefetch(a, 2 * K, 0));
  OK(vmm_arena_testing_fail_nth(a, CALL_CREATE, 2, FAULT_DRIVER));
  EXPECT(vmm_arena_maintain(a), VMM_ARENA_ERR_DRIVER);
  CHECK(snapshot_stat(a, "maintain_failures") == 1 && snapshot_stat(a, "prefetched_bytes") == K);
  OK(vmm_arena_maintain(a));
  CHECK(snapshot_stat(a, "prefetched_bytes") == 2 * K);
  uint64_t chunks = 0, mappings = 0;
  OK(vmm_arena_testing_driver_objects(a, &chunks, &mappings));
  CHECK(chunks == 2 && mappings == 0);
  vmm_arena_destroy(a);

  /* Admission map-ahead: the next growable allocation's place gets its
   * chunks from the pool; the allocation then makes no driver call. */
  EXPECT(vmm_arena_set_admission_prefetch(NULL, 8 * K, 2 * K, 1), INV);
  a = make(16, 64, 0);
  EXPECT(vmm_arena_set_admission_prefetch(a, 8 * K, 2 * K, 65), INV);
  OK(vmm_arena_set_prefetch(a, 3 * K, 0));
  OK(vmm_arena_set_admission_prefetch(a, 8 * K, 2 * K, 1));
  OK(vmm_arena_maintain(a));
  CHECK(snapshot_stat(a, "prefetched_bytes") == 3 * K && snapshot_stat(a, "cached_mapped_bytes") == 2 * K);
  calls = snapshot_stat(a, "caller_driver_calls");
  vmm_arena_id w;
  uint64_t wp = 0;
  OK(vmm_arena_alloc_growable(a, 2 * K, 8 * K, &w, &wp));
  CHECK(snapshot_stat(a, "caller_driver_calls") == calls);
  memset((void *)(uintptr_t)wp, 7, 2 * K);
  OK(vmm_arena_free(a, w));
  OK(vmm_arena_set_admission_prefetch(a, 0, 0, 0));
  vmm_arena_destroy(a);

  /* The background thread keeps the targets; destroy stops and joins it. */
  a = make(16, 64, VMM_ARENA_FLAG_BACKGROUND);
  OK(vmm_arena_set_prefetch(a, 3 * K, 0));
  for (int i = 0; i < 20000 && snapshot_stat(a, "prefetched_bytes") < 3 * K; i++) usleep(100);
  CHECK(snapshot_stat(a, "prefetched_bytes") == 3 * K);
  CHECK(snapshot_stat(a, "caller_driver_calls") == 0);
  vmm_arena_destroy(a);
  vmm_arena_destroy(NULL);
}

/* The snapshot's "stats" object to the end (every counter; no addresses). */
static void snapshot_stats(vmm_arena *a, char *out, size_t cap) {
  static char buf[1 << 16];
  size_t len = 0;
  OK(vmm_arena_snapshot_json(a, buf, sizeof buf, &len));
  CHECK(len <= sizeof buf);
  const char *at = strstr(buf, "\"stats\"");
  CHECK(at != NULL && strlen(at) < cap);
  strcpy(out, at);
}

/* A number at the snapshot's top level ("key":value). */
static uint64_t snapshot_top(vmm_arena *a, const char *key) {
  static char buf[1 << 16];
  size_t len = 0;
  OK(vmm_arena_snapshot_json(a, buf, sizeof buf, &len));
  char pat[96];
  snprintf(pat, sizeof pat, "\"%s\":", key);
  const char *at = strstr(buf, pat);
  CHECK(at != NULL);
  return strtoull(at + strlen(pat), NULL, 10);
}

/* Out-parameters for resize_bad: a valid one, NULL, or misaligned. */
enum { OUT_VALID, OUT_NULL, OUT_MISALIGNED };

/* vmm_arena_resize and vmm_arena_resize_on_stream with the same bad
 * arguments: both fail with the same status, neither writes its
 * out-parameter, and the last error names the call. Returns the status. */
static vmm_arena_status resize_bad(vmm_arena *a, vmm_arena_id id, uint64_t size, int out) {
  uint64_t cells[3] = {0x6666, 0x6666, 0x6666};
  uint64_t *o = out == OUT_NULL ? NULL : out == OUT_MISALIGNED ? (uint64_t *)(void *)((char *)cells + 1) : &cells[0];
  vmm_arena_status plain = vmm_arena_resize(a, id, size, o);
  CHECK(plain != VMM_ARENA_OK);
  CHECK(strstr(vmm_arena_last_error(), "vmm_arena_resize") != NULL);
  vmm_arena_status on_stream = vmm_arena_resize_on_stream(a, id, size, 3, o);
  EXPECT(on_stream, plain);
  CHECK(strstr(vmm_arena_last_error(), "vmm_arena_resize_on_stream") != NULL);
  CHECK(cells[0] == 0x6666 && cells[1] == 0x6666 && cells[2] == 0x6666);
  return on_stream;
}

/* vmm_arena_resize_on_stream (the project header's): its statuses and
 * precedence are vmm_arena_resize's; on the host backend (no asynchronous
 * streams) it resizes exactly as vmm_arena_resize, which two arenas driven
 * alike, one by each, show; a failed event record changes nothing. */
void test_resize_on_stream(void) {
  const vmm_arena_status INV = VMM_ARENA_ERR_INVALID_ARGUMENT;
  const vmm_arena_status UNKNOWN = VMM_ARENA_ERR_UNKNOWN_ALLOCATION;
  uint64_t q = 0x6666;
  EXPECT(vmm_arena_resize_on_stream(NULL, 1, K, 0, &q), INV);
  CHECK(strstr(vmm_arena_last_error(), "arena is NULL") != NULL);
  EXPECT(resize_bad(NULL, 1, K, OUT_VALID), INV);
  EXPECT(resize_bad(NULL, 1, 0, OUT_NULL), INV);
  CHECK(q == 0x6666);

  /* Bad arguments and their precedence, as in test_bad_arguments. */
  vmm_arena *a = make(16, 64, 0);
  vmm_arena_id v, x, y, w;
  uint64_t pv, px, py, pw;
  OK(vmm_arena_alloc(a, K, &v, &pv));
  EXPECT(resize_bad(a, v, K, OUT_NULL), INV);
  CHECK(strstr(vmm_arena_last_error(), "out_ptr is NULL") != NULL);
  EXPECT(resize_bad(a, v, K, OUT_MISALIGNED), INV);
  CHECK(strstr(vmm_arena_last_error(), "out_ptr is not aligned") != NULL);
  EXPECT(resize_bad(a, v, 0, OUT_VALID), INV);
  EXPECT(resize_bad(a, v, UINT64_MAX, OUT_VALID), INV);
  EXPECT(resize_bad(a, v, UINT64_MAX - K + 2, OUT_VALID), INV); /* overflows when rounded up */
  EXPECT(resize_bad(a, v, UINT64_MAX - K + 1, OUT_VALID), VMM_ARENA_ERR_OUT_OF_MEMORY); /* just does not */
  EXPECT(resize_bad(a, v, 17 * K, OUT_VALID), VMM_ARENA_ERR_OUT_OF_MEMORY);
  const vmm_arena_id made_up[] = {0, 12345, UINT64_MAX, v + (1ull << 32), 1ull << 32, v + 1, v ^ 0xFFFF0000ull};
  for (size_t i = 0; i < sizeof made_up / sizeof made_up[0]; i++) {
    EXPECT(resize_bad(a, made_up[i], K, OUT_VALID), UNKNOWN);
    EXPECT(resize_bad(a, made_up[i], 100 * K, OUT_VALID), UNKNOWN); /* not OOM */
  }
  EXPECT(resize_bad(a, 0xDEAD, K, OUT_VALID), UNKNOWN);
  CHECK(strstr(vmm_arena_last_error(), "0xdead") != NULL); /* the id as the caller spelled it */
  OK(vmm_arena_free(a, v));
  EXPECT(resize_bad(a, v, 2 * K, OUT_VALID), UNKNOWN); /* freed */
  EXPECT(resize_bad(a, v, 0, OUT_VALID), INV);         /* stale id, size 0 */
  EXPECT(resize_bad(a, 0, 0, OUT_VALID), INV);         /* id 0, size 0 */
  EXPECT(resize_bad(a, v, UINT64_MAX, OUT_VALID), INV); /* stale id, overflow */
  EXPECT(resize_bad(a, v, K, OUT_NULL), INV);           /* stale id, NULL out */
  EXPECT(resize_bad(a, v, K, OUT_MISALIGNED), INV);     /* stale id, misaligned out */
  OK(vmm_arena_alloc(a, K, &x, &px));
  OK(vmm_arena_alloc(a, K, &y, &py));
  CHECK(py == px + K);
  OK(vmm_arena_pin(a, x));
  OK(vmm_arena_pin(a, y));
  EXPECT(resize_bad(a, x, 0, OUT_VALID), INV);
  EXPECT(resize_bad(a, x, 100 * K, OUT_VALID), VMM_ARENA_ERR_PINNED); /* not OOM */
  EXPECT(resize_bad(a, x, 2 * K, OUT_VALID), VMM_ARENA_ERR_PINNED);
  CHECK(ptr_of(a, x) == px);
  OK(vmm_arena_unpin(a, y));
  OK(vmm_arena_resize_on_stream(a, x, 2 * K, 0, &q)); /* pinned x grows where it stands */
  CHECK(q == px && ptr_of(a, y) != py);
  OK(vmm_arena_resize_on_stream(a, x, K, 0, &q)); /* and shrinks there */
  CHECK(q == px);
  OK(vmm_arena_unpin(a, x));
  EXPECT(resize_bad(a, x, 100 * K, OUT_VALID), VMM_ARENA_ERR_OUT_OF_MEMORY);
  /* Asleep: ASLEEP after the argument checks. */
  OK(vmm_arena_alloc(a, 2 * K, &w, &pw));
  OK(vmm_arena_set_tag(a, w, 2));
  OK(vmm_arena_sleep(a, 2, 0));
  EXPECT(resize_bad(a, w, 0, OUT_VALID), INV);
  EXPECT(resize_bad(a, w, 3 * K, OUT_NULL), INV);
  EXPECT(resize_bad(a, w, K, OUT_VALID), VMM_ARENA_ERR_ASLEEP); /* a shrink too */
  EXPECT(resize_bad(a, w, 3 * K, OUT_VALID), VMM_ARENA_ERR_ASLEEP);
  OK(vmm_arena_wake(a, 2));
  CHECK(stats_of(a).live_allocations == 3 && snapshot_stat(a, "stream_shrinks") == 0);
  vmm_arena_destroy(a);

  /* Two arenas driven alike: r by vmm_arena_resize, s by
   * vmm_arena_resize_on_stream (on various streams). Every step gives the
   * same offset from each arena's base, the same stats and snapshot
   * counters, the same moves, and keeps the bytes. */
  vmm_arena *r = make(32, 128, 0), *s = make(32, 128, 0);
  moves_t mr, ms;
  memset(&mr, 0, sizeof mr);
  memset(&ms, 0, sizeof ms);
  OK(vmm_arena_set_move_callback(r, record_move, &mr));
  OK(vmm_arena_set_move_callback(s, record_move, &ms));
  const uint64_t base_r = snapshot_top(r, "base"), base_s = snapshot_top(s, "base");
  vmm_arena_id gr, gs, nr, ns, sr, ss;
  uint64_t p, pr, ps;
  OK(vmm_arena_alloc_growable(r, K + 100, 4 * K, &gr, &pr));
  OK(vmm_arena_alloc_growable(s, K + 100, 4 * K, &gs, &ps));
  CHECK(pr - base_r == ps - base_s);
  fill(pr, K + 100, 51);
  fill(ps, K + 100, 51);
  /* Each step: which allocation, its new size, the stream for s, and the
   * bytes that must be kept (the old size, or the new one if smaller). */
  struct {
    int which; /* 0: the growable, 1: the small one */
    uint64_t size, stream, kept;
  } steps[] = {
      {0, 3 * K + 5, 0, K + 100},    /* growth within the reservation: in place */
      {0, K / 2, 1, K / 2},          /* a shrink of whole chunks: in place */
      {0, K / 3, UINT64_MAX, K / 3}, /* an unchanged chunk count */
      {0, 4 * K, 0, K / 3},          /* growth back into the cached chunks */
      {0, 7 * K, 2, 4 * K},          /* beyond the reservation, neighbours after it: a move */
      {0, 2 * K + 1, 0, 2 * K + 1},  /* a shrink after the move */
      {1, 200, 5, 100},              /* small, within its class */
      {1, 5000, 0, 200},             /* small, another class */
      {1, 3 * K, 0, 5000},           /* small to whole chunks */
      {1, 2 * K, 9, 2 * K},          /* that one shrinks by a chunk */
      {1, 100, 0, 100},              /* and becomes small again */
  };
  OK(vmm_arena_alloc(r, 100, &sr, &p));
  fill(p, 100, 52);
  OK(vmm_arena_alloc(s, 100, &ss, &p));
  fill(p, 100, 52);
  for (size_t i = 0; i < sizeof steps / sizeof steps[0]; i++) {
    if (i == 4) { /* another neighbour for g, in the same place in both */
      uint64_t pn;
      OK(vmm_arena_alloc(r, K, &nr, &pn));
      OK(vmm_arena_alloc(s, K, &ns, &p));
      CHECK(pn - base_r == p - base_s);
    }
    vmm_arena_id idr = steps[i].which ? sr : gr, ids = steps[i].which ? ss : gs;
    uint32_t seed = steps[i].which ? 52 : 51;
    uint64_t qr = 0, qs = 0;
    OK(vmm_arena_resize(r, idr, steps[i].size, &qr));
    OK(vmm_arena_resize_on_stream(s, ids, steps[i].size, steps[i].stream, &qs));
    CHECK(qr - base_r == qs - base_s);
    CHECK(qs == ptr_of(s, ids));
    CHECK(intact(qr, steps[i].kept, seed) && intact(qs, steps[i].kept, seed));
    fill(qr, steps[i].size, seed);
    fill(qs, steps[i].size, seed);
    if (steps[i].which == 0) pr = qr, ps = qs;
    vmm_arena_stats str = stats_of(r), sts = stats_of(s);
    CHECK(memcmp(&str, &sts, sizeof str) == 0);
    static char json_r[1 << 13], json_s[1 << 13];
    snapshot_stats(r, json_r, sizeof json_r);
    snapshot_stats(s, json_s, sizeof json_s);
    CHECK(strcmp(json_r, json_s) == 0);
    CHECK(mr.count == ms.count);
  }
  int g_moved = 0;
  for (int i = 0; i < ms.count && i < 256; i++) g_moved |= ms.id[i] == gs;
  CHECK(g_moved && stats_of(s).moves >= 1);
  CHECK(snapshot_stat(s, "stream_shrinks") == 0 && snapshot_stat(s, "pending_free_bytes") == 0);
  OK(vmm_arena_free(s, gs));
  OK(vmm_arena_free(s, ns));
  OK(vmm_arena_free(s, ss));
  CHECK(stats_of(s).live_allocations == 0);
  OK(vmm_arena_set_move_callback(r, NULL, NULL));
  OK(vmm_arena_set_move_callback(s, NULL, NULL));
  vmm_arena_destroy(r);
  vmm_arena_destroy(s);

  /* A failed event record: DRIVER, and nothing changed. Growth and small
   * allocations record none (the planned failure does not fire). */
  vmm_arena_config c = host_config(8, 32, 0);
  OK(vmm_arena_testing_create_faulty(&c, &a));
  vmm_arena_id g, t;
  uint64_t pg, pt, calls, injected0, injected;
  OK(vmm_arena_alloc_growable(a, 3 * K, 4 * K, &g, &pg));
  OK(vmm_arena_alloc(a, 300, &t, &pt));
  fill(pg, 3 * K, 53);
  OK(vmm_arena_testing_driver_calls(a, &calls, &injected0));
  OK(vmm_arena_testing_fail_nth(a, CALL_EVENT, 1, FAULT_DRIVER));
  OK(vmm_arena_resize_on_stream(a, g, 4 * K, 4, &q)); /* growth */
  CHECK(q == pg && intact(pg, 3 * K, 53));
  OK(vmm_arena_resize_on_stream(a, t, 100, 4, &q)); /* small */
  OK(vmm_arena_resize_on_stream(a, g, 3 * K + 1, 4, &q)); /* the same chunks */
  OK(vmm_arena_testing_driver_calls(a, &calls, &injected));
  CHECK(injected == injected0);
  vmm_arena_stats before = stats_of(a);
  uint64_t size = 0;
  q = 0x6666;
  EXPECT(vmm_arena_resize_on_stream(a, g, K, 4, &q), VMM_ARENA_ERR_DRIVER);
  CHECK(strstr(vmm_arena_last_error(), "vmm_arena_resize_on_stream") != NULL);
  OK(vmm_arena_testing_driver_calls(a, &calls, &injected));
  CHECK(injected == injected0 + 1 && q == 0x6666);
  vmm_arena_stats after = stats_of(a);
  CHECK(memcmp(&before, &after, sizeof before) == 0);
  OK(vmm_arena_query(a, g, &q, &size));
  CHECK(q == pg && size == 3 * K + 1 && intact(pg, 3 * K, 53));
  OK(vmm_arena_resize_on_stream(a, g, K, 4, &q)); /* the plan is spent: it shrinks */
  CHECK(q == pg && intact(pg, K, 53) && stats_of(a).mapped_bytes == 2 * K);
  OK(vmm_arena_free(a, g));
  OK(vmm_arena_free(a, t));
  vmm_arena_destroy(a);
}

/* The chunks of a faulty arena's driver match what it holds (mapped and
 * pooled), chunk for chunk. */
static void driver_holds_what_the_arena_holds(vmm_arena *a) {
  uint64_t chunks = 0, mappings = 0;
  OK(vmm_arena_testing_driver_objects(a, &chunks, &mappings));
  vmm_arena_stats s = stats_of(a);
  CHECK(chunks * K == s.mapped_bytes + s.pooled_bytes);
}

/* vmm_arena_quiesce_on_stream (the project header's): its statuses (NULL
 * arena, unknown, freed, asleep; a small or pinned allocation is fine),
 * and on the host backend, where the promise holds at once (no
 * asynchronous streams), what it changes: nothing until the allocation
 * gives chunks up; then those chunks are known idle (the snapshot's
 * idle_cached_bytes), and another address takes them with no device
 * synchronize (driver_syncs), where an arena driven alike without the
 * promise synchronizes. Growth and sleep end the promise; a shrink and a
 * move keep it for what they give up; a failed event record changes
 * nothing. */
void test_quiesce_on_stream(void) {
  const vmm_arena_status UNKNOWN = VMM_ARENA_ERR_UNKNOWN_ALLOCATION;
  EXPECT(vmm_arena_quiesce_on_stream(NULL, 1, 0), VMM_ARENA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(vmm_arena_last_error(), "vmm_arena_quiesce_on_stream") != NULL);
  CHECK(strstr(vmm_arena_last_error(), "arena is NULL") != NULL);
  EXPECT(vmm_arena_quiesce_on_stream(NULL, 0, UINT64_MAX), VMM_ARENA_ERR_INVALID_ARGUMENT);

  /* Ids: unknown and freed ones refused, a small or pinned one fine. */
  vmm_arena *a = make(16, 64, 0);
  vmm_arena_id v, s, x, w;
  uint64_t pv, ps, px, pw;
  OK(vmm_arena_alloc(a, 2 * K, &v, &pv));
  const vmm_arena_id made_up[] = {0, 12345, UINT64_MAX, v + (1ull << 32), 1ull << 32, v + 1, v ^ 0xFFFF0000ull};
  for (size_t i = 0; i < sizeof made_up / sizeof made_up[0]; i++) {
    EXPECT(vmm_arena_quiesce_on_stream(a, made_up[i], i), UNKNOWN);
    CHECK(strstr(vmm_arena_last_error(), "vmm_arena_quiesce_on_stream") != NULL);
  }
  EXPECT(vmm_arena_quiesce_on_stream(a, 0xDEAD, 0), UNKNOWN);
  CHECK(strstr(vmm_arena_last_error(), "0xdead") != NULL); /* the id as the caller spelled it */
  OK(vmm_arena_free(a, v));
  EXPECT(vmm_arena_quiesce_on_stream(a, v, 0), UNKNOWN); /* freed */
  OK(vmm_arena_alloc(a, 300, &s, &ps));
  fill(ps, 300, 61);
  vmm_arena_stats before = stats_of(a);
  OK(vmm_arena_quiesce_on_stream(a, s, 3)); /* small: nothing to record */
  OK(vmm_arena_quiesce_on_stream(a, s, 3));
  vmm_arena_stats after = stats_of(a);
  CHECK(memcmp(&before, &after, sizeof before) == 0 && ptr_of(a, s) == ps && intact(ps, 300, 61));
  OK(vmm_arena_alloc(a, K, &x, &px));
  OK(vmm_arena_pin(a, x));
  OK(vmm_arena_quiesce_on_stream(a, x, 0)); /* pinned: fine */
  OK(vmm_arena_unpin(a, x));
  /* Asleep: ASLEEP, and nothing changes; awake again, fine. */
  OK(vmm_arena_alloc(a, 2 * K, &w, &pw));
  fill(pw, 2 * K, 62);
  OK(vmm_arena_set_tag(a, w, 2));
  OK(vmm_arena_sleep(a, 2, VMM_ARENA_SLEEP_BACKUP));
  before = stats_of(a);
  EXPECT(vmm_arena_quiesce_on_stream(a, w, 0), VMM_ARENA_ERR_ASLEEP);
  CHECK(strstr(vmm_arena_last_error(), "vmm_arena_quiesce_on_stream") != NULL);
  after = stats_of(a);
  CHECK(memcmp(&before, &after, sizeof before) == 0);
  OK(vmm_arena_wake(a, 2));
  CHECK(ptr_of(a, w) == pw && intact(pw, 2 * K, 62));
  OK(vmm_arena_quiesce_on_stream(a, w, 0));
  CHECK(snapshot_stat(a, "quiesces") == 0); /* the host records no event */
  OK(vmm_arena_free(a, s));
  OK(vmm_arena_free(a, x));
  OK(vmm_arena_free(a, w));
  CHECK(stats_of(a).live_allocations == 0);
  vmm_arena_destroy(a);

  /* Quiesce, free, allocate: two faulty arenas (their driver objects are
   * counted) driven alike, q with the promise (twice), c without. They
   * agree on every stat of vmm_arena_stats at every step; q's freed chunks
   * are idle, and the allocation that takes them at another address
   * synchronizes in c only. */
  vmm_arena_config cfg = host_config(8, 64, 0);
  vmm_arena *q, *c;
  OK(vmm_arena_testing_create_faulty(&cfg, &q));
  OK(vmm_arena_testing_create_faulty(&cfg, &c));
  vmm_arena_id gq, gc, nq, nc, hq, hc;
  uint64_t pgq, pgc, pn, phq, phc;
  OK(vmm_arena_alloc_growable(q, 3 * K, 4 * K, &gq, &pgq));
  OK(vmm_arena_alloc_growable(c, 3 * K, 4 * K, &gc, &pgc));
  OK(vmm_arena_alloc(q, K, &nq, &pn));
  OK(vmm_arena_alloc(c, K, &nc, &pn));
  fill(pgq, 3 * K, 63);
  OK(vmm_arena_quiesce_on_stream(q, gq, 7));
  OK(vmm_arena_quiesce_on_stream(q, gq, 0)); /* a second promise changes nothing */
  CHECK(ptr_of(q, gq) == pgq && intact(pgq, 3 * K, 63)); /* still usable */
  vmm_arena_stats sq = stats_of(q), sc = stats_of(c);
  CHECK(memcmp(&sq, &sc, sizeof sq) == 0);
  CHECK(snapshot_stat(q, "idle_cached_bytes") == 0 && snapshot_stat(q, "quiesces") == 0);
  OK(vmm_arena_free(q, gq));
  OK(vmm_arena_free(c, gc));
  EXPECT(vmm_arena_quiesce_on_stream(q, gq, 0), UNKNOWN); /* freed */
  sq = stats_of(q), sc = stats_of(c);
  CHECK(memcmp(&sq, &sc, sizeof sq) == 0);
  CHECK(sq.live_allocations == 1 && sq.mapped_bytes == K && sq.pooled_bytes == 3 * K);
  CHECK(snapshot_stat(q, "cached_mapped_bytes") == 3 * K && snapshot_stat(c, "cached_mapped_bytes") == 3 * K);
  CHECK(snapshot_stat(q, "idle_cached_bytes") == 3 * K && snapshot_stat(c, "idle_cached_bytes") == 0);
  const uint64_t syncs_q = snapshot_stat(q, "driver_syncs"), syncs_c = snapshot_stat(c, "driver_syncs");
  OK(vmm_arena_alloc(q, 7 * K, &hq, &phq)); /* the whole capacity: takes the cached chunks */
  OK(vmm_arena_alloc(c, 7 * K, &hc, &phc));
  CHECK(phq - pgq == phc - pgc && phq != pgq); /* at another address, the same in both */
  CHECK(snapshot_stat(q, "driver_syncs") == syncs_q);     /* idle: no synchronize */
  CHECK(snapshot_stat(c, "driver_syncs") == syncs_c + 1); /* not known idle: one */
  sq = stats_of(q), sc = stats_of(c);
  CHECK(memcmp(&sq, &sc, sizeof sq) == 0);
  CHECK(sq.live_allocations == 2 && sq.mapped_bytes == 8 * K && sq.pooled_bytes == 0);
  fill(phq, 7 * K, 64);
  CHECK(intact(phq, 7 * K, 64));
  driver_holds_what_the_arena_holds(q);
  driver_holds_what_the_arena_holds(c);
  OK(vmm_arena_free(q, hq));
  OK(vmm_arena_free(q, nq));
  OK(vmm_arena_free(c, hc));
  OK(vmm_arena_free(c, nc));
  OK(vmm_arena_trim(q, 0, NULL));
  uint64_t chunks = 1, mappings = 1;
  OK(vmm_arena_testing_driver_objects(q, &chunks, &mappings));
  CHECK(chunks == 0 && mappings == 0 && stats_of(q).live_allocations == 0);
  vmm_arena_destroy(q);
  vmm_arena_destroy(c);

  /* What ends the promise and what keeps it. */
  a = make(8, 64, 0);
  vmm_arena_id g, n;
  uint64_t pg, pnb, p;
  /* A shrink keeps it: the dropped chunks are idle at once, the rest at the free. */
  OK(vmm_arena_alloc_growable(a, 3 * K, 4 * K, &g, &pg));
  fill(pg, 3 * K, 65);
  OK(vmm_arena_quiesce_on_stream(a, g, 1));
  OK(vmm_arena_resize(a, g, K, &p));
  CHECK(p == pg && intact(pg, K, 65) && snapshot_stat(a, "idle_cached_bytes") == 2 * K);
  OK(vmm_arena_free(a, g));
  CHECK(snapshot_stat(a, "idle_cached_bytes") == 3 * K);
  OK(vmm_arena_trim(a, 0, NULL));
  /* Growth works, keeps the bytes, and ends it: nothing idle at the free. */
  OK(vmm_arena_alloc_growable(a, K, 4 * K, &g, &pg));
  fill(pg, K, 66);
  OK(vmm_arena_quiesce_on_stream(a, g, 1));
  OK(vmm_arena_resize(a, g, 3 * K, &p));
  CHECK(p == pg && intact(pg, K, 66) && stats_of(a).mapped_bytes == 3 * K);
  fill(pg, 3 * K, 66);
  OK(vmm_arena_free(a, g));
  CHECK(snapshot_stat(a, "cached_mapped_bytes") == 3 * K && snapshot_stat(a, "idle_cached_bytes") == 0);
  OK(vmm_arena_trim(a, 0, NULL));
  /* A move (growth past the reservation, a neighbour after it): its old
   * range is idle, so releasing it synchronizes nothing; the promise ends. */
  OK(vmm_arena_alloc_growable(a, 2 * K, 2 * K, &g, &pg));
  OK(vmm_arena_alloc(a, K, &n, &pnb));
  CHECK(pnb == pg + 2 * K);
  fill(pg, 2 * K, 67);
  OK(vmm_arena_quiesce_on_stream(a, g, 1));
  OK(vmm_arena_resize(a, g, 4 * K, &p));
  CHECK(p != pg && intact(p, 2 * K, 67) && stats_of(a).retired_va_bytes == 2 * K);
  uint64_t syncs = snapshot_stat(a, "driver_syncs");
  OK(vmm_arena_release_retired(a));
  CHECK(stats_of(a).retired_va_bytes == 0 && snapshot_stat(a, "driver_syncs") == syncs);
  OK(vmm_arena_free(a, g));
  CHECK(snapshot_stat(a, "idle_cached_bytes") == 0);
  OK(vmm_arena_free(a, n));
  OK(vmm_arena_trim(a, 0, NULL));
  /* A sleep ends it (waking restores the bytes, for new work). */
  OK(vmm_arena_alloc_growable(a, 3 * K, 4 * K, &g, &pg));
  fill(pg, 3 * K, 68);
  OK(vmm_arena_quiesce_on_stream(a, g, 1));
  OK(vmm_arena_set_tag(a, g, 5));
  OK(vmm_arena_sleep(a, 5, VMM_ARENA_SLEEP_BACKUP));
  OK(vmm_arena_wake(a, 5));
  CHECK(ptr_of(a, g) == pg && intact(pg, 3 * K, 68));
  OK(vmm_arena_free(a, g));
  CHECK(snapshot_stat(a, "cached_mapped_bytes") == 3 * K && snapshot_stat(a, "idle_cached_bytes") == 0);
  OK(vmm_arena_trim(a, 0, NULL));
  /* A stream-ordered free of a quiesced allocation: idle at once too. */
  OK(vmm_arena_alloc_growable(a, 3 * K, 4 * K, &g, &pg));
  OK(vmm_arena_quiesce_on_stream(a, g, 1));
  OK(vmm_arena_free_on_stream(a, g, 1));
  CHECK(snapshot_stat(a, "idle_cached_bytes") == 3 * K && snapshot_stat(a, "pending_free_bytes") == 0);
  CHECK(stats_of(a).live_allocations == 0);
  OK(vmm_arena_trim(a, 0, NULL));
  /* vmm_arena_unquiesce ends it without growth: what was given up before
   * stays idle, what is given up after is not; no driver call. */
  EXPECT(vmm_arena_unquiesce(NULL, 1), VMM_ARENA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(vmm_arena_last_error(), "vmm_arena_unquiesce") != NULL);
  OK(vmm_arena_alloc_growable(a, 3 * K, 4 * K, &g, &pg));
  fill(pg, 3 * K, 69);
  OK(vmm_arena_unquiesce(a, g)); /* no promise: nothing to end */
  OK(vmm_arena_quiesce_on_stream(a, g, 1));
  OK(vmm_arena_resize(a, g, 2 * K, &p));
  CHECK(snapshot_stat(a, "idle_cached_bytes") == K);
  const uint64_t driver_calls = snapshot_stat(a, "caller_driver_calls");
  OK(vmm_arena_unquiesce(a, g));
  CHECK(snapshot_stat(a, "caller_driver_calls") == driver_calls && ptr_of(a, g) == pg && intact(pg, 2 * K, 69));
  OK(vmm_arena_resize(a, g, K, &p));
  CHECK(snapshot_stat(a, "idle_cached_bytes") == K); /* the second shrink's chunk is not idle */
  OK(vmm_arena_free(a, g));
  CHECK(snapshot_stat(a, "idle_cached_bytes") == K && snapshot_stat(a, "cached_mapped_bytes") == 3 * K);
  EXPECT(vmm_arena_unquiesce(a, g), UNKNOWN);
  CHECK(strstr(vmm_arena_last_error(), "vmm_arena_unquiesce") != NULL);
  vmm_arena_destroy(a);

  /* A failed event record: DRIVER, and nothing changed (no promise: the
   * free after it leaves nothing idle). Small and sleeping allocations
   * record none (the planned failure does not fire). */
  cfg = host_config(8, 32, 0);
  OK(vmm_arena_testing_create_faulty(&cfg, &a));
  vmm_arena_id t, z;
  uint64_t pt, pz, calls, injected0, injected;
  OK(vmm_arena_alloc_growable(a, 3 * K, 4 * K, &g, &pg));
  OK(vmm_arena_alloc(a, 300, &t, &pt));
  OK(vmm_arena_alloc(a, K, &z, &pz));
  OK(vmm_arena_set_tag(a, z, 3));
  OK(vmm_arena_sleep(a, 3, 0));
  fill(pg, 3 * K, 69);
  OK(vmm_arena_testing_driver_calls(a, &calls, &injected0));
  OK(vmm_arena_testing_fail_nth(a, CALL_EVENT, 1, FAULT_DRIVER));
  OK(vmm_arena_quiesce_on_stream(a, t, 4)); /* small */
  EXPECT(vmm_arena_quiesce_on_stream(a, z, 4), VMM_ARENA_ERR_ASLEEP);
  EXPECT(vmm_arena_quiesce_on_stream(a, 0xBAD, 4), UNKNOWN);
  OK(vmm_arena_testing_driver_calls(a, &calls, &injected));
  CHECK(injected == injected0);
  before = stats_of(a);
  static char json_before[1 << 13], json_after[1 << 13];
  snapshot_stats(a, json_before, sizeof json_before);
  EXPECT(vmm_arena_quiesce_on_stream(a, g, 4), VMM_ARENA_ERR_DRIVER);
  CHECK(strstr(vmm_arena_last_error(), "vmm_arena_quiesce_on_stream") != NULL);
  OK(vmm_arena_testing_driver_calls(a, &calls, &injected));
  CHECK(injected == injected0 + 1);
  after = stats_of(a);
  CHECK(memcmp(&before, &after, sizeof before) == 0);
  snapshot_stats(a, json_after, sizeof json_after);
  CHECK(strcmp(json_before, json_after) == 0);
  CHECK(ptr_of(a, g) == pg && intact(pg, 3 * K, 69));
  OK(vmm_arena_free(a, g));
  CHECK(snapshot_stat(a, "idle_cached_bytes") == 0); /* the failed call promised nothing */
  OK(vmm_arena_alloc_growable(a, 3 * K, 4 * K, &g, &pg));
  OK(vmm_arena_quiesce_on_stream(a, g, 4)); /* the plan is spent */
  OK(vmm_arena_free(a, g));
  CHECK(snapshot_stat(a, "idle_cached_bytes") == 3 * K);
  driver_holds_what_the_arena_holds(a);
  OK(vmm_arena_free(a, t));
  OK(vmm_arena_free(a, z));
  OK(vmm_arena_trim(a, 0, NULL));
  OK(vmm_arena_testing_driver_objects(a, &chunks, &mappings));
  CHECK(chunks == 0 && mappings == 0);
  vmm_arena_destroy(a);
}
#endif
