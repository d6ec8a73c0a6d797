/*
 * The C ABI fault matrix: every driver call of every C ABI operation fails
 * in turn, with each kind of failure, through the library's testing hooks.
 *
 * The matrix is generated from the table `cases` below: each row is an
 * operation (alloc, alloc_growable, resize that grows, moves or copies,
 * free, compact, release_retired, trim, ...) with the arena state it starts
 * from. For each row:
 *   1. a twin arena is built and the operation run once without faults,
 *      counting its driver calls (vmm_arena_testing_driver_calls);
 *   2. for every call i of them and every fault kind (driver out of memory,
 *      generic driver error), the state is built again and recorded (stats,
 *      snapshot without the driver counters, every allocation's address and
 *      bytes, the driver's live chunks and mappings), call i is made to fail,
 *      and the operation run through the C ABI;
 *   3. the outcome is checked:
 *      - ATOMIC: the status is the fault's (OUT_OF_MEMORY or DRIVER), the
 *        out-parameters are untouched, and the recording is the same;
 *      - BEST_EFFORT (free and shrink with retain_bytes 0, which give memory
 *        back only after their own change is done): VMM_ARENA_OK, the same
 *        change as the twin's, the memory not given back stays pooled and the
 *        snapshot's release_failures counts the failure;
 *      - TRIM (vmm_arena_trim's documented exception): the fault's status;
 *        what was released stays released (and counted), the rest pooled;
 *      and in every case: the driver holds exactly the chunks the stats
 *      account for, the arena keeps working (contents verify, a new
 *      allocation is written and read through its pointer, compaction runs),
 *      and freeing everything, releasing retired ranges and trimming to 0
 *      leaves the driver with no chunk and no mapping.
 *
 * Prints each row and the matrix size. Built with
 * -fsanitize=address,undefined by ffi/tests/c_programs.rs; scripts/valgrind.sh
 * runs it under Valgrind.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vmm_arena.h"
#include "check.h"

/* Testing hooks of libvmm_arena (not part of the ABI; see ffi/src/testing.rs). */
vmm_arena_status vmm_arena_testing_create_faulty(const vmm_arena_config *config, vmm_arena **out);
vmm_arena_status vmm_arena_testing_fail_nth(vmm_arena *arena, uint32_t call_kind, uint64_t n, uint32_t fault);
vmm_arena_status vmm_arena_testing_driver_objects(vmm_arena *arena, uint64_t *chunks, uint64_t *mappings);
vmm_arena_status vmm_arena_testing_driver_calls(vmm_arena *arena, uint64_t *calls, uint64_t *injected);
enum { CALL_ANY = 0 };
enum { FAULT_OOM = 0, FAULT_DRIVER = 1, FAULT_KINDS = 2 };

#define K ((uint64_t)64 << 10) /* the chunk size of the test arenas */
#define KEEP UINT64_MAX
#define MAX_IDS 16
#define SENTINEL 0xA5A5A5A5A5A5A5A5ull

/* What the current check is about, printed when one fails. */
static char what[256];

#define CHECKW(cond)                                   \
  do {                                                 \
    if (!(cond)) fprintf(stderr, "while: %s\n", what); \
    CHECK(cond);                                       \
  } while (0)

#define EXPECTW(call, want)                                           \
  do {                                                                \
    vmm_arena_status w_ = (call);                                     \
    if (w_ != (want)) fprintf(stderr, "while: %s\n", what);           \
    EXPECT(w_, want);                                                 \
  } while (0)

typedef enum { ATOMIC, BEST_EFFORT, TRIM } expect_t;

/* The live allocations of a case, in the order the case keeps them. */
typedef struct {
  vmm_arena_id id[MAX_IDS];
  int n;
} ids_t;

/* The operation's out-parameters, all preset to SENTINEL. */
typedef struct {
  vmm_arena_id id;
  uint64_t ptr, released;
  vmm_arena_compact_report report;
} outs_t;

typedef struct {
  const char *name;
  uint64_t cap, reserve, retain;
  uint32_t flags;
  void (*setup)(vmm_arena *, ids_t *);
  vmm_arena_status (*op)(vmm_arena *, ids_t *, outs_t *);
  expect_t expect;
} case_t;

/* ------------------------------------------------------------ helpers */

