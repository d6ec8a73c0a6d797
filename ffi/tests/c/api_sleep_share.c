/*
 * test_api (see test_api.c): Sleep and wake, and zero-copy sharing (alloc_shared).
 */
#include "api.h"

#ifdef VMM_ARENA_SLEEP_BACKUP
/* Sleep and wake (the next contract's additions; skipped when this file is
 * compiled against the contract header of version 1, which lacks them). */
void test_sleep_wake(void) {
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
void test_alloc_shared(void) {
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
