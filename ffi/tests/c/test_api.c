/*
 * Every function and every status of the vmm_arena C ABI, on the host
 * backend, with every bad input we could think of.
 *
 * Written against the contract's names only (plus the library's testing
 * hooks, declared below), so it compiles against the contract header
 * abi/vmm_arena.h as well as against ffi/include/vmm_arena.h; the test
 * suite builds it both ways, with -fsanitize=address,undefined.
 */
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

static vmm_arena_config host_config(uint64_t cap_chunks, uint64_t reserve_chunks, uint32_t flags) {
  vmm_arena_config c;
  vmm_arena_config_default(&c);
  c.backend = VMM_ARENA_BACKEND_HOST;
  c.chunk_bytes = K;
  c.capacity_bytes = cap_chunks * K;
  c.reserve_bytes = reserve_chunks * K;
  c.flags = flags;
  return c;
}

static vmm_arena *make(uint64_t cap_chunks, uint64_t reserve_chunks, uint32_t flags) {
  vmm_arena_config c = host_config(cap_chunks, reserve_chunks, flags);
  vmm_arena *a = NULL;
  OK(vmm_arena_create(&c, &a));
  CHECK(a != NULL);
  return a;
}

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

static vmm_arena_stats stats_of(vmm_arena *a) {
  vmm_arena_stats s;
  memset(&s, 0, sizeof s);
  s.struct_size = sizeof s;
  OK(vmm_arena_stats_get(a, &s));
  return s;
}

