/*
 * One arena used from many threads at once (pthreads), under
 * -fsanitize=address,undefined: allocations that grow, move (implicitly,
 * by resize and by compaction) and die concurrently keep their contents;
 * the move callback sees every move; each thread's last error is its own.
 *
 * A thread touches its allocation's memory only while the allocation is
 * pinned: unpinned, another thread's alloc or compact may move it and
 * release its old range.
 */
#define _GNU_SOURCE
#include <inttypes.h>
#include <sched.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vmm_arena.h"
#include "check.h"

#define K ((uint64_t)64 << 10)
#define THREADS 8
#define ITERATIONS 150

static vmm_arena *arena;
static atomic_ulong callback_moves;
static atomic_ulong failures_oom, failures_ooas;

static void count_move(void *user, vmm_arena_id id, uint64_t old_ptr, uint64_t new_ptr, uint64_t size) {
  (void)id;
  (void)size;
  CHECK(old_ptr != new_ptr);
  atomic_fetch_add((atomic_ulong *)user, 1);
}

static uint8_t pattern(uint32_t seed, uint64_t i) {
  return (uint8_t)(seed * 131u + i * 7u + (i >> 9) + 1u);
}

static uint64_t rng_next(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

/* Pins, finds, and checks (or writes) the first `len` bytes of `id`. */
static void touch(vmm_arena_id id, uint64_t len, uint32_t seed, int write) {
  uint64_t ptr = 0, size = 0;
  OK(vmm_arena_pin(arena, id));
  OK(vmm_arena_query(arena, id, &ptr, &size));
  CHECK(size >= len);
  uint8_t *p = (uint8_t *)(uintptr_t)ptr;
  for (uint64_t i = 0; i < len; i += 97) {
    if (write)
      p[i] = pattern(seed, i);
    else
      CHECK(p[i] == pattern(seed, i));
  }
  OK(vmm_arena_unpin(arena, id));
}

static int acceptable(vmm_arena_status s) {
  if (s == VMM_ARENA_ERR_OUT_OF_MEMORY) {
    atomic_fetch_add(&failures_oom, 1);
    return 1;
  }
  if (s == VMM_ARENA_ERR_OUT_OF_ADDRESS_SPACE) {
    atomic_fetch_add(&failures_ooas, 1);
    return 1;
  }
  return 0;
}

static void *worker(void *arg) {
  uint32_t t = (uint32_t)(uintptr_t)arg;
  uint64_t rng = 0x9E3779B97F4A7C15ull * (t + 1);

  /* This thread's last error is its own, whatever the others do. */
  vmm_arena_id mine = 0xDEAD0000ull + t;
  EXPECT(vmm_arena_free(arena, mine), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
  char want[64];
  snprintf(want, sizeof want, "%#" PRIx64, mine);
  CHECK(strstr(vmm_arena_last_error(), want) != NULL);

  /* Each thread keeps up to two allocations alive; the oldest dies. */
  vmm_arena_id live_id[2] = {0, 0};
  uint64_t live_len[2] = {0, 0};
  uint32_t live_seed[2] = {0, 0};
  for (uint32_t it = 0; it < ITERATIONS; it++) {
    uint32_t slot = it % 2;
    if (live_id[slot] != 0) {
      touch(live_id[slot], live_len[slot], live_seed[slot], 0);
#ifdef VMM_ARENA_FLAG_BACKGROUND
      if (it % 3 == 0)
        OK(vmm_arena_free_on_stream(arena, live_id[slot], 0));
      else
#endif
        OK(vmm_arena_free(arena, live_id[slot]));
      EXPECT(vmm_arena_query(arena, live_id[slot], NULL, NULL), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
      live_id[slot] = 0;
    }
    uint32_t seed = t * 100000 + it;
    uint64_t size = (rng_next(&rng) % 3 + 1) * K - rng_next(&rng) % 1000;
    vmm_arena_id id;
    uint64_t ptr;
    vmm_arena_status s = (it % 4 < 2) ? vmm_arena_alloc(arena, size, &id, &ptr)
                                      : vmm_arena_alloc_growable(arena, size, 4 * K, &id, &ptr);
    if (s != VMM_ARENA_OK) {
      CHECK(acceptable(s));
      continue;
    }
    CHECK(ptr % 256 == 0);
    touch(id, size, seed, 1);
    /* Grow: in place within a growable's reservation, else by a move. */
    uint64_t bigger = size + (rng_next(&rng) % 4) * K + 1;
    s = vmm_arena_resize(arena, id, bigger, &ptr);
    if (s == VMM_ARENA_OK)
      touch(id, size, seed, 0);
    else
      CHECK(acceptable(s));
    if (it % 16 == t % 16) {
      vmm_arena_compact_report r;
      OK(vmm_arena_compact(arena, &r));
    }
    if (it % 10 == 0) {
      vmm_arena_stats st;
      memset(&st, 0, sizeof st);
      st.struct_size = sizeof st;
      OK(vmm_arena_stats_get(arena, &st));
      CHECK(st.live_allocations >= 1);
      size_t len = 0;
      OK(vmm_arena_snapshot_json(arena, NULL, 0, &len));
      CHECK(len > 2);
    }
    touch(id, size, seed, 0);
    live_id[slot] = id;
    live_len[slot] = size;
    live_seed[slot] = seed;
  }
  for (int slot = 0; slot < 2; slot++)
    if (live_id[slot] != 0) {
      touch(live_id[slot], live_len[slot], live_seed[slot], 0);
      OK(vmm_arena_free(arena, live_id[slot]));
    }
  /* Still this thread's own error text. */
  CHECK(strstr(vmm_arena_last_error(), "unknown allocation") != NULL ||
        strstr(vmm_arena_last_error(), "out of") != NULL);
  return NULL;
}

#ifdef VMM_ARENA_FLAG_BACKGROUND
static atomic_int workers_done;

/* Prefetches between the workers' calls, as an engine's loop would. */
static void *maintainer(void *arg) {
  (void)arg;
  while (!atomic_load(&workers_done)) {
    OK(vmm_arena_maintain(arena));
    sched_yield(); /* between steps: the workers get the lock (Valgrind runs one thread at a time) */
  }
  return NULL;
}
#endif

/* Runs the workers on a fresh arena; `flags` and `prefetch` (bytes, both
 * targets) say how it prefetches, `maintain` whether a thread maintains. */
static void run(uint32_t flags, uint64_t prefetch, int maintain) {
  vmm_arena_config c;
  vmm_arena_config_default(&c);
  c.backend = VMM_ARENA_BACKEND_HOST;
  c.chunk_bytes = K;
  c.capacity_bytes = 64 * K;
  c.reserve_bytes = 72 * K; /* tight: implicit moves happen */
  c.retain_bytes = 16 * K;
  c.flags = flags;
  OK(vmm_arena_create(&c, &arena));
  OK(vmm_arena_set_move_callback(arena, count_move, &callback_moves));
  atomic_store(&callback_moves, 0);
#ifdef VMM_ARENA_FLAG_BACKGROUND
  OK(vmm_arena_set_prefetch(arena, prefetch, prefetch));
  atomic_store(&workers_done, 0);
  pthread_t m;
  if (maintain) CHECK(pthread_create(&m, NULL, maintainer, NULL) == 0);
#else
  (void)prefetch;
  (void)maintain;
#endif

  pthread_t th[THREADS];
  for (uintptr_t t = 0; t < THREADS; t++) CHECK(pthread_create(&th[t], NULL, worker, (void *)t) == 0);
  for (int t = 0; t < THREADS; t++) CHECK(pthread_join(th[t], NULL) == 0);
#ifdef VMM_ARENA_FLAG_BACKGROUND
  atomic_store(&workers_done, 1);
  if (maintain) CHECK(pthread_join(m, NULL) == 0);
#endif

  vmm_arena_stats st;
  memset(&st, 0, sizeof st);
  st.struct_size = sizeof st;
  OK(vmm_arena_stats_get(arena, &st));
  CHECK(st.live_allocations == 0 && st.live_bytes == 0 && st.mapped_bytes == 0);
  CHECK(st.moves == atomic_load(&callback_moves));
  CHECK(st.moves > 0);
  /* The retain watermark holds after every operation and every maintain,
   * however the threads interleaved (a maintain round whose allocation was
   * freed meanwhile once left the pool above it: tests/prefetch.rs). */
  CHECK(st.pooled_bytes <= 16 * K);
  printf("test_threads: flags %u, prefetch %" PRIu64 ", maintainer %d: %d threads x %d iterations, %" PRIu64
         " moves, %lu out-of-memory, %lu out-of-address-space\n",
         flags, prefetch, maintain, THREADS, ITERATIONS, st.moves, (unsigned long)atomic_load(&failures_oom),
         (unsigned long)atomic_load(&failures_ooas));
  vmm_arena_destroy(arena);
}

int main(void) {
  setvbuf(stdout, NULL, _IONBF, 0);
  run(0, 0, 0);
#ifdef VMM_ARENA_FLAG_BACKGROUND
  run(0, 4 * K, 1);                         /* maintain on a thread of the caller's */
#ifndef VMM_ARENA_CALLS_SERIALIZED /* scripts/tsan.sh: see there */
  run(VMM_ARENA_FLAG_BACKGROUND, 4 * K, 0); /* the arena's own background thread */
#endif
#endif
  FINISH("test_threads");
}