static vmm_arena_stats stats_of(vmm_arena *a) {
  vmm_arena_stats s;
  memset(&s, 0, sizeof s);
  s.struct_size = sizeof s;
  OK(vmm_arena_stats_get(a, &s));
  return s;
}

static void push(ids_t *ids, vmm_arena_id id) {
  CHECK(ids->n < MAX_IDS);
  ids->id[ids->n++] = id;
}

static void drop_at(ids_t *ids, int i) {
  CHECK(i >= 0 && i < ids->n);
  memmove(&ids->id[i], &ids->id[i + 1], (size_t)(ids->n - i - 1) * sizeof ids->id[0]);
  ids->n--;
}

static vmm_arena_id A(vmm_arena *a, uint64_t size) {
  vmm_arena_id id;
  uint64_t p;
  OK(vmm_arena_alloc(a, size, &id, &p));
  return id;
}

static vmm_arena_id G(vmm_arena *a, uint64_t size, uint64_t max) {
  vmm_arena_id id;
  uint64_t p;
  OK(vmm_arena_alloc_growable(a, size, max, &id, &p));
  return id;
}

static void R(vmm_arena *a, vmm_arena_id id, uint64_t size) {
  uint64_t p;
  OK(vmm_arena_resize(a, id, size, &p));
}

static void query(vmm_arena *a, vmm_arena_id id, uint64_t *ptr, uint64_t *size) {
  OK(vmm_arena_query(a, id, ptr, size));
}

static uint8_t pattern(vmm_arena_id id, uint64_t i) {
  return (uint8_t)((uint32_t)(id ^ (id >> 29)) * 131u + i * 7u + (i >> 9) + 1u);
}

/* Fills an allocation through its pointer (the host backend's memory). */
static void fill(vmm_arena *a, vmm_arena_id id) {
  uint64_t p, n;
  query(a, id, &p, &n);
  uint8_t *b = (uint8_t *)(uintptr_t)p;
  for (uint64_t i = 0; i < n; i++) b[i] = pattern(id, i);
}

/* The snapshot JSON, with the values of the counters of driver calls
 * removed (a rolled back operation legitimately changes them: its calls and
 * their undoing): driver_*, and the counts by thread and of stream events. */
static char *snapshot_sans_driver(vmm_arena *a) {
  size_t len = 0, len2 = 0;
  OK(vmm_arena_snapshot_json(a, NULL, 0, &len));
  char *s = (char *)malloc(len);
  CHECK(s != NULL);
  OK(vmm_arena_snapshot_json(a, s, len, &len2));
  CHECK(len2 == len && strlen(s) + 1 == len);
  static const char *const counters[] = {"\"driver_", "\"caller_", "\"maintain_driver_calls\"", "\"stream_frees\"",
                                         "\"event_"};
  for (size_t c = 0; c < sizeof counters / sizeof counters[0]; c++) {
    for (char *k = strstr(s, counters[c]); k != NULL; k = strstr(k + 1, counters[c])) {
      char *colon = strchr(k, ':');
      CHECK(colon != NULL);
      char *end = colon + 1;
      while (*end >= '0' && *end <= '9') end++;
      memmove(colon + 1, end, strlen(end) + 1);
    }
  }
  return s;
}

/* One number of the snapshot's stats (those missing from vmm_arena_stats). */
static uint64_t snapshot_stat(vmm_arena *a, const char *key) {
  char *s = snapshot_sans_driver(a);
  char pat[64];
  snprintf(pat, sizeof pat, "\"%s\":", key);
  char *at = strstr(s, pat);
  CHECK(at != NULL);
  uint64_t v = strtoull(at + strlen(pat), NULL, 10);
  free(s);
  return v;
}

static void driver_objects(vmm_arena *a, uint64_t *chunks, uint64_t *mappings) {
  OK(vmm_arena_testing_driver_objects(a, chunks, mappings));
}

static uint64_t driver_calls(vmm_arena *a, uint64_t *injected) {
  uint64_t calls, inj;
  OK(vmm_arena_testing_driver_calls(a, &calls, &inj));
  if (injected) *injected = inj;
  return calls;
}

/* Everything observable that a failed call must not change. */
typedef struct {
  vmm_arena_stats stats;
  char *snapshot;
  int n;
  vmm_arena_id id[MAX_IDS];
  uint64_t ptr[MAX_IDS], size[MAX_IDS];
  uint8_t *bytes[MAX_IDS];
  uint64_t chunks, mappings;
} recording_t;

