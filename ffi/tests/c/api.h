/* Shared by the parts of test_api (test_api.c and api_*.c): the testing
 * hooks, the test arenas' set-up, byte patterns, and the tests' prototypes. */
#ifndef VMM_ARENA_TEST_API_H
#define VMM_ARENA_TEST_API_H

#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "vmm_arena.h"
#include "check.h"

/* Testing hooks of libvmm_arena (not part of the ABI; see ffi/src/testing.rs). */
vmm_arena_status vmm_arena_testing_create_faulty(const vmm_arena_config *config, vmm_arena **out);
vmm_arena_status vmm_arena_testing_fail_nth(vmm_arena *arena, uint32_t call_kind, uint64_t n, uint32_t fault);
vmm_arena_status vmm_arena_testing_driver_objects(vmm_arena *arena, uint64_t *chunks, uint64_t *mappings);
vmm_arena_status vmm_arena_testing_panic(vmm_arena *arena);
vmm_arena_status vmm_arena_testing_driver_calls(vmm_arena *arena, uint64_t *calls, uint64_t *injected);
enum { CALL_ANY = 0, CALL_CREATE = 3, CALL_MAP = 5, CALL_UNMAP = 7, CALL_EVENT = 10, CALL_HOST_ALLOC = 11 };
enum { FAULT_OOM = 0, FAULT_DRIVER = 1 };

#define K ((uint64_t)64 << 10) /* the chunk size of the test arenas */

static inline vmm_arena_config host_config(uint64_t cap_chunks, uint64_t reserve_chunks, uint32_t flags) {
  vmm_arena_config c;
  vmm_arena_config_default(&c);
  c.backend = VMM_ARENA_BACKEND_HOST;
  c.chunk_bytes = K;
  c.capacity_bytes = cap_chunks * K;
  c.reserve_bytes = reserve_chunks * K;
  c.flags = flags;
  return c;
}

static inline vmm_arena *make(uint64_t cap_chunks, uint64_t reserve_chunks, uint32_t flags) {
  vmm_arena_config c = host_config(cap_chunks, reserve_chunks, flags);
  vmm_arena *a = NULL;
  OK(vmm_arena_create(&c, &a));
  CHECK(a != NULL);
  return a;
}

static inline uint8_t pattern(uint32_t seed, uint64_t i) {
  return (uint8_t)(seed * 131u + i * 7u + (i >> 9) + 1u);
}

static inline void fill(uint64_t ptr, uint64_t len, uint32_t seed) {
  uint8_t *p = (uint8_t *)(uintptr_t)ptr;
  for (uint64_t i = 0; i < len; i++) p[i] = pattern(seed, i);
}

static inline int intact(uint64_t ptr, uint64_t len, uint32_t seed) {
  const uint8_t *p = (const uint8_t *)(uintptr_t)ptr;
  for (uint64_t i = 0; i < len; i++)
    if (p[i] != pattern(seed, i)) return 0;
  return 1;
}

static inline vmm_arena_stats stats_of(vmm_arena *a) {
  vmm_arena_stats s;
  memset(&s, 0, sizeof s);
  s.struct_size = sizeof s;
  OK(vmm_arena_stats_get(a, &s));
  return s;
}

static inline uint64_t ptr_of(vmm_arena *a, vmm_arena_id id) {
  uint64_t p = 0;
  OK(vmm_arena_query(a, id, &p, NULL));
  return p;
}

/* Records every move the arena reports. */
typedef struct {
  int count;
  vmm_arena_id id[256];
  uint64_t old_ptr[256], new_ptr[256], size[256];
} moves_t;

static inline void record_move(void *user, vmm_arena_id id, uint64_t old_ptr, uint64_t new_ptr, uint64_t size) {
  moves_t *m = (moves_t *)user;
  if (m->count < 256) {
    m->id[m->count] = id;
    m->old_ptr[m->count] = old_ptr;
    m->new_ptr[m->count] = new_ptr;
    m->size[m->count] = size;
  }
  m->count++;
}

/* The tests, one function each (api_*.c). */
void test_meta(void);
void test_config_and_create(void);
void test_bad_arguments(void);
void test_resize_keeps_contents(void);
void test_compaction_keeps_contents(void);
void test_implicit_moves_and_address_space(void);
void test_small_allocations(void);
void test_pin(void);
void test_sleep_wake(void);
void test_alloc_shared(void);
void test_stats_and_trim(void);
void test_snapshot(void);
void test_callbacks(void);
void test_poison(void);
void test_driver_failures(void);
void test_stream_free_and_prefetch(void);
void test_resize_on_stream(void);
void test_quiesce_on_stream(void);

#endif
