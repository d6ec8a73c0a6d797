/* Tags at allocation time through the C ABI, on the host backend: small
 * allocations of two tags in separate slabs, one tag asleep and the other's
 * bytes intact, set_tag moving a small allocation (reported by the move
 * callback), its refusals, and bad arguments. */
#include <stdint.h>
#include <string.h>

#include "check.h"

enum { K = 64 << 10 };

static vmm_arena *make(void) {
  vmm_arena_config c;
  vmm_arena_config_default(&c);
  c.backend = VMM_ARENA_BACKEND_HOST;
  c.capacity_bytes = 8 * K;
  c.reserve_bytes = 32 * K;
  c.chunk_bytes = K;
  vmm_arena *a = NULL;
  OK(vmm_arena_create(&c, &a));
  return a;
}

static vmm_arena_stats stats(vmm_arena *a) {
  vmm_arena_stats s;
  memset(&s, 0, sizeof s);
  s.struct_size = sizeof s;
  OK(vmm_arena_stats_get(a, &s));
  return s;
}

static uint64_t addr(vmm_arena *a, vmm_arena_id id) {
  uint64_t p = 0;
  OK(vmm_arena_query(a, id, &p, NULL));
  return p;
}

struct moved {
  int count;
  vmm_arena_id id;
  uint64_t old_ptr, new_ptr;
};

static void on_move(void *user, vmm_arena_id id, uint64_t old_ptr, uint64_t new_ptr, uint64_t size) {
  struct moved *m = user;
  (void)size;
  m->count++;
  m->id = id;
  m->old_ptr = old_ptr;
  m->new_ptr = new_ptr;
}

static void fill(uint64_t p, unsigned char seed, size_t n) { memset((void *)(uintptr_t)p, seed, n); }

static int holds(uint64_t p, unsigned char seed, size_t n) {
  const unsigned char *b = (const unsigned char *)(uintptr_t)p;
  for (size_t i = 0; i < n; i++)
    if (b[i] != seed) return 0;
  return 1;
}

static void two_tags_side_by_side(void) {
  vmm_arena *a = make();
  vmm_arena_id w, k, w2;
  uint64_t wp, kp, w2p, p;
  OK(vmm_arena_alloc_tagged(a, 1000, 1, &w, &wp));
  OK(vmm_arena_alloc_tagged(a, 1000, 2, &k, &kp));
  OK(vmm_arena_alloc_tagged(a, 1000, 1, &w2, &w2p));
  CHECK(wp / K != kp / K);
  CHECK(wp / K == w2p / K);
  CHECK(stats(a).mapped_bytes == 2 * K); /* one slab a tag */
  fill(wp, 0x11, 1000);
  fill(kp, 0x22, 1000);
  uint64_t mapped = stats(a).mapped_bytes;
  OK(vmm_arena_sleep(a, 1, VMM_ARENA_SLEEP_BACKUP));
  CHECK(stats(a).mapped_bytes == mapped - K);
  CHECK(holds(kp, 0x22, 1000));
  EXPECT(vmm_arena_resize(a, w, 5000, &p), VMM_ARENA_ERR_ASLEEP);
  EXPECT(vmm_arena_pin(a, w), VMM_ARENA_ERR_ASLEEP);
  EXPECT(vmm_arena_set_tag(a, w, 2), VMM_ARENA_ERR_ASLEEP);
  OK(vmm_arena_wake(a, 1));
  CHECK(addr(a, w) == wp);
  CHECK(holds(wp, 0x11, 1000));
  OK(vmm_arena_free(a, w));
  OK(vmm_arena_free(a, w2));
  OK(vmm_arena_free(a, k));
  vmm_arena_destroy(a);
}

