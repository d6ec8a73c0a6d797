/*
 * Allocations ordered on a stream through the C ABI
 * (vmm_arena_alloc_on_stream, vmm_arena_alloc_growable_on_stream, growth by
 * vmm_arena_resize_on_stream), on the host backend, under
 * -fsanitize=address,undefined:
 *  - the bytes are the caller's, the pointer chunk-aligned, query agrees;
 *  - memory freed or shrunk on a stream serves an allocation on that stream
 *    with no new chunk;
 *  - a growable allocation on a stream grows with resize_on_stream;
 *  - a small size is a small allocation;
 *  - refusals: NULL arena and out-parameters, max_size < size, a size over
 *    the capacity (OUT_OF_MEMORY), out-parameters untouched on failure;
 *  - a fault matrix: every driver call of each fails in turn (testing
 *    hooks), with both kinds: the fault's status, nothing kept (driver
 *    chunks, stats as before), and a retry succeeds.
 * The host backend has no asynchronous streams: what waits for an event on a
 * GPU is checked by the library's tests (the mock driver's streams).
 */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "vmm_arena.h"
#include "check.h"

vmm_arena_status vmm_arena_testing_create_faulty(const vmm_arena_config *config, vmm_arena **out);
vmm_arena_status vmm_arena_testing_fail_nth(vmm_arena *arena, uint32_t call_kind, uint64_t n, uint32_t fault);
vmm_arena_status vmm_arena_testing_driver_objects(vmm_arena *arena, uint64_t *out_chunks, uint64_t *out_mappings);
vmm_arena_status vmm_arena_testing_driver_calls(vmm_arena *arena, uint64_t *out_calls, uint64_t *out_injected);

#define K ((uint64_t)64 << 10)
#define STREAM 7u

static vmm_arena_config config(void) {
  vmm_arena_config c;
  vmm_arena_config_default(&c);
  c.backend = VMM_ARENA_BACKEND_HOST;
  c.capacity_bytes = 8 * K;
  c.reserve_bytes = 64 * K;
  c.chunk_bytes = K;
  return c;
}

static vmm_arena *make(int faulty) {
  vmm_arena_config c = config();
  vmm_arena *a = NULL;
  if (faulty)
    OK(vmm_arena_testing_create_faulty(&c, &a));
  else
    OK(vmm_arena_create(&c, &a));
  return a;
}

static vmm_arena_stats stats_of(vmm_arena *a) {
  vmm_arena_stats s;
  memset(&s, 0, sizeof s);
  s.struct_size = sizeof s;
  OK(vmm_arena_stats_get(a, &s));
  return s;
}

static void fill(uint64_t ptr, uint64_t len, uint8_t v) { memset((void *)(uintptr_t)ptr, v, (size_t)len); }

static int all(uint64_t ptr, uint64_t len, uint8_t v) {
  const uint8_t *p = (const uint8_t *)(uintptr_t)ptr;
  for (uint64_t i = 0; i < len; i++)
    if (p[i] != v)
      return 0;
  return 1;
}

static void test_bytes_and_reuse(void) {
  vmm_arena *a = make(0);
  vmm_arena_id x = 0, y = 0, g = 0, s = 0;
  uint64_t xp = 0, yp = 0, gp = 0, sp = 0, qp = 0, qs = 0;
  OK(vmm_arena_alloc_on_stream(a, 3 * K - 100, STREAM, &x, &xp));
  CHECK(x != 0 && xp % K == 0);
  fill(xp, 3 * K - 100, 0x5a);
  CHECK(all(xp, 3 * K - 100, 0x5a));
  OK(vmm_arena_query(a, x, &qp, &qs));
  CHECK(qp == xp && qs == 3 * K - 100);
  OK(vmm_arena_free_on_stream(a, x, STREAM));
  vmm_arena_stats before = stats_of(a);
  /* Freed on the stream: serves the next allocation on it, no new chunk. */
  OK(vmm_arena_alloc_on_stream(a, 3 * K, STREAM, &y, &yp));
  vmm_arena_stats after = stats_of(a);
  CHECK(after.driver_creates == before.driver_creates);
  fill(yp, 3 * K, 0x11);
  /* A growable one grows on its stream into chunks y shrinks away. */
  OK(vmm_arena_alloc_growable_on_stream(a, K, 16 * K, STREAM, &g, &gp));
  CHECK(gp % K == 0);
  uint64_t np = 0;
  OK(vmm_arena_resize_on_stream(a, y, K, STREAM, &np));
  CHECK(np == yp && all(yp, K, 0x11));
  before = stats_of(a);
  OK(vmm_arena_resize_on_stream(a, g, 3 * K, STREAM, &np));
  CHECK(np == gp);
  after = stats_of(a);
  CHECK(after.driver_creates == before.driver_creates);
  fill(gp, 3 * K, 0x22);
  CHECK(all(yp, K, 0x11) && all(gp, 3 * K, 0x22));
  /* A small size: a small allocation (inside a slab, not chunk-aligned in general). */
  OK(vmm_arena_alloc_on_stream(a, 300, STREAM, &s, &sp));
  CHECK(s != 0 && sp != 0);
  fill(sp, 300, 0x33);
  CHECK(all(sp, 300, 0x33));
  OK(vmm_arena_free(a, s));
  OK(vmm_arena_free(a, g));
  OK(vmm_arena_free(a, y));
  vmm_arena_destroy(a);
}

