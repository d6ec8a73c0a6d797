/*
 * Device groups through the C ABI (vmm_arena_group_*), on the host backend
 * (N arenas stand for N devices), under -fsanitize=address,undefined:
 *  - the calls, their NULL and bad arguments, unknown ids, member indexes;
 *  - all or nothing: a fault matrix over the group (every driver call of
 *    every member fails in turn, with both fault kinds, through the testing
 *    hooks): the status is the fault's, vmm_arena_group_last_member() names
 *    the member, every member holds what it held before (live allocations,
 *    live and mapped bytes, driver chunks = held memory), bytes survive;
 *  - threads allocating, growing and freeing group allocations at once.
 */
#define _GNU_SOURCE
#include <inttypes.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vmm_arena.h"
#include "check.h"

/* Testing hooks (not in the header). */
vmm_arena_status vmm_arena_testing_group_create_faulty(const vmm_arena_config *config, uint32_t count,
                                                       vmm_arena_group **out);
vmm_arena_status vmm_arena_testing_group_fail_nth(vmm_arena_group *group, uint32_t member, uint32_t call_kind,
                                                  uint64_t n, uint32_t fault);
vmm_arena_status vmm_arena_testing_group_driver_state(vmm_arena_group *group, uint32_t member, uint64_t *out_calls,
                                                      uint64_t *out_injected, uint64_t *out_chunks,
                                                      uint64_t *out_mappings);

#define K ((uint64_t)64 << 10)
#define N 3

static vmm_arena_config host_config(uint64_t cap_chunks) {
  vmm_arena_config c;
  vmm_arena_config_default(&c);
  c.backend = VMM_ARENA_BACKEND_HOST;
  c.capacity_bytes = cap_chunks * K;
  c.reserve_bytes = 4 * cap_chunks * K;
  c.chunk_bytes = K;
  return c;
}

static vmm_arena_stats member_stats(vmm_arena_group *g, uint32_t m) {
  vmm_arena_stats s;
  memset(&s, 0, sizeof s);
  s.struct_size = sizeof s;
  OK(vmm_arena_group_stats_get(g, m, &s));
  return s;
}