static void record(vmm_arena *a, const ids_t *ids, recording_t *r) {
  r->stats = stats_of(a);
  r->snapshot = snapshot_sans_driver(a);
  r->n = ids->n;
  for (int i = 0; i < ids->n; i++) {
    r->id[i] = ids->id[i];
    query(a, ids->id[i], &r->ptr[i], &r->size[i]);
    r->bytes[i] = (uint8_t *)malloc(r->size[i] ? r->size[i] : 1);
    CHECK(r->bytes[i] != NULL);
    memcpy(r->bytes[i], (const void *)(uintptr_t)r->ptr[i], r->size[i]);
  }
  driver_objects(a, &r->chunks, &r->mappings);
}

static void forget(recording_t *r) {
  free(r->snapshot);
  for (int i = 0; i < r->n; i++) free(r->bytes[i]);
}

/* Stats equal but for the driver counters (the last five fields). */
static int same_stats(const vmm_arena_stats *x, const vmm_arena_stats *y) {
  return memcmp(&x->live_allocations, &y->live_allocations, 11 * sizeof(uint64_t)) == 0;
}

/* Every recorded allocation is where it was, as big, with its bytes. */
static void check_contents(vmm_arena *a, const recording_t *r, int same_place) {
  for (int i = 0; i < r->n; i++) {
    uint64_t p, n;
    query(a, r->id[i], &p, &n);
    CHECKW(n == r->size[i]);
    if (same_place) CHECKW(p == r->ptr[i]);
    CHECKW(memcmp((const void *)(uintptr_t)p, r->bytes[i], n) == 0);
  }
}

static void check_same(vmm_arena *a, const ids_t *ids, const recording_t *r) {
  vmm_arena_stats s = stats_of(a);
  CHECKW(same_stats(&s, &r->stats));
  char *snap = snapshot_sans_driver(a);
  CHECKW(strcmp(snap, r->snapshot) == 0);
  free(snap);
  CHECKW(ids->n == r->n && memcmp(ids->id, r->id, (size_t)r->n * sizeof r->id[0]) == 0);
  check_contents(a, r, 1);
  uint64_t chunks, mappings;
  driver_objects(a, &chunks, &mappings);
  CHECKW(chunks == r->chunks && mappings == r->mappings);
}

/* The driver holds exactly the chunks the arena accounts for. */
static void check_no_leak(vmm_arena *a) {
  vmm_arena_stats s = stats_of(a);
  uint64_t chunks, mappings;
  driver_objects(a, &chunks, &mappings);
  CHECKW(chunks * K == s.mapped_bytes + s.pooled_bytes);
  CHECKW(s.mapped_bytes + s.pooled_bytes <= s.capacity_bytes);
}

/* The arena still works, and gives everything back at the end. */
static void check_keeps_working_and_tear_down(vmm_arena *a, ids_t *ids, const recording_t *pre) {
  OK(vmm_arena_testing_fail_nth(a, CALL_ANY, 0, FAULT_OOM)); /* clear any plan left */
  /* Contents of the allocations the recording and the case share. */
  for (int i = 0; i < pre->n; i++) {
    for (int j = 0; j < ids->n; j++) {
      if (ids->id[j] != pre->id[i]) continue;
      uint64_t p, n;
      query(a, pre->id[i], &p, &n);
      uint64_t m = n < pre->size[i] ? n : pre->size[i];
      CHECKW(memcmp((const void *)(uintptr_t)p, pre->bytes[i], m) == 0);
    }
  }
  /* Whatever fits: the case may have used up the capacity or, without
   * implicit moves, the address space. */
  vmm_arena_stats s = stats_of(a);
  const uint64_t sizes[2] = {K + 123, 100};
  int made = 0;
  for (int k = 0; k < 2 && !made; k++) {
    uint64_t size = sizes[k];
    vmm_arena_id id = 0;
    uint64_t p = 0;
    vmm_arena_status st = vmm_arena_alloc(a, size, &id, &p);
    if (st == VMM_ARENA_OK) {
      memcpy((void *)(uintptr_t)(p + size - 5), "alive", 5);
      CHECKW(memcmp((const void *)(uintptr_t)(p + size - 5), "alive", 5) == 0);
      OK(vmm_arena_free(a, id));
      made = 1;
    } else {
      CHECKW(st == VMM_ARENA_ERR_OUT_OF_MEMORY || st == VMM_ARENA_ERR_OUT_OF_ADDRESS_SPACE);
    }
  }
  CHECKW(made || s.mapped_bytes == s.capacity_bytes || s.largest_free_va_bytes < K);
  OK(vmm_arena_release_retired(a));
  OK(vmm_arena_compact(a, NULL));
  check_no_leak(a);
  /* Tear down: nothing is left on the driver's side. */
  while (ids->n > 0) {
    OK(vmm_arena_free(a, ids->id[0]));
    drop_at(ids, 0);
  }
  OK(vmm_arena_release_retired(a));
  OK(vmm_arena_trim(a, 0, NULL));
  s = stats_of(a);
  CHECKW(s.live_allocations == 0 && s.mapped_bytes == 0 && s.pooled_bytes == 0 && s.retired_va_bytes == 0);
  CHECKW(s.free_va_bytes == s.reserved_va_bytes);
  uint64_t chunks, mappings;
  driver_objects(a, &chunks, &mappings);
  CHECKW(chunks == 0 && mappings == 0);
}