static uint64_t ptr_of(vmm_arena *a, vmm_arena_id id) {
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

static void record_move(void *user, vmm_arena_id id, uint64_t old_ptr, uint64_t new_ptr, uint64_t size) {
  moves_t *m = (moves_t *)user;
  if (m->count < 256) {
    m->id[m->count] = id;
    m->old_ptr[m->count] = old_ptr;
    m->new_ptr[m->count] = new_ptr;
    m->size[m->count] = size;
  }
  m->count++;
}

static void test_meta(void) {
  static const char *const names[] = {
      "VMM_ARENA_OK",
      "VMM_ARENA_ERR_INVALID_ARGUMENT",
      "VMM_ARENA_ERR_OUT_OF_MEMORY",
      "VMM_ARENA_ERR_OUT_OF_ADDRESS_SPACE",
      "VMM_ARENA_ERR_UNKNOWN_ALLOCATION",
      "VMM_ARENA_ERR_PINNED",
      "VMM_ARENA_ERR_UNSUPPORTED",
      "VMM_ARENA_ERR_DRIVER",
      "VMM_ARENA_ERR_INTERNAL",
  };
  CHECK(vmm_arena_last_error() != NULL);
  CHECK(strcmp(vmm_arena_last_error(), "") == 0); /* nothing failed yet */
  CHECK(VMM_ARENA_ABI_VERSION == 1);
  CHECK(vmm_arena_abi_version() == VMM_ARENA_ABI_VERSION);
  for (unsigned i = 0; i < 9; i++) {
    const char *n = vmm_arena_status_name((vmm_arena_status)i);
    CHECK(n != NULL && strcmp(n, names[i]) == 0);
  }
  CHECK(VMM_ARENA_OK == 0 && VMM_ARENA_ERR_INVALID_ARGUMENT == 1 && VMM_ARENA_ERR_OUT_OF_MEMORY == 2 &&
        VMM_ARENA_ERR_OUT_OF_ADDRESS_SPACE == 3 && VMM_ARENA_ERR_UNKNOWN_ALLOCATION == 4 &&
        VMM_ARENA_ERR_PINNED == 5 && VMM_ARENA_ERR_UNSUPPORTED == 6 && VMM_ARENA_ERR_DRIVER == 7 &&
        VMM_ARENA_ERR_INTERNAL == 8);
  /* Static strings: the same pointer every time. */
  CHECK(vmm_arena_status_name(VMM_ARENA_ERR_PINNED) == vmm_arena_status_name(VMM_ARENA_ERR_PINNED));
  /* 9 is VMM_ARENA_ERR_ASLEEP since sleep and wake (the next contract). */
  CHECK(strcmp(vmm_arena_status_name((vmm_arena_status)9), "VMM_ARENA_ERR_ASLEEP") == 0);
  CHECK(strcmp(vmm_arena_status_name((vmm_arena_status)10), "UNKNOWN") == 0);
  CHECK(strcmp(vmm_arena_status_name((vmm_arena_status)1000), "UNKNOWN") == 0);
  CHECK(strcmp(vmm_arena_status_name((vmm_arena_status)0xFFFFFFFFu), "UNKNOWN") == 0);
  CHECK(VMM_ARENA_BACKEND_HOST == 0 && VMM_ARENA_BACKEND_CUDA == 1);
  CHECK(VMM_ARENA_FLAG_NO_IMPLICIT_MOVES == 1u);
  CHECK(sizeof(vmm_arena_id) == 8);
  CHECK(strcmp(vmm_arena_last_error(), "") == 0); /* none of these failed */
}

static void test_config_and_create(void) {
  vmm_arena_config c;
  memset(&c, 0x5A, sizeof c);
  vmm_arena_config_default(&c);
  CHECK(c.struct_size == sizeof(vmm_arena_config));
  CHECK(c.backend == VMM_ARENA_BACKEND_CUDA);
  CHECK(c.device == 0 && c.flags == 0);
  CHECK(c.capacity_bytes == 0 && c.reserve_bytes == 0 && c.chunk_bytes == 0);
  CHECK(c.retain_bytes == UINT64_MAX);
  vmm_arena_config_default(NULL); /* ignored */

  vmm_arena *const sentinel = (vmm_arena *)(uintptr_t)0x1230;
  vmm_arena *a = sentinel;
  vmm_arena_config h = host_config(4, 16, 0);

  EXPECT(vmm_arena_create(NULL, &a), VMM_ARENA_ERR_INVALID_ARGUMENT);
  CHECK(a == sentinel);
  CHECK(strlen(vmm_arena_last_error()) > 0);
  EXPECT(vmm_arena_create(&h, NULL), VMM_ARENA_ERR_INVALID_ARGUMENT);

  /* struct_size: anything but this version's size. */
  const uint32_t bad_sizes[] = {0, 4, 8, sizeof(vmm_arena_config) - 8, sizeof(vmm_arena_config) + 8, 0xFFFFFFFFu};
  for (size_t i = 0; i < sizeof bad_sizes / sizeof bad_sizes[0]; i++) {
    vmm_arena_config b = h;
    b.struct_size = bad_sizes[i];
    EXPECT(vmm_arena_create(&b, &a), VMM_ARENA_ERR_INVALID_ARGUMENT);
    CHECK(a == sentinel);
    CHECK(strstr(vmm_arena_last_error(), "struct_size") != NULL);
  }
  /* A short struct at the very end of a readable page: reading past its
   * struct_size would fault. */
  long page = sysconf(_SC_PAGESIZE);
  uint8_t *m = (uint8_t *)mmap(NULL, 2 * (size_t)page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CHECK(m != MAP_FAILED);
  CHECK(mprotect(m + page, (size_t)page, PROT_NONE) == 0);
  for (uint32_t sz = 4; sz <= 8; sz += 4) {
    uint8_t *edge = m + page - 8;
    memset(edge, 0, 8);
    memcpy(edge, &sz, sizeof sz);
    EXPECT(vmm_arena_create((const vmm_arena_config *)(void *)edge, &a), VMM_ARENA_ERR_INVALID_ARGUMENT);
    CHECK(a == sentinel);
  }
  CHECK(munmap(m, 2 * (size_t)page) == 0);

  /* Enum values arrive as plain integers. */
  const uint32_t bad_backends[] = {2, 3, 1000, 0x80000000u, 0xFFFFFFFFu};
  for (size_t i = 0; i < sizeof bad_backends / sizeof bad_backends[0]; i++) {
    vmm_arena_config b = h;
    b.backend = bad_backends[i];
    EXPECT(vmm_arena_create(&b, &a), VMM_ARENA_ERR_INVALID_ARGUMENT);
    CHECK(a == sentinel);
  }
  /* 1, 2 and 8 are known (2: VMM_ARENA_FLAG_BACKGROUND, the next contract's;
     8: VMM_ARENA_FLAG_EXPORTABLE, the project's own). */
  const uint32_t bad_flags[] = {4, 16, 5, 12, 0x80000000u, 0xFFFFFFFFu};
  for (size_t i = 0; i < sizeof bad_flags / sizeof bad_flags[0]; i++) {
    vmm_arena_config b = h;
    b.flags = bad_flags[i];
    EXPECT(vmm_arena_create(&b, &a), VMM_ARENA_ERR_INVALID_ARGUMENT);
    CHECK(a == sentinel);
    CHECK(strstr(vmm_arena_last_error(), "flags") != NULL);
  }
  /* Chunk sizes that are not a multiple of the page size. */
  const uint64_t bad_chunks[] = {1, 1000, 4097, (uint64_t)page + 1, K + 8};
  for (size_t i = 0; i < sizeof bad_chunks / sizeof bad_chunks[0]; i++) {
    vmm_arena_config b = h;
    b.chunk_bytes = bad_chunks[i];
    EXPECT(vmm_arena_create(&b, &a), VMM_ARENA_ERR_INVALID_ARGUMENT);
    CHECK(a == sentinel);
  }
  {
    vmm_arena_config b = h;
    b.capacity_bytes = K - 1; /* below one chunk */
    EXPECT(vmm_arena_create(&b, &a), VMM_ARENA_ERR_INVALID_ARGUMENT);
    b = h;
    b.reserve_bytes = UINT64_MAX; /* overflows when rounded up */
    EXPECT(vmm_arena_create(&b, &a), VMM_ARENA_ERR_INVALID_ARGUMENT);
    b = h;
    b.chunk_bytes = 0; /* 2 MiB, above the 4-chunk capacity of 256 KiB */
    EXPECT(vmm_arena_create(&b, &a), VMM_ARENA_ERR_INVALID_ARGUMENT);
    CHECK(a == sentinel);
    /* No address space this large exists: out of memory, nothing created. */
    b = h;
    b.capacity_bytes = (uint64_t)1 << 62;
    b.reserve_bytes = (uint64_t)1 << 62;
    EXPECT(vmm_arena_create(&b, &a), VMM_ARENA_ERR_OUT_OF_MEMORY);
    CHECK(a == sentinel);
  }

  /* The CUDA backend: unsupported without a driver, fine with one. */
  {
    vmm_arena_config b;
    vmm_arena_config_default(&b);
    b.capacity_bytes = 64ull << 20;
    vmm_arena_status s = vmm_arena_create(&b, &a);
    CHECK(s == VMM_ARENA_OK || s == VMM_ARENA_ERR_UNSUPPORTED);
    if (s == VMM_ARENA_OK) {
      vmm_arena_id id;
      uint64_t p;
      OK(vmm_arena_alloc(a, 1, &id, &p));
      CHECK(p % 256 == 0);
      OK(vmm_arena_free(a, id));
      vmm_arena_destroy(a);
      printf("  (a CUDA device is present: the CUDA backend was exercised)\n");
    } else {
      CHECK(a == sentinel);
      CHECK(strlen(vmm_arena_last_error()) > 0);
    }
    a = sentinel;
    const int32_t bad_devices[] = {-1, 1000};
    for (size_t i = 0; i < 2; i++) {
      b.device = bad_devices[i];
      EXPECT(vmm_arena_create(&b, &a), VMM_ARENA_ERR_UNSUPPORTED);
      CHECK(a == sentinel);
    }
    /* Arguments are checked before the backend is loaded: an invalid config
     * is INVALID_ARGUMENT with or without a CUDA driver (issue 13). */
    b.device = 0;
    const uint64_t cuda_bad_chunks[] = {(3ull << 20) + 5, 1, 4097, (2ull << 20) + 512};
    for (size_t i = 0; i < sizeof cuda_bad_chunks / sizeof cuda_bad_chunks[0]; i++) {
      vmm_arena_config c = b;
      c.chunk_bytes = cuda_bad_chunks[i];
      EXPECT(vmm_arena_create(&c, &a), VMM_ARENA_ERR_INVALID_ARGUMENT);
      CHECK(a == sentinel);
      CHECK(strstr(vmm_arena_last_error(), "chunk_bytes") != NULL);
    }
    vmm_arena_config c = b;
    c.reserve_bytes = UINT64_MAX; /* overflows when rounded up to any chunk */
    EXPECT(vmm_arena_create(&c, &a), VMM_ARENA_ERR_INVALID_ARGUMENT);
    c = b;
    c.chunk_bytes = 2ull << 20;
    c.capacity_bytes = 1ull << 20; /* below one chunk */
    EXPECT(vmm_arena_create(&c, &a), VMM_ARENA_ERR_INVALID_ARGUMENT);
    c = b;
    c.capacity_bytes = 1ull << 20; /* below the smallest default chunk, 2 MiB */
    EXPECT(vmm_arena_create(&c, &a), VMM_ARENA_ERR_INVALID_ARGUMENT);
    CHECK(a == sentinel);
  }

  /* A success leaves the last error as it was: same text, same pointer. */
  {
    vmm_arena_config b = h;
    b.flags = 4;
    EXPECT(vmm_arena_create(&b, &a), VMM_ARENA_ERR_INVALID_ARGUMENT);
    const char *before = vmm_arena_last_error();
    char copy[512];
    snprintf(copy, sizeof copy, "%s", before);
    CHECK(strlen(copy) > 0);
    OK(vmm_arena_create(&h, &a));
    CHECK(a != sentinel && a != NULL);
    vmm_arena_id id;
    uint64_t p;
    OK(vmm_arena_alloc(a, 1, &id, &p));
    CHECK(vmm_arena_last_error() == before);
    CHECK(strcmp(vmm_arena_last_error(), copy) == 0);
    vmm_arena_destroy(a); /* with a live allocation: destroy releases it */
    CHECK(strcmp(vmm_arena_last_error(), copy) == 0);
  }

  /* Defaults: chunk 2 MiB, addresses chunk-aligned. */
  {
    vmm_arena_config b = h;
    b.chunk_bytes = 0;
    b.capacity_bytes = 8ull << 20;
    b.reserve_bytes = 0;
    OK(vmm_arena_create(&b, &a));
    vmm_arena_stats s = stats_of(a);
    CHECK(s.capacity_bytes == (8ull << 20));
    CHECK(s.reserved_va_bytes >= s.capacity_bytes);
    vmm_arena_id id;
    uint64_t p;
    OK(vmm_arena_alloc(a, 3ull << 20, &id, &p));
    CHECK(p % (2ull << 20) == 0);
    vmm_arena_destroy(a);
  }
  /* A capacity that is not a multiple of the chunk is rounded down. */
  {
    vmm_arena_config b = h;
    b.capacity_bytes = 3 * K + 5;
    b.reserve_bytes = 5 * K - 3; /* rounded up */
    OK(vmm_arena_create(&b, &a));
    vmm_arena_stats s = stats_of(a);
    CHECK(s.capacity_bytes == 3 * K);
    CHECK(s.reserved_va_bytes == 5 * K);
    vmm_arena_destroy(a);
  }
  vmm_arena_destroy(NULL);
}

static void test_bad_arguments(void) {
  vmm_arena *a = make(16, 64, 0);
  const vmm_arena_id ID0 = 0x5555;
  const uint64_t P0 = 0x6666;
  vmm_arena_id id = ID0;
  uint64_t ptr = P0, size = P0;
  size_t len = 77;
  vmm_arena_stats st;
  memset(&st, 0, sizeof st);
  st.struct_size = sizeof st;
  vmm_arena_compact_report rep;
  char buf[16];

  /* A NULL arena, for every function that takes one. */
  const vmm_arena_status INV = VMM_ARENA_ERR_INVALID_ARGUMENT;
  EXPECT(vmm_arena_alloc(NULL, K, &id, &ptr), INV);
  EXPECT(vmm_arena_alloc_growable(NULL, K, 2 * K, &id, &ptr), INV);
  EXPECT(vmm_arena_free(NULL, 1), INV);
  EXPECT(vmm_arena_resize(NULL, 1, K, &ptr), INV);
  EXPECT(vmm_arena_query(NULL, 1, &ptr, &size), INV);
  EXPECT(vmm_arena_pin(NULL, 1), INV);
  EXPECT(vmm_arena_unpin(NULL, 1), INV);
  EXPECT(vmm_arena_compact(NULL, &rep), INV);
  EXPECT(vmm_arena_release_retired(NULL), INV);
  EXPECT(vmm_arena_trim(NULL, 0, &size), INV);
  EXPECT(vmm_arena_stats_get(NULL, &st), INV);
  EXPECT(vmm_arena_set_move_callback(NULL, record_move, NULL), INV);
  EXPECT(vmm_arena_snapshot_json(NULL, buf, sizeof buf, &len), INV);
  CHECK(strstr(vmm_arena_last_error(), "arena is NULL") != NULL);
  CHECK(id == ID0 && ptr == P0 && size == P0 && len == 77);

  /* NULL required out-parameters. */
  EXPECT(vmm_arena_alloc(a, K, NULL, &ptr), INV);
  EXPECT(vmm_arena_alloc(a, K, &id, NULL), INV);
  EXPECT(vmm_arena_alloc(a, K, NULL, NULL), INV);
  EXPECT(vmm_arena_alloc_growable(a, K, 2 * K, NULL, &ptr), INV);
  EXPECT(vmm_arena_alloc_growable(a, K, 2 * K, &id, NULL), INV);
  EXPECT(vmm_arena_stats_get(a, NULL), INV);
  EXPECT(vmm_arena_snapshot_json(a, buf, sizeof buf, NULL), INV);
  CHECK(id == ID0 && ptr == P0);
  CHECK(stats_of(a).live_allocations == 0); /* none of them allocated */

  /* Zero and overflowing sizes; max_size < size. */
  EXPECT(vmm_arena_alloc(a, 0, &id, &ptr), INV);
  EXPECT(vmm_arena_alloc(a, UINT64_MAX, &id, &ptr), INV);
  EXPECT(vmm_arena_alloc(a, UINT64_MAX - K + 2, &id, &ptr), INV); /* overflows when rounded up */
  EXPECT(vmm_arena_alloc(a, UINT64_MAX - K + 1, &id, &ptr), VMM_ARENA_ERR_OUT_OF_MEMORY); /* just does not */
  EXPECT(vmm_arena_alloc_growable(a, 0, K, &id, &ptr), INV);
  EXPECT(vmm_arena_alloc_growable(a, 0, 0, &id, &ptr), INV);
  EXPECT(vmm_arena_alloc_growable(a, K, 0, &id, &ptr), INV);
  EXPECT(vmm_arena_alloc_growable(a, 2 * K, K, &id, &ptr), INV);
  EXPECT(vmm_arena_alloc_growable(a, K + 1, K, &id, &ptr), INV);
  EXPECT(vmm_arena_alloc_growable(a, K, UINT64_MAX, &id, &ptr), INV);
  EXPECT(vmm_arena_alloc_growable(a, UINT64_MAX, UINT64_MAX, &id, &ptr), INV);
  CHECK(id == ID0 && ptr == P0);

  /* Out of memory: more than the capacity, in one or in several. */
  EXPECT(vmm_arena_alloc(a, 17 * K, &id, &ptr), VMM_ARENA_ERR_OUT_OF_MEMORY);
  EXPECT(vmm_arena_alloc_growable(a, 17 * K, 20 * K, &id, &ptr), VMM_ARENA_ERR_OUT_OF_MEMORY);
  CHECK(id == ID0 && ptr == P0);
  vmm_arena_id big;
  OK(vmm_arena_alloc(a, 16 * K, &big, &ptr));
  EXPECT(vmm_arena_alloc(a, 1, &id, &ptr), VMM_ARENA_ERR_OUT_OF_MEMORY);
  OK(vmm_arena_free(a, big));
  CHECK(stats_of(a).live_allocations == 0);

  /* Made-up, stale and freed ids. */
  vmm_arena_id v;
  OK(vmm_arena_alloc(a, K, &v, &ptr));
  const vmm_arena_id made_up[] = {0, 12345, UINT64_MAX, v + (1ull << 32), 1ull << 32, v + 1, v ^ 0xFFFF0000ull};
  for (size_t i = 0; i < sizeof made_up / sizeof made_up[0]; i++) {
    vmm_arena_id x = made_up[i];
    uint64_t p2 = P0, s2 = P0;
    EXPECT(vmm_arena_free(a, x), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
    EXPECT(vmm_arena_resize(a, x, K, &p2), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
    EXPECT(vmm_arena_query(a, x, &p2, &s2), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
    EXPECT(vmm_arena_query(a, x, NULL, NULL), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
    EXPECT(vmm_arena_pin(a, x), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
    EXPECT(vmm_arena_unpin(a, x), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
    CHECK(p2 == P0 && s2 == P0);
  }
  OK(vmm_arena_free(a, v)); /* v was alive until here */
  EXPECT(vmm_arena_free(a, 0), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
  CHECK(strstr(vmm_arena_last_error(), "vmm_arena_free") != NULL);
  CHECK(strstr(vmm_arena_last_error(), "0x0") != NULL); /* the id as the caller spelled it */
  EXPECT(vmm_arena_free(a, v), VMM_ARENA_ERR_UNKNOWN_ALLOCATION); /* double free */
  EXPECT(vmm_arena_query(a, v, &ptr, NULL), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
  EXPECT(vmm_arena_resize(a, v, 2 * K, &ptr), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
  EXPECT(vmm_arena_pin(a, v), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
  EXPECT(vmm_arena_unpin(a, v), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
  vmm_arena_id v2;
  OK(vmm_arena_alloc(a, K, &v2, &ptr));
  CHECK(v2 != v && v2 != 0); /* ids are never reused */
  EXPECT(vmm_arena_query(a, v, NULL, NULL), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
  OK(vmm_arena_query(a, v2, NULL, NULL));
  OK(vmm_arena_free(a, v2));

  /* Precedence: INVALID_ARGUMENT, UNKNOWN_ALLOCATION, PINNED, OUT_OF_MEMORY,
   * OUT_OF_ADDRESS_SPACE. */
  EXPECT(vmm_arena_resize(a, v, 0, &ptr), INV);           /* stale id, size 0 */
  EXPECT(vmm_arena_resize(a, 0, 0, &ptr), INV);           /* id 0, size 0 */
  EXPECT(vmm_arena_resize(a, v, UINT64_MAX, &ptr), INV);  /* stale id, overflow */
  EXPECT(vmm_arena_resize(a, v, K, NULL), INV);           /* stale id, NULL out */
  EXPECT(vmm_arena_resize(a, v, 100 * K, &ptr), VMM_ARENA_ERR_UNKNOWN_ALLOCATION); /* not OOM */
  vmm_arena_id x, y;
  uint64_t px, py;
  OK(vmm_arena_alloc(a, K, &x, &px));
  OK(vmm_arena_alloc(a, K, &y, &py));
  CHECK(py == px + K); /* y sits right after x: x cannot grow in place */
  OK(vmm_arena_pin(a, x));
  OK(vmm_arena_pin(a, y)); /* y cannot move out of x's way either */
  EXPECT(vmm_arena_resize(a, x, 0, &ptr), INV);
  EXPECT(vmm_arena_resize(a, x, 100 * K, &ptr), VMM_ARENA_ERR_PINNED); /* not OOM */
  EXPECT(vmm_arena_resize(a, x, 2 * K, &ptr), VMM_ARENA_ERR_PINNED);
  CHECK(ptr_of(a, x) == px);
  /* With y movable, pinned x grows where it stands: y moves away. */
  OK(vmm_arena_unpin(a, y));
  OK(vmm_arena_resize(a, x, 2 * K, &ptr));
  CHECK(ptr == px && ptr_of(a, y) != py);
  OK(vmm_arena_unpin(a, x));
  EXPECT(vmm_arena_resize(a, x, 100 * K, &ptr), VMM_ARENA_ERR_OUT_OF_MEMORY);
  OK(vmm_arena_free(a, x));
  OK(vmm_arena_free(a, y));
  vmm_arena_destroy(a);

  /* OUT_OF_MEMORY before OUT_OF_ADDRESS_SPACE; OOAS alone when only the
   * address space falls short. */
  a = make(4, 2, 0);
  EXPECT(vmm_arena_alloc_growable(a, 5 * K, 8 * K, &id, &ptr), VMM_ARENA_ERR_OUT_OF_MEMORY);
  EXPECT(vmm_arena_alloc(a, 5 * K, &id, &ptr), VMM_ARENA_ERR_OUT_OF_MEMORY);
  EXPECT(vmm_arena_alloc_growable(a, K, 4 * K, &id, &ptr), VMM_ARENA_ERR_OUT_OF_ADDRESS_SPACE);
  EXPECT(vmm_arena_alloc(a, 3 * K, &id, &ptr), VMM_ARENA_ERR_OUT_OF_ADDRESS_SPACE);
  CHECK(id == ID0);
  vmm_arena_stats s = stats_of(a);
  CHECK(s.live_allocations == 0 && s.mapped_bytes == 0);
  vmm_arena_destroy(a);
}

static void test_resize_keeps_contents(void) {
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

static void test_compaction_keeps_contents(void) {
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

static void test_implicit_moves_and_address_space(void) {
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
static void test_small_allocations(void) {
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

static void test_pin(void) {
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

#ifdef VMM_ARENA_SLEEP_BACKUP
/* Sleep and wake (the next contract's additions; skipped when this file is
 * compiled against the contract header of version 1, which lacks them). */
static void test_sleep_wake(void) {
  vmm_arena_config c = host_config(8, 32, 0);
  vmm_arena *a = NULL;
  OK(vmm_arena_testing_create_faulty(&c, &a));
  vmm_arena_id w, kv, small, other;
  uint64_t pw, pkv, psmall, q = 0x99;
  OK(vmm_arena_alloc(a, 2 * K + 10, &w, &pw));
  OK(vmm_arena_alloc_growable(a, K, 4 * K, &kv, &pkv));
  OK(vmm_arena_alloc(a, 100, &small, &psmall));
  fill(pw, 2 * K + 10, 21);
  fill(pkv, K, 22);
  OK(vmm_arena_set_tag(a, w, 1));
  OK(vmm_arena_set_tag(a, kv, 2));
  /* Every allocation takes a tag (test_tags.c); its own is a no-op. */
  OK(vmm_arena_set_tag(a, small, 0));
  OK(vmm_arena_query(a, small, &q, NULL));
  CHECK(q == psmall);
  EXPECT(vmm_arena_set_tag(NULL, w, 1), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_sleep(NULL, 1, 0), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_wake(NULL, 1), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_sleep(a, 1, 2), VMM_ARENA_ERR_INVALID_ARGUMENT); /* unknown flag bit */
  CHECK(strcmp(vmm_arena_status_name(VMM_ARENA_ERR_ASLEEP), "VMM_ARENA_ERR_ASLEEP") == 0);
  CHECK(VMM_ARENA_ERR_ASLEEP == 9 && VMM_ARENA_ALL_TAGS == 0xFFFFFFFFu);

  /* A backup buffer the host cannot give fails the sleep: nothing slept. */
  OK(vmm_arena_testing_fail_nth(a, CALL_HOST_ALLOC, 1, FAULT_OOM));
  EXPECT(vmm_arena_sleep(a, 1, VMM_ARENA_SLEEP_BACKUP), VMM_ARENA_ERR_OUT_OF_MEMORY);
  OK(vmm_arena_pin(a, w)); /* awake: pin would be ASLEEP */
  OK(vmm_arena_unpin(a, w));
  CHECK(intact(pw, 2 * K + 10, 21));

  vmm_arena_stats before = stats_of(a);
  OK(vmm_arena_sleep(a, 1, VMM_ARENA_SLEEP_BACKUP));
  OK(vmm_arena_sleep(a, 2, 0));
  vmm_arena_stats s = stats_of(a);
  CHECK(s.live_allocations == before.live_allocations && s.live_bytes == before.live_bytes);
  CHECK(s.mapped_bytes == K); /* the small allocation's slab */
  CHECK(s.pooled_bytes == 0);
  uint64_t chunks = 99, mappings = 99;
  OK(vmm_arena_testing_driver_objects(a, &chunks, &mappings));
  CHECK(chunks == 1 && mappings == 1);
  uint64_t size = 0;
  OK(vmm_arena_query(a, w, &q, &size));
  CHECK(q == pw && size == 2 * K + 10);
  /* Precedence: INVALID_ARGUMENT, UNKNOWN_ALLOCATION, ASLEEP, PINNED. */
  q = 0x99;
  EXPECT(vmm_arena_resize(a, w, 0, &q), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_resize(a, w, 3 * K, NULL), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_resize(a, w, 3 * K, &q), VMM_ARENA_ERR_ASLEEP);
  EXPECT(vmm_arena_resize(a, kv, K / 2, &q), VMM_ARENA_ERR_ASLEEP);
  CHECK(q == 0x99);
  CHECK(strstr(vmm_arena_last_error(), "asleep") != NULL);
  EXPECT(vmm_arena_pin(a, w), VMM_ARENA_ERR_ASLEEP);
  OK(vmm_arena_unpin(a, w));
  OK(vmm_arena_alloc(a, K, &other, &q));
  OK(vmm_arena_free(a, other));
  EXPECT(vmm_arena_resize(a, other, K, &q), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);

  /* A wake that fails (the second map) leaves both asleep, backups intact. */
  OK(vmm_arena_testing_fail_nth(a, CALL_MAP, 2, FAULT_DRIVER));
  EXPECT(vmm_arena_wake(a, VMM_ARENA_ALL_TAGS), VMM_ARENA_ERR_DRIVER);
  EXPECT(vmm_arena_pin(a, w), VMM_ARENA_ERR_ASLEEP);
  EXPECT(vmm_arena_pin(a, kv), VMM_ARENA_ERR_ASLEEP);
  OK(vmm_arena_testing_driver_objects(a, &chunks, &mappings));
  CHECK(stats_of(a).mapped_bytes + stats_of(a).pooled_bytes == chunks * K);

  /* Wake: the same addresses, the backed-up bytes through the pointers
   * taken before the sleep. */
  OK(vmm_arena_wake(a, 1));
  CHECK(intact(pw, 2 * K + 10, 21));
  EXPECT(vmm_arena_pin(a, kv), VMM_ARENA_ERR_ASLEEP);
  OK(vmm_arena_wake(a, VMM_ARENA_ALL_TAGS));
  fill(pkv, K, 23); /* writable again; its old bytes are gone */
  OK(vmm_arena_resize(a, kv, 3 * K, &q));
  CHECK(q == pkv && intact(pkv, K, 23));
  s = stats_of(a);
  CHECK(s.mapped_bytes == before.mapped_bytes + 2 * K);

  /* Free while asleep drops the backup; ALL_TAGS covers every tag, the
   * small allocation's slab included. */
  OK(vmm_arena_sleep(a, VMM_ARENA_ALL_TAGS, VMM_ARENA_SLEEP_BACKUP));
  OK(vmm_arena_free(a, w));
  OK(vmm_arena_free(a, kv));
  s = stats_of(a);
  CHECK(s.live_allocations == 1 && s.mapped_bytes == 0);
  vmm_arena_destroy(a);
}
#endif

/* (Built only against the project's header, which declares the additions
 * of vmm_arena_next.h; VMM_ARENA_SLEEP_BACKUP is one of them. The contract
 * header of version 1 has neither.) */
#ifdef VMM_ARENA_SLEEP_BACKUP
/* Zero-copy sharing: the argument rules and their precedence, writes seen
 * through both addresses, a shared chunk counted once, freed only with its
 * last holder, and a failed alloc_shared changing nothing. */
static void test_alloc_shared(void) {
  vmm_arena_config c = host_config(8, 32, 0);
  vmm_arena *a = NULL;
  OK(vmm_arena_testing_create_faulty(&c, &a));
  vmm_arena_id src, sh, small, gone, out = 0x77;
  uint64_t psrc, psh, psmall, q = 0x99;
  OK(vmm_arena_alloc(a, 3 * K + 5, &src, &psrc));
  fill(psrc, 3 * K + 5, 31);
  OK(vmm_arena_alloc(a, 100, &small, &psmall));
  OK(vmm_arena_alloc(a, 100, &gone, &q)); /* in small's slab: its free caches no chunk */
  OK(vmm_arena_free(a, gone));
  q = 0x99;
  const vmm_arena_status INV = VMM_ARENA_ERR_INVALID_ARGUMENT;
  EXPECT(vmm_arena_alloc_shared(NULL, src, 0, K, K, &out, &q), INV);
  EXPECT(vmm_arena_alloc_shared(a, src, 0, K, K, NULL, &q), INV);
  EXPECT(vmm_arena_alloc_shared(a, src, 0, K, K, &out, NULL), INV);
  EXPECT(vmm_arena_alloc_shared(a, src, 0, 0, K, &out, &q), INV);
  EXPECT(vmm_arena_alloc_shared(a, src, 1, K, K, &out, &q), INV);
  EXPECT(vmm_arena_alloc_shared(a, src, 0, K + 1, 2 * K, &out, &q), INV);
  EXPECT(vmm_arena_alloc_shared(a, src, 0, 4 * K, 4 * K, &out, &q), INV);  /* past its size */
  EXPECT(vmm_arena_alloc_shared(a, src, 3 * K, K, K, &out, &q), INV);      /* its partial chunk */
  EXPECT(vmm_arena_alloc_shared(a, src, 0, 2 * K, K, &out, &q), INV);      /* max_size < bytes */
  EXPECT(vmm_arena_alloc_shared(a, small, 0, K, K, &out, &q), INV);        /* a small src */
  EXPECT(vmm_arena_alloc_shared(a, gone, 0, 0, K, &out, &q), INV);         /* invalid first */
  EXPECT(vmm_arena_alloc_shared(a, gone, 0, K, K, &out, &q), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
  EXPECT(vmm_arena_alloc_shared(a, 0, 0, K, K, &out, &q), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
  CHECK(out == 0x77 && q == 0x99);

  /* A map that fails: nothing changes, nothing leaks. */
  vmm_arena_stats before = stats_of(a);
  uint64_t chunks0 = 0, mappings0 = 0, chunks = 0, mappings = 0;
  OK(vmm_arena_testing_driver_objects(a, &chunks0, &mappings0));
  OK(vmm_arena_testing_fail_nth(a, CALL_MAP, 2, FAULT_DRIVER));
  EXPECT(vmm_arena_alloc_shared(a, src, K, 2 * K, 4 * K, &out, &q), VMM_ARENA_ERR_DRIVER);
  OK(vmm_arena_testing_driver_objects(a, &chunks, &mappings));
  CHECK(chunks == chunks0 && mappings == mappings0);
  vmm_arena_stats s = stats_of(a);
  CHECK(s.live_allocations == before.live_allocations && s.mapped_bytes == before.mapped_bytes);

  OK(vmm_arena_alloc_shared(a, src, K, 2 * K, 4 * K, &sh, &psh));
  CHECK(psh % K == 0 && psh != psrc + K);
  uint64_t size = 0;
  OK(vmm_arena_query(a, sh, &q, &size));
  CHECK(q == psh && size == 2 * K);
  const uint8_t *from_src = (const uint8_t *)(uintptr_t)(psrc + K);
  CHECK(memcmp((const void *)(uintptr_t)psh, from_src, 2 * K) == 0);
  ((uint8_t *)(uintptr_t)psh)[7] = 0xEE;
  CHECK(from_src[7] == 0xEE);
  s = stats_of(a);
  CHECK(s.mapped_bytes == before.mapped_bytes);              /* counted once */
  CHECK(s.live_bytes == before.live_bytes + 2 * K);           /* each size */
  OK(vmm_arena_testing_driver_objects(a, &chunks, &mappings));
  CHECK(chunks == chunks0 && mappings == mappings0 + 2);

  /* It grows like any growable allocation, with chunks of its own. */
  OK(vmm_arena_resize(a, sh, 4 * K, &q));
  CHECK(q == psh);
  fill(psh + 2 * K, 2 * K, 32);
  CHECK(from_src[7] == 0xEE && intact(psrc, K, 31)); /* src untouched by the growth */
  CHECK(stats_of(a).mapped_bytes == before.mapped_bytes + 2 * K);

  /* src goes; the sharer keeps the chunks, and the bytes. */
  OK(vmm_arena_free(a, src));
  CHECK(((const uint8_t *)(uintptr_t)psh)[7] == 0xEE);
  CHECK(intact(psh + 2 * K, 2 * K, 32));
  OK(vmm_arena_free(a, sh));
  OK(vmm_arena_free(a, small));
  OK(vmm_arena_release_retired(a));
  uint64_t given = 0;
  OK(vmm_arena_trim(a, 0, &given));
  OK(vmm_arena_testing_driver_objects(a, &chunks, &mappings));
  CHECK(chunks == 0 && mappings == 0);
  vmm_arena_destroy(a);
}
#endif

static void test_stats_and_trim(void) {
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

static void test_snapshot(void) {
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

static void test_callbacks(void) {
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

static void test_poison(void) {
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

static void test_driver_failures(void) {
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
static void test_stream_free_and_prefetch(void) {
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
static void test_resize_on_stream(void) {
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
static void test_quiesce_on_stream(void) {
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

int main(void) {
  setvbuf(stdout, NULL, _IONBF, 0);
  struct {
    const char *name;
    void (*run)(void);
  } tests[] = {
      {"meta", test_meta},
      {"config_and_create", test_config_and_create},
      {"bad_arguments", test_bad_arguments},
      {"resize_keeps_contents", test_resize_keeps_contents},
      {"compaction_keeps_contents", test_compaction_keeps_contents},
      {"implicit_moves_and_address_space", test_implicit_moves_and_address_space},
      {"small_allocations", test_small_allocations},
      {"pin", test_pin},
      {"stats_and_trim", test_stats_and_trim},
      {"snapshot", test_snapshot},
      {"callbacks", test_callbacks},
      {"poison", test_poison},
      {"driver_failures", test_driver_failures},
#ifdef VMM_ARENA_SLEEP_BACKUP
      {"sleep_wake", test_sleep_wake},
      {"alloc_shared", test_alloc_shared},
#endif
#ifdef VMM_ARENA_FLAG_BACKGROUND
      {"stream_free_and_prefetch", test_stream_free_and_prefetch},
      {"resize_on_stream", test_resize_on_stream},
      {"quiesce_on_stream", test_quiesce_on_stream},
#endif
  };
  for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++) {
    printf("test_api: %s\n", tests[i].name);
    tests[i].run();
  }
  FINISH("test_api");
}