static void test_calls_and_arguments(void) {
  vmm_arena_config c = host_config(16);
  int32_t devices[N] = {0, 1, 2};
  vmm_arena_group *g = NULL;
  EXPECT(vmm_arena_group_create(NULL, devices, N, 0, &g), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_group_create(&c, NULL, N, 0, &g), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_group_create(&c, devices, 0, 0, &g), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_group_create(&c, devices, N, 0x80, &g), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_group_create(&c, devices, N, 0, NULL), VMM_ARENA_ERR_INVALID_ARGUMENT);
  int32_t twice[2] = {1, 1};
  EXPECT(vmm_arena_group_create(&c, twice, 2, 0, &g), VMM_ARENA_ERR_INVALID_ARGUMENT);
  CHECK(vmm_arena_group_last_member() == -1);
  CHECK(g == NULL);
  OK(vmm_arena_group_create(&c, devices, N, VMM_ARENA_GROUP_PEER_ACCESS, &g));
  uint32_t count = 0;
  OK(vmm_arena_group_member_count(g, &count));
  CHECK(count == N);
  EXPECT(vmm_arena_group_member_count(NULL, &count), VMM_ARENA_ERR_INVALID_ARGUMENT);

  vmm_arena_group_id id = 0;
  uint64_t ptrs[N] = {0};
  EXPECT(vmm_arena_group_alloc(g, K, &id, ptrs, N - 1), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_group_alloc(g, K, &id, NULL, N), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_group_alloc(g, K, NULL, ptrs, N), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_group_alloc(g, 0, &id, ptrs, N), VMM_ARENA_ERR_INVALID_ARGUMENT);
  CHECK(vmm_arena_group_last_member() == 0); /* member 0 refused size 0 */
  CHECK(id == 0 && ptrs[0] == 0);           /* out-parameters untouched on failure */
  OK(vmm_arena_group_alloc_growable(g, K, 8 * K, &id, ptrs, N));
  CHECK(id != 0);
  for (uint32_t m = 0; m < N; m++) {
    CHECK(ptrs[m] != 0 && ptrs[m] % K == 0);
    memset((void *)(uintptr_t)ptrs[m], 0x40 + (int)m, K);
  }
  uint64_t grown[N] = {0};
  OK(vmm_arena_group_resize(g, id, 5 * K, grown, N));
  for (uint32_t m = 0; m < N; m++) {
    CHECK(grown[m] == ptrs[m]); /* in place: within the reservation */
    uint8_t *p = (uint8_t *)(uintptr_t)grown[m];
    CHECK(p[0] == 0x40 + m && p[K - 1] == 0x40 + m);
    p[5 * K - 1] = (uint8_t)m;
    uint64_t ptr = 0, size = 0;
    vmm_arena_id mid = 0;
    OK(vmm_arena_group_query(g, id, m, &ptr, &size, &mid));
    CHECK(ptr == grown[m] && size == 5 * K && mid != 0);
    vmm_arena_stats s = member_stats(g, m);
    CHECK(s.live_allocations == 1 && s.live_bytes == 5 * K && s.mapped_bytes == 5 * K);
  }
  OK(vmm_arena_group_query(g, id, 0, NULL, NULL, NULL));
  EXPECT(vmm_arena_group_query(g, id, N, NULL, NULL, NULL), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_group_query(g, 0, 0, NULL, NULL, NULL), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
  EXPECT(vmm_arena_group_resize(g, id + 1000, K, grown, N), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
  CHECK(vmm_arena_group_last_member() == -1);
  vmm_arena_stats bad;
  bad.struct_size = 3;
  EXPECT(vmm_arena_group_stats_get(g, 0, &bad), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_group_stats_get(g, N, NULL), VMM_ARENA_ERR_INVALID_ARGUMENT);

  size_t need = 0;
  OK(vmm_arena_group_snapshot_json(g, NULL, 0, &need));
  CHECK(need > 10);
  char *buf = malloc(need);
  OK(vmm_arena_group_snapshot_json(g, buf, need, &need));
  CHECK(strlen(buf) + 1 == need);
  CHECK(strstr(buf, "\"members\":[{") != NULL && strstr(buf, "\"allocations\":[{\"id\":") != NULL);
  free(buf);

  OK(vmm_arena_group_free(g, id));
  EXPECT(vmm_arena_group_free(g, id), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
  for (uint32_t m = 0; m < N; m++)
    CHECK(member_stats(g, m).live_allocations == 0);
  vmm_arena_group_destroy(g);
  vmm_arena_group_destroy(NULL);
}

/* ------------------------------------------------------------------ faults */

typedef vmm_arena_status (*group_op)(vmm_arena_group *g, vmm_arena_group_id *ids);

static vmm_arena_status op_alloc(vmm_arena_group *g, vmm_arena_group_id *ids) {
  uint64_t p[N];
  return vmm_arena_group_alloc(g, 3 * K - 10, &ids[2], p, N);
}
static vmm_arena_status op_alloc_growable(vmm_arena_group *g, vmm_arena_group_id *ids) {
  uint64_t p[N];
  return vmm_arena_group_alloc_growable(g, 2 * K, 6 * K, &ids[2], p, N);
}
static vmm_arena_status op_grow_in_place(vmm_arena_group *g, vmm_arena_group_id *ids) {
  uint64_t p[N];
  return vmm_arena_group_resize(g, ids[0], 4 * K, p, N);
}
static vmm_arena_status op_grow_past_reservation(vmm_arena_group *g, vmm_arena_group_id *ids) {
  uint64_t p[N];
  return vmm_arena_group_resize(g, ids[1], 3 * K, p, N);
}

/* Two group allocations: a growable one (room to 6 chunks), then a plain
 * one of one chunk right after it; each member's shards stamped. */
static vmm_arena_group *build(vmm_arena_group_id *ids) {
  vmm_arena_config c = host_config(8);
  vmm_arena_group *g = NULL;
  OK(vmm_arena_testing_group_create_faulty(&c, N, &g));
  uint64_t p[N];
  OK(vmm_arena_group_alloc_growable(g, K, 6 * K, &ids[0], p, N));
  for (uint32_t m = 0; m < N; m++)
    memset((void *)(uintptr_t)p[m], 0x10 + (int)m, K);
  OK(vmm_arena_group_alloc(g, K, &ids[1], p, N));
  for (uint32_t m = 0; m < N; m++)
    memset((void *)(uintptr_t)p[m], 0x20 + (int)m, K);
  ids[2] = 0;
  return g;
}

static void check_stamps(vmm_arena_group *g, const vmm_arena_group_id *ids) {
  for (int i = 0; i < 2; i++) {
    for (uint32_t m = 0; m < N; m++) {
      uint64_t ptr = 0, size = 0;
      OK(vmm_arena_group_query(g, ids[i], m, &ptr, &size, NULL));
      const uint8_t *b = (const uint8_t *)(uintptr_t)ptr;
      CHECK(b[0] == (uint8_t)(0x10 * (i + 1) + m) && b[K - 1] == (uint8_t)(0x10 * (i + 1) + m));
    }
  }
}

static void check_held(vmm_arena_group *g) {
  for (uint32_t m = 0; m < N; m++) {
    uint64_t calls, injected, chunks, mappings;
    OK(vmm_arena_testing_group_driver_state(g, m, &calls, &injected, &chunks, &mappings));
    vmm_arena_stats s = member_stats(g, m);
    CHECK(chunks * K == s.mapped_bytes + s.pooled_bytes);
    CHECK(mappings >= s.mapped_bytes / K);
  }
}

static unsigned long fault_matrix(const char *name, group_op op) {
  vmm_arena_group_id ids[3];
  vmm_arena_group *twin = build(ids);
  uint64_t calls[N], injected, chunks, mappings;
  for (uint32_t m = 0; m < N; m++)
    OK(vmm_arena_testing_group_driver_state(twin, m, &calls[m], &injected, &chunks, &mappings));
  OK(op(twin, ids));
  for (uint32_t m = 0; m < N; m++) {
    uint64_t after;
    OK(vmm_arena_testing_group_driver_state(twin, m, &after, &injected, &chunks, &mappings));
    calls[m] = after - calls[m];
    CHECK(calls[m] > 0);
  }
  vmm_arena_group_destroy(twin);

  unsigned long faults = 0;
  for (uint32_t m = 0; m < N; m++) {
    for (uint64_t i = 1; i <= calls[m]; i++) {
      for (uint32_t kind = 0; kind < 2; kind++) {
        vmm_arena_group *g = build(ids);
        vmm_arena_stats before[N];
        for (uint32_t k = 0; k < N; k++)
          before[k] = member_stats(g, k);
        OK(vmm_arena_testing_group_fail_nth(g, m, 0, i, kind));
        vmm_arena_status st = op(g, ids);
        EXPECT(st, kind == 0 ? VMM_ARENA_ERR_OUT_OF_MEMORY : VMM_ARENA_ERR_DRIVER);
        CHECK(vmm_arena_group_last_member() == (int32_t)m);
        CHECK(strstr(vmm_arena_last_error(), "group member") != NULL);
        uint64_t c0, inj, ch, mp;
        OK(vmm_arena_testing_group_driver_state(g, m, &c0, &inj, &ch, &mp));
        CHECK(inj == 1);
        for (uint32_t k = 0; k < N; k++) {
          vmm_arena_stats s = member_stats(g, k);
          CHECK(s.live_allocations == before[k].live_allocations);
          CHECK(s.live_bytes == before[k].live_bytes);
          CHECK(s.mapped_bytes == before[k].mapped_bytes);
        }
        check_stamps(g, ids);
        check_held(g);
        /* Still works: the operation now succeeds on every member. */
        OK(op(g, ids));
        check_stamps(g, ids);
        check_held(g);
        vmm_arena_group_destroy(g);
        faults++;
      }
    }
  }
  printf("  %-28s %3lu faults\n", name, faults);
  return faults;
}

/* ----------------------------------------------------------------- threads */

static vmm_arena_group *shared;

static uint64_t rng_next(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

static void *churn(void *arg) {
  uint64_t seed = (uint64_t)(uintptr_t)arg * 0x9E3779B97F4A7C15ull | 1;
  vmm_arena_group_id mine[4] = {0};
  for (int step = 0; step < 200; step++) {
    uint64_t r = rng_next(&seed);
    int slot = (int)(r % 4);
    uint64_t ptrs[N];
    if (mine[slot] == 0) {
      vmm_arena_status st = vmm_arena_group_alloc_growable(shared, (r >> 8) % (3 * K) + 1, 6 * K, &mine[slot], ptrs, N);
      CHECK(st == VMM_ARENA_OK || st == VMM_ARENA_ERR_OUT_OF_MEMORY);
      if (st != VMM_ARENA_OK)
        mine[slot] = 0;
    } else if (r % 3 == 0) {
      vmm_arena_status st = vmm_arena_group_resize(shared, mine[slot], (r >> 8) % (5 * K) + 1, ptrs, N);
      CHECK(st == VMM_ARENA_OK || st == VMM_ARENA_ERR_OUT_OF_MEMORY);
    } else {
      OK(vmm_arena_group_free(shared, mine[slot]));
      mine[slot] = 0;
    }
  }
  for (int i = 0; i < 4; i++)
    if (mine[i] != 0) {
      uint64_t s0 = 0, s = 0;
      OK(vmm_arena_group_query(shared, mine[i], 0, NULL, &s0, NULL));
      for (uint32_t m = 1; m < N; m++) {
        OK(vmm_arena_group_query(shared, mine[i], m, NULL, &s, NULL));
        CHECK(s == s0);
      }
      OK(vmm_arena_group_free(shared, mine[i]));
    }
  return NULL;
}

static void test_threads(void) {
  vmm_arena_config c = host_config(24);
  int32_t devices[N] = {4, 5, 6};
  OK(vmm_arena_group_create(&c, devices, N, 0, &shared));
  pthread_t t[4];
  for (uintptr_t i = 0; i < 4; i++)
    CHECK(pthread_create(&t[i], NULL, churn, (void *)(i + 1)) == 0);
  for (int i = 0; i < 4; i++)
    CHECK(pthread_join(t[i], NULL) == 0);
  for (uint32_t m = 0; m < N; m++) {
    vmm_arena_stats s = member_stats(shared, m);
    CHECK(s.live_allocations == 0 && s.mapped_bytes == 0);
  }
  vmm_arena_group_destroy(shared);
}

int main(void) {
  test_calls_and_arguments();
  unsigned long total = 0;
  total += fault_matrix("group alloc", op_alloc);
  total += fault_matrix("group alloc_growable", op_alloc_growable);
  total += fault_matrix("group resize in place", op_grow_in_place);
  total += fault_matrix("group resize past its room", op_grow_past_reservation);
  printf("C ABI group fault matrix size: %lu\n", total);
  test_threads();
  FINISH("test_group");
}