/* ------------------------------------------------------------ the table */

static void s_one_2k(vmm_arena *a, ids_t *ids) { push(ids, A(a, 2 * K)); }

static void s_one_k(vmm_arena *a, ids_t *ids) { push(ids, A(a, K)); }

static void s_cached_holes(vmm_arena *a, ids_t *ids) {
  vmm_arena_id x = A(a, K), y = A(a, K), z = A(a, K);
  OK(vmm_arena_free(a, x)); /* page 0 cached, a hole of one page */
  OK(vmm_arena_free(a, z)); /* page 2 cached at the start of the big free range */
  push(ids, y);
}

static void s_seven_with_holes(vmm_arena *a, ids_t *ids) {
  vmm_arena_id v[7];
  for (int i = 0; i < 7; i++) v[i] = A(a, K);
  for (int i = 0; i < 7; i++) {
    if (i == 0 || i == 2 || i == 4) {
      OK(vmm_arena_free(a, v[i]));
    } else {
      push(ids, v[i]);
    }
  }
}

static void s_six_with_holes(vmm_arena *a, ids_t *ids) {
  vmm_arena_id v[6];
  for (int i = 0; i < 6; i++) v[i] = A(a, K);
  for (int i = 0; i < 6; i++) {
    if (i == 1 || i == 3) {
      OK(vmm_arena_free(a, v[i]));
    } else {
      push(ids, v[i]);
    }
  }
}

static void s_retired_small_slab(vmm_arena *a, ids_t *ids) {
  vmm_arena_id x = A(a, 100);
  R(a, x, K / 4); /* its first slab now holds only x's retired old place */
  push(ids, x);
  push(ids, A(a, K));
}

static void s_retired_small_slab_growable(vmm_arena *a, ids_t *ids) {
  vmm_arena_id x = A(a, 100);
  R(a, x, K / 4);
  push(ids, x);
  push(ids, G(a, K / 2 + 1, 2 * K));
}

static void s_2k_and_k(vmm_arena *a, ids_t *ids) {
  push(ids, A(a, 2 * K));
  push(ids, A(a, K));
}

static void s_small_and_k(vmm_arena *a, ids_t *ids) {
  push(ids, A(a, 3000));
  push(ids, A(a, K));
}

static void s_1000_and_k(vmm_arena *a, ids_t *ids) {
  push(ids, A(a, 1000));
  push(ids, A(a, K));
}

static void s_growable_6k(vmm_arena *a, ids_t *ids) {
  push(ids, G(a, K, 6 * K));
  push(ids, A(a, K));
}

static void s_growable_2k(vmm_arena *a, ids_t *ids) {
  push(ids, G(a, K, 2 * K));
  push(ids, A(a, K));
}

static void s_pinned_growable(vmm_arena *a, ids_t *ids) {
  vmm_arena_id g = G(a, K, 4 * K);
  OK(vmm_arena_pin(a, g));
  push(ids, g);
  push(ids, A(a, K));
}