static void test_refusals(void) {
  vmm_arena *a = make(0);
  vmm_arena_id id = 42;
  uint64_t p = 43;
  EXPECT(vmm_arena_alloc_on_stream(NULL, K, STREAM, &id, &p), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_alloc_on_stream(a, K, STREAM, NULL, &p), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_alloc_on_stream(a, K, STREAM, &id, NULL), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_alloc_on_stream(a, 0, STREAM, &id, &p), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_alloc_on_stream(a, 9 * K, STREAM, &id, &p), VMM_ARENA_ERR_OUT_OF_MEMORY);
  EXPECT(vmm_arena_alloc_growable_on_stream(NULL, K, 2 * K, STREAM, &id, &p), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_alloc_growable_on_stream(a, 2 * K, K, STREAM, &id, &p), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_alloc_growable_on_stream(a, K, 2 * K, STREAM, NULL, &p), VMM_ARENA_ERR_INVALID_ARGUMENT);
  CHECK(id == 42 && p == 43); /* written only on VMM_ARENA_OK */
  vmm_arena_stats s = stats_of(a);
  CHECK(s.live_allocations == 0 && s.mapped_bytes == 0);
  vmm_arena_destroy(a);
}

/* One operation of the matrix, on an arena with a chunk freed on STREAM. */
typedef vmm_arena_status (*op_fn)(vmm_arena *a, vmm_arena_id *id, uint64_t *p);

static vmm_arena_status op_alloc(vmm_arena *a, vmm_arena_id *id, uint64_t *p) {
  return vmm_arena_alloc_on_stream(a, 4 * K, STREAM, id, p);
}

static vmm_arena_status op_growable(vmm_arena *a, vmm_arena_id *id, uint64_t *p) {
  return vmm_arena_alloc_growable_on_stream(a, 4 * K, 16 * K, STREAM, id, p);
}

static vmm_arena *matrix_case(void) {
  vmm_arena *a = make(1);
  vmm_arena_id x = 0;
  uint64_t xp = 0;
  OK(vmm_arena_alloc_on_stream(a, 2 * K, STREAM, &x, &xp));
  OK(vmm_arena_free_on_stream(a, x, STREAM));
  return a;
}

static uint64_t calls_of(vmm_arena *a) {
  uint64_t calls = 0, injected = 0;
  OK(vmm_arena_testing_driver_calls(a, &calls, &injected));
  return calls;
}

static unsigned long faults_of(op_fn op) {
  vmm_arena *twin = matrix_case();
  uint64_t c0 = calls_of(twin);
  vmm_arena_id id = 0;
  uint64_t p = 0;
  OK(op(twin, &id, &p));
  uint64_t calls = calls_of(twin) - c0;
  CHECK(calls > 0);
  vmm_arena_destroy(twin);
  unsigned long n = 0;
  for (uint64_t i = 1; i <= calls; i++) {
    for (uint32_t kind = 0; kind < 2; kind++) {
      vmm_arena *a = matrix_case();
      uint64_t chunks0 = 0, maps0 = 0;
      OK(vmm_arena_testing_driver_objects(a, &chunks0, &maps0));
      vmm_arena_stats s0 = stats_of(a);
      OK(vmm_arena_testing_fail_nth(a, 0, i, kind));
      id = 7;
      p = 8;
      EXPECT(op(a, &id, &p), kind == 0 ? VMM_ARENA_ERR_OUT_OF_MEMORY : VMM_ARENA_ERR_DRIVER);
      CHECK(id == 7 && p == 8);
      uint64_t chunks = 0, maps = 0;
      OK(vmm_arena_testing_driver_objects(a, &chunks, &maps));
      CHECK(chunks == chunks0 && maps == maps0);
      vmm_arena_stats s = stats_of(a);
      CHECK(s.live_allocations == s0.live_allocations && s.mapped_bytes == s0.mapped_bytes);
      CHECK(s.pooled_bytes == s0.pooled_bytes);
      OK(op(a, &id, &p)); /* a retry succeeds */
      fill(p, 4 * K, 0x44);
      CHECK(all(p, 4 * K, 0x44));
      OK(vmm_arena_free(a, id));
      vmm_arena_destroy(a);
      n++;
    }
  }
  return n;
}

int main(void) {
  test_bytes_and_reuse();
  test_refusals();
  unsigned long fa = faults_of(op_alloc), fg = faults_of(op_growable);
  printf("C ABI stream-ordered allocation fault matrix size: %lu (alloc %lu, growable %lu)\n", fa + fg, fa, fg);
  FINISH("test_stream");
}