static void set_tag_moves_a_small_allocation(void) {
  vmm_arena *a = make();
  struct moved m = {0, 0, 0, 0};
  OK(vmm_arena_set_move_callback(a, on_move, &m));
  vmm_arena_id x, y, big;
  uint64_t xp, yp, bp, p;
  OK(vmm_arena_alloc(a, 3000, &x, &xp));
  OK(vmm_arena_alloc_tagged(a, 3000, 7, &y, &yp));
  fill(xp, 0x33, 3000);
  OK(vmm_arena_set_tag(a, x, 0));
  CHECK(m.count == 0);
  OK(vmm_arena_set_tag(a, x, 7));
  CHECK(m.count == 1 && m.id == x && m.old_ptr == xp);
  p = addr(a, x);
  CHECK(m.new_ptr == p && p / K == yp / K);
  CHECK(holds(p, 0x33, 3000));
  OK(vmm_arena_pin(a, x));
  EXPECT(vmm_arena_set_tag(a, x, 8), VMM_ARENA_ERR_PINNED);
  CHECK(addr(a, x) == p);
  OK(vmm_arena_unpin(a, x));
  /* The history-free rule: a fresh small allocation and one resized down
   * from whole chunks both take a tag and sleep with it. */
  OK(vmm_arena_alloc(a, K + 1, &big, &bp));
  OK(vmm_arena_resize(a, big, 1000, &bp));
  OK(vmm_arena_set_tag(a, big, 7));
  OK(vmm_arena_sleep(a, 7, 0));
  EXPECT(vmm_arena_resize(a, x, 10, &p), VMM_ARENA_ERR_ASLEEP);
  EXPECT(vmm_arena_resize(a, big, 10, &p), VMM_ARENA_ERR_ASLEEP);
  OK(vmm_arena_wake(a, VMM_ARENA_ALL_TAGS));
  OK(vmm_arena_set_move_callback(a, NULL, NULL));
  vmm_arena_destroy(a);
}