static void s_resize_needs_compaction(vmm_arena *a, ids_t *ids) {
  vmm_arena_id x = A(a, 2 * K);     /* [0, 2) */
  vmm_arena_id g = G(a, K, K);      /* [2, 3) */
  vmm_arena_id b = A(a, K);         /* [3, 4) */
  vmm_arena_id c = A(a, 2 * K);     /* [4, 6) */
  vmm_arena_id d = A(a, K);         /* [6, 7) */
  OK(vmm_arena_free(a, x));
  OK(vmm_arena_free(a, c));
  push(ids, g); /* free: [0, 2), [4, 6), [7, 8) */
  push(ids, b);
  push(ids, d);
}

static void s_4k_and_k(vmm_arena *a, ids_t *ids) {
  push(ids, A(a, 4 * K));
  push(ids, A(a, K));
}

static void s_compact(vmm_arena *a, ids_t *ids) {
  const uint64_t sizes[5] = {2 * K, K, K, 2 * K, 700};
  vmm_arena_id v[5];
  for (int i = 0; i < 5; i++) v[i] = A(a, sizes[i]);
  OK(vmm_arena_free(a, v[0]));
  OK(vmm_arena_free(a, v[2]));
  push(ids, v[1]);
  push(ids, v[3]);
  push(ids, v[4]);
}

static void s_compact_pinned(vmm_arena *a, ids_t *ids) {
  vmm_arena_id v[5];
  for (int i = 0; i < 5; i++) v[i] = A(a, K);
  OK(vmm_arena_free(a, v[0]));
  OK(vmm_arena_free(a, v[2]));
  OK(vmm_arena_pin(a, v[1]));
  push(ids, v[1]);
  push(ids, v[3]);
  push(ids, v[4]);
}

static void s_two_retired(vmm_arena *a, ids_t *ids) {
  vmm_arena_id g = G(a, K, K);
  vmm_arena_id b = A(a, K);
  R(a, g, 2 * K); /* moves: page 0 retired */
  vmm_arena_id h = G(a, 2 * K, 2 * K);
  vmm_arena_id c = A(a, K);
  R(a, h, 3 * K); /* moves too: a second retired range */
  CHECK(stats_of(a).retired_va_bytes == 3 * K);
  push(ids, g);
  push(ids, b);
  push(ids, h);
  push(ids, c);
}

static void s_retired_no_room(vmm_arena *a, ids_t *ids) {
  vmm_arena_id g = G(a, K, K); /* [0, 1) */
  vmm_arena_id b = A(a, K);    /* [1, 2) */
  R(a, g, 2 * K);              /* moves to [2, 4): page 0 retired, nothing free */
  CHECK(stats_of(a).free_va_bytes == 0);
  push(ids, g);
  push(ids, b);
}

static void s_trim_pool(vmm_arena *a, ids_t *ids) {
  const uint64_t sizes[5] = {2 * K, K, 2 * K, K, K};
  vmm_arena_id v[5];
  for (int i = 0; i < 5; i++) v[i] = A(a, sizes[i]);
  OK(vmm_arena_free(a, v[0]));        /* pages 0, 1 cached */
  OK(vmm_arena_compact(a, NULL));     /* v[1] lands on page 0: its cached chunk goes to the pool */
  OK(vmm_arena_free(a, v[3]));
  CHECK(snapshot_stat(a, "pooled_unmapped_chunks") > 0 && snapshot_stat(a, "cached_mapped_bytes") > 0);
  push(ids, v[1]);
  push(ids, v[2]);
  push(ids, v[4]);
}

static void s_trim_retired(vmm_arena *a, ids_t *ids) {
  vmm_arena_id g = G(a, K, K);
  vmm_arena_id b = A(a, K);
  R(a, g, 2 * K); /* moves: page 0 retired, mapping g's first chunk */
  OK(vmm_arena_free(a, g));
  push(ids, b);
}

static vmm_arena_status op_alloc(vmm_arena *a, ids_t *ids, uint64_t size, outs_t *o) {
  vmm_arena_status st = vmm_arena_alloc(a, size, &o->id, &o->ptr);
  if (st == VMM_ARENA_OK) push(ids, o->id);
  return st;
}

static vmm_arena_status op_alloc_growable(vmm_arena *a, ids_t *ids, uint64_t size, uint64_t max, outs_t *o) {
  vmm_arena_status st = vmm_arena_alloc_growable(a, size, max, &o->id, &o->ptr);
  if (st == VMM_ARENA_OK) push(ids, o->id);
  return st;
}

