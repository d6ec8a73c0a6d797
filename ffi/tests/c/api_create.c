/*
 * test_api (see test_api.c): Meta functions, configuration and creation, and bad arguments to every
 * function.
 */
#include "api.h"

void test_meta(void) {
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
  /* 10 is this project's VMM_ARENA_ERR_STALE (two-phase operations). */
  CHECK(strcmp(vmm_arena_status_name((vmm_arena_status)10), "VMM_ARENA_ERR_STALE") == 0);
  CHECK(strcmp(vmm_arena_status_name((vmm_arena_status)11), "UNKNOWN") == 0);
  CHECK(strcmp(vmm_arena_status_name((vmm_arena_status)1000), "UNKNOWN") == 0);
  CHECK(strcmp(vmm_arena_status_name((vmm_arena_status)0xFFFFFFFFu), "UNKNOWN") == 0);
  CHECK(VMM_ARENA_BACKEND_HOST == 0 && VMM_ARENA_BACKEND_CUDA == 1);
  CHECK(VMM_ARENA_FLAG_NO_IMPLICIT_MOVES == 1u);
  CHECK(sizeof(vmm_arena_id) == 8);
  CHECK(strcmp(vmm_arena_last_error(), "") == 0); /* none of these failed */
}

void test_config_and_create(void) {
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

void test_bad_arguments(void) {
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