static void bad_arguments(void) {
  vmm_arena *a = make();
  vmm_arena_id id;
  uint64_t p;
  EXPECT(vmm_arena_alloc_tagged(NULL, 100, 1, &id, &p), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_alloc_tagged(a, 100, 1, NULL, &p), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_alloc_tagged(a, 100, 1, &id, NULL), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_alloc_tagged(a, 0, 1, &id, &p), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_alloc_growable_tagged(a, 2 * K, K, 1, &id, &p), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_alloc_growable_tagged(NULL, K, K, 1, &id, &p), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_alloc_tagged(a, 100 * K, 1, &id, &p), VMM_ARENA_ERR_OUT_OF_MEMORY);
  OK(vmm_arena_alloc_growable_tagged(a, K, 4 * K, 3, &id, &p));
  OK(vmm_arena_sleep(a, 3, 0));
  CHECK(stats(a).mapped_bytes == 0);
  OK(vmm_arena_wake(a, 3));
  OK(vmm_arena_free(a, id));
  EXPECT(vmm_arena_set_tag(a, id, 1), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
  vmm_arena_destroy(a);
}

/* VMM_ARENA_ALL_TAGS as a tag is selected by every sleep and wake: a
 * small and a whole-chunk allocation of it sleep with tag 5 and wake with
 * tag 6, while an allocation of tag 7 stays awake throughout. */
static void all_tags_as_a_tag_is_selected_by_every_tag(void) {
  vmm_arena *a = make();
  vmm_arena_id small, whole, other;
  uint64_t p;
  OK(vmm_arena_alloc_tagged(a, 100, VMM_ARENA_ALL_TAGS, &small, &p));
  OK(vmm_arena_alloc_tagged(a, 2 * K, VMM_ARENA_ALL_TAGS, &whole, &p));
  OK(vmm_arena_alloc_tagged(a, K, 7, &other, &p));
  OK(vmm_arena_sleep(a, 5, 0));
  /* Pin needs the allocation awake: ASLEEP tells a sleeper. */
  EXPECT(vmm_arena_pin(a, small), VMM_ARENA_ERR_ASLEEP);
  EXPECT(vmm_arena_pin(a, whole), VMM_ARENA_ERR_ASLEEP);
  OK(vmm_arena_pin(a, other));
  OK(vmm_arena_unpin(a, other));
  CHECK(stats(a).mapped_bytes == K);
  OK(vmm_arena_wake(a, 6));
  OK(vmm_arena_pin(a, small));
  OK(vmm_arena_pin(a, whole));
  CHECK(stats(a).mapped_bytes == 4 * K);
  vmm_arena_destroy(a);
}

/* Sleep backups kept across cycles: a wake keeps the spent buffers, the
 * next sleep reuses them, a release gives them back. */
static void backup_cache(void) {
  vmm_arena *a = make();
  vmm_arena_id x;
  uint64_t p, released = 1;
  EXPECT(vmm_arena_set_backup_cache(a, 2), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_set_backup_cache(NULL, 1), VMM_ARENA_ERR_INVALID_ARGUMENT);
  OK(vmm_arena_release_backup_cache(a, &released));
  CHECK(released == 0);
  OK(vmm_arena_set_backup_cache(a, 1));
  OK(vmm_arena_alloc_tagged(a, 2 * K, 4, &x, &p));
  fill(p, 9, 2 * K);
  for (int cycle = 0; cycle < 3; cycle++) {
    OK(vmm_arena_sleep(a, 4, VMM_ARENA_SLEEP_BACKUP));
    OK(vmm_arena_wake(a, 4));
    CHECK(((unsigned char *)(uintptr_t)p)[2 * K - 1] == 9);
  }
  OK(vmm_arena_release_backup_cache(a, &released));
  CHECK(released == 2 * K);
  OK(vmm_arena_release_backup_cache(a, NULL));
  OK(vmm_arena_set_backup_cache(a, 0));
  OK(vmm_arena_free(a, x));
  vmm_arena_destroy(a);
}

/* A sleeper's backup read without waking it; a small one's from its
 * slab's backup; refusals leave dst and the arena as they were. */
static void read_backup(void) {
  vmm_arena *a = make();
  vmm_arena_id big, small, bare;
  uint64_t p, q, r;
  OK(vmm_arena_alloc_tagged(a, 2 * K + 10, 4, &big, &p));
  OK(vmm_arena_alloc_tagged(a, 200, 4, &small, &q));
  OK(vmm_arena_alloc_tagged(a, K, 5, &bare, &r));
  fill(p, 7, 2 * K + 10);
  fill(q, 8, 200);
  fill(r, 6, K);
  unsigned char out[300];
  memset(out, 0xEE, sizeof out);
  /* Awake: no backup, dst untouched. */
  EXPECT(vmm_arena_read_backup(a, big, 0, out, 10), VMM_ARENA_ERR_INVALID_ARGUMENT);
  CHECK(out[0] == 0xEE);
  OK(vmm_arena_sleep(a, 4, VMM_ARENA_SLEEP_BACKUP));
  OK(vmm_arena_sleep(a, 5, 0));
  OK(vmm_arena_read_backup(a, big, 2 * K - 5, out, 15));
  for (int i = 0; i < 15; i++) CHECK(out[i] == 7);
  OK(vmm_arena_read_backup(a, small, 0, out, 200));
  for (int i = 0; i < 200; i++) CHECK(out[i] == 8);
  memset(out, 0xEE, sizeof out);
  EXPECT(vmm_arena_read_backup(a, bare, 0, out, 10), VMM_ARENA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(vmm_arena_last_error(), "no sleep backup") != NULL);
  EXPECT(vmm_arena_read_backup(a, big, 2 * K, out, 11), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_read_backup(a, big, 0, NULL, 1), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_read_backup(a, 12345, 0, out, 1), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
  EXPECT(vmm_arena_read_backup(NULL, big, 0, out, 1), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_read_backup(a, big, 0, out, SIZE_MAX), VMM_ARENA_ERR_INVALID_ARGUMENT);
  CHECK(out[0] == 0xEE);
  OK(vmm_arena_read_backup(a, big, 0, NULL, 0));
  /* Still asleep; waking restores the same bytes. */
  CHECK(stats(a).mapped_bytes == 0);
  OK(vmm_arena_wake(a, 4));
  CHECK(((unsigned char *)(uintptr_t)p)[2 * K + 9] == 7);
  OK(vmm_arena_wake(a, 5));
  OK(vmm_arena_free(a, big));
  OK(vmm_arena_free(a, small));
  OK(vmm_arena_free(a, bare));
  vmm_arena_destroy(a);
}

int main(void) {
  backup_cache();
  read_backup();
  all_tags_as_a_tag_is_selected_by_every_tag();
  two_tags_side_by_side();
  set_tag_moves_a_small_allocation();
  bad_arguments();
  FINISH("test_tags");
}