static vmm_arena_status op_free(vmm_arena *a, ids_t *ids, int i) {
  vmm_arena_status st = vmm_arena_free(a, ids->id[i]);
  if (st == VMM_ARENA_OK) drop_at(ids, i);
  return st;
}

static vmm_arena_status o_alloc_3k(vmm_arena *a, ids_t *ids, outs_t *o) { return op_alloc(a, ids, 3 * K, o); }
static vmm_arena_status o_alloc_2k(vmm_arena *a, ids_t *ids, outs_t *o) { return op_alloc(a, ids, 2 * K, o); }
static vmm_arena_status o_alloc_4k(vmm_arena *a, ids_t *ids, outs_t *o) { return op_alloc(a, ids, 4 * K, o); }
static vmm_arena_status o_alloc_k(vmm_arena *a, ids_t *ids, outs_t *o) { return op_alloc(a, ids, K, o); }
static vmm_arena_status o_alloc_1000(vmm_arena *a, ids_t *ids, outs_t *o) { return op_alloc(a, ids, 1000, o); }
static vmm_arena_status o_growable_2k_6k(vmm_arena *a, ids_t *ids, outs_t *o) {
  return op_alloc_growable(a, ids, 2 * K, 6 * K, o);
}
static vmm_arena_status o_growable_k_3k(vmm_arena *a, ids_t *ids, outs_t *o) {
  return op_alloc_growable(a, ids, K, 3 * K, o);
}
static vmm_arena_status o_free_first(vmm_arena *a, ids_t *ids, outs_t *o) {
  (void)o;
  return op_free(a, ids, 0);
}
static vmm_arena_status o_resize0_4k(vmm_arena *a, ids_t *ids, outs_t *o) {
  return vmm_arena_resize(a, ids->id[0], 4 * K, &o->ptr);
}
static vmm_arena_status o_resize0_3k(vmm_arena *a, ids_t *ids, outs_t *o) {
  return vmm_arena_resize(a, ids->id[0], 3 * K, &o->ptr);
}
static vmm_arena_status o_resize0_k(vmm_arena *a, ids_t *ids, outs_t *o) {
  return vmm_arena_resize(a, ids->id[0], K, &o->ptr);
}
static vmm_arena_status o_resize0_20000(vmm_arena *a, ids_t *ids, outs_t *o) {
  return vmm_arena_resize(a, ids->id[0], 20000, &o->ptr);
}
static vmm_arena_status o_resize1_k1(vmm_arena *a, ids_t *ids, outs_t *o) {
  return vmm_arena_resize(a, ids->id[1], K + 1, &o->ptr);
}
static vmm_arena_status o_compact(vmm_arena *a, ids_t *ids, outs_t *o) {
  (void)ids;
  return vmm_arena_compact(a, &o->report);
}
static vmm_arena_status o_release_retired(vmm_arena *a, ids_t *ids, outs_t *o) {
  (void)ids;
  (void)o;
  return vmm_arena_release_retired(a);
}
static vmm_arena_status o_trim0(vmm_arena *a, ids_t *ids, outs_t *o) {
  (void)ids;
  return vmm_arena_trim(a, 0, &o->released);
}

static const case_t cases[] = {
    {"alloc that must create", 8, 16, KEEP, 0, s_one_2k, o_alloc_3k, ATOMIC},
    {"alloc that steals a cached chunk", 3, 16, KEEP, 0, s_cached_holes, o_alloc_2k, ATOMIC},
    {"alloc that must compact", 8, 8, KEEP, 0, s_seven_with_holes, o_alloc_4k, ATOMIC},
    {"alloc that reclaims a slab of retired small objects", 4, 16, KEEP, 0, s_retired_small_slab, o_alloc_2k,
     ATOMIC},
    {"alloc that releases retired ranges (no implicit moves)", 8, 4, KEEP, VMM_ARENA_FLAG_NO_IMPLICIT_MOVES,
     s_retired_no_room, o_alloc_k, ATOMIC},
    {"alloc_growable", 8, 16, KEEP, 0, s_one_k, o_growable_2k_6k, ATOMIC},
    {"alloc_growable that must compact", 8, 8, KEEP, 0, s_six_with_holes, o_growable_k_3k, ATOMIC},
    {"alloc small (new slab)", 8, 16, KEEP, 0, s_one_2k, o_alloc_1000, ATOMIC},
    {"free (retain 0: gives the chunks back)", 8, 16, 0, 0, s_2k_and_k, o_free_first, BEST_EFFORT},
    {"free small emptying its slab (retain 0)", 8, 16, 0, 0, s_small_and_k, o_free_first, BEST_EFFORT},
    {"resize grow in place", 8, 16, KEEP, 0, s_growable_6k, o_resize0_4k, ATOMIC},
    {"resize grow in place of a pinned allocation", 8, 16, KEEP, 0, s_pinned_growable, o_resize0_3k, ATOMIC},
    {"resize grow into the free range after it", 8, 16, KEEP, 0, s_one_k, o_resize0_3k, ATOMIC},
    {"resize grow that reclaims a slab of retired small objects", 3, 16, KEEP, 0, s_retired_small_slab_growable,
     o_resize1_k1, ATOMIC},
    {"resize grow beyond the reservation (move)", 8, 16, KEEP, 0, s_growable_2k, o_resize0_3k, ATOMIC},
    {"resize that needs compaction", 8, 8, KEEP, 0, s_resize_needs_compaction, o_resize0_3k, ATOMIC},
    {"shrink (retain 0: gives the tail back)", 8, 16, 0, 0, s_4k_and_k, o_resize0_k, BEST_EFFORT},
    {"resize small beyond its class (copy)", 8, 16, KEEP, 0, s_1000_and_k, o_resize0_20000, ATOMIC},
    {"resize small beyond the small classes (copy to chunks)", 8, 16, KEEP, 0, s_1000_and_k, o_resize0_3k,
     ATOMIC},
    {"compact", 8, 8, KEEP, 0, s_compact, o_compact, ATOMIC},
    {"compact around a pinned allocation", 8, 8, KEEP, 0, s_compact_pinned, o_compact, ATOMIC},
    {"release_retired", 8, 16, KEEP, 0, s_two_retired, o_release_retired, ATOMIC},
    {"trim (pooled chunks, mapped and unmapped)", 8, 16, KEEP, 0, s_trim_pool, o_trim0, TRIM},
    {"trim of chunks still mapped at a retired range", 8, 16, KEEP, 0, s_trim_retired, o_trim0, TRIM},
};

/* ------------------------------------------------------------ the matrix */

static vmm_arena *build(const case_t *c, ids_t *ids) {
  vmm_arena_config cfg;
  vmm_arena_config_default(&cfg);
  cfg.backend = VMM_ARENA_BACKEND_HOST;
  cfg.chunk_bytes = K;
  cfg.capacity_bytes = c->cap * K;
  cfg.reserve_bytes = c->reserve * K;
  cfg.retain_bytes = c->retain;
  cfg.flags = c->flags;
  vmm_arena *a = NULL;
  OK(vmm_arena_testing_create_faulty(&cfg, &a));
  ids->n = 0;
  c->setup(a, ids);
  CHECKW(stats_of(a).live_allocations == (uint64_t)ids->n); /* the setup lists every allocation */
  for (int i = 0; i < ids->n; i++) fill(a, ids->id[i]);
  return a;
}

static void preset(outs_t *o) { memset(o, 0xA5, sizeof *o); }

static int untouched(const outs_t *o) {
  outs_t s;
  preset(&s);
  return memcmp(o, &s, sizeof s) == 0;
}

/* Allocations as (offset from the snapshot's base, size), for comparing two arenas. */
static void layout(vmm_arena *a, const ids_t *ids, uint64_t *out) {
  uint64_t base = snapshot_stat(a, "base");
  for (int i = 0; i < ids->n; i++) {
    uint64_t p, n;
    query(a, ids->id[i], &p, &n);
    out[2 * i] = p - base;
    out[2 * i + 1] = n;
  }
}

static uint64_t run_case(const case_t *c, uint64_t *calls_out) {
  ids_t ids;
  /* The twin: count the calls; keep its outcome for the best-effort rows. */
  snprintf(what, sizeof what, "%s / twin", c->name);
  vmm_arena *t = build(c, &ids);
  uint64_t calls0 = driver_calls(t, NULL);
  outs_t o;
  preset(&o);
  OK(c->op(t, &ids, &o));
  uint64_t calls = driver_calls(t, NULL) - calls0;
  CHECKW(calls > 0); /* else the row tests nothing */
  check_no_leak(t);
  vmm_arena_stats twin = stats_of(t);
  uint64_t twin_layout[2 * MAX_IDS];
  int twin_n = ids.n;
  layout(t, &ids, twin_layout);
  recording_t none;
  memset(&none, 0, sizeof none);
  check_keeps_working_and_tear_down(t, &ids, &none);
  vmm_arena_destroy(t);

  uint64_t injected = 0;
  for (uint64_t i = 1; i <= calls; i++) {
    for (uint32_t kind = 0; kind < FAULT_KINDS; kind++) {
      snprintf(what, sizeof what, "%s / call %llu of %llu fails with %s", c->name, (unsigned long long)i,
               (unsigned long long)calls, kind == FAULT_OOM ? "OUT_OF_MEMORY" : "DRIVER");
      vmm_arena *a = build(c, &ids);
      recording_t pre;
      record(a, &ids, &pre);
      uint64_t inj0;
      driver_calls(a, &inj0);
      OK(vmm_arena_testing_fail_nth(a, CALL_ANY, i, kind));
      preset(&o);
      vmm_arena_status st = c->op(a, &ids, &o);
      uint64_t inj1;
      driver_calls(a, &inj1);
      CHECKW(inj1 == inj0 + 1); /* the planned failure fired */
      injected++;
      vmm_arena_status want = kind == FAULT_OOM ? VMM_ARENA_ERR_OUT_OF_MEMORY : VMM_ARENA_ERR_DRIVER;
      switch (c->expect) {
        case ATOMIC:
          EXPECTW(st, want);
          CHECKW(untouched(&o));
          CHECKW(strstr(vmm_arena_last_error(), "injected") != NULL);
          check_same(a, &ids, &pre);
          break;
        case BEST_EFFORT: {
          EXPECTW(st, VMM_ARENA_OK);
          vmm_arena_stats s = stats_of(a);
          CHECKW(s.live_allocations == twin.live_allocations && s.live_bytes == twin.live_bytes &&
                 s.mapped_bytes == twin.mapped_bytes);
          CHECKW(s.pooled_bytes >= twin.pooled_bytes);
          CHECKW(snapshot_stat(a, "release_failures") == 1);
          uint64_t now[2 * MAX_IDS];
          CHECKW(ids.n == twin_n);
          layout(a, &ids, now);
          CHECKW(memcmp(now, twin_layout, (size_t)twin_n * 2 * sizeof now[0]) == 0);
          break;
        }
        case TRIM: {
          EXPECTW(st, want);
          CHECKW(untouched(&o));
          vmm_arena_stats s = stats_of(a);
          CHECKW(s.live_allocations == pre.stats.live_allocations && s.live_bytes == pre.stats.live_bytes &&
                 s.mapped_bytes == pre.stats.mapped_bytes);
          uint64_t released = s.driver_releases - pre.stats.driver_releases;
          CHECKW(pre.stats.pooled_bytes - s.pooled_bytes == released * K);
          check_contents(a, &pre, 1);
          break;
        }
      }
      check_no_leak(a);
      if (c->expect == TRIM) {
        OK(vmm_arena_trim(a, 0, NULL));
        CHECKW(stats_of(a).pooled_bytes == 0); /* a second trim finishes the job */
      }
      check_keeps_working_and_tear_down(a, &ids, &pre);
      forget(&pre);
      vmm_arena_destroy(a);
    }
  }
  *calls_out = calls;
  return injected;
}

int main(void) {
  setvbuf(stdout, NULL, _IONBF, 0);
  const size_t rows = sizeof cases / sizeof cases[0];
  uint64_t total = 0, total_calls = 0;
  printf("C ABI fault matrix (%zu operations x their driver calls x %d fault kinds):\n", rows, FAULT_KINDS);
  for (size_t r = 0; r < rows; r++) {
    uint64_t calls = 0;
    uint64_t n = run_case(&cases[r], &calls);
    printf("  %-60s %3llu calls -> %3llu faults\n", cases[r].name, (unsigned long long)calls,
           (unsigned long long)n);
    total += n;
    total_calls += calls;
  }
  CHECK(total == total_calls * FAULT_KINDS);
  printf("C ABI fault matrix size: %llu injected faults over %zu operations\n", (unsigned long long)total, rows);
  FINISH("test_faults");
}
