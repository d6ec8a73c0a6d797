/*
 * Tensor-parallel groups through the C ABI, on the host backend, under
 * -fsanitize=address,undefined:
 *  - an in-process group with a configuration per member, and each
 *    member's own arena (vmm_arena_group_member): pin a shard, a move
 *    callback per member, compact, trim, sleep and wake by tag, export a
 *    shard; a member handle outliving its group;
 *  - an undone group resize leaves every member mapping what it did;
 *  - ranks as separate processes (forked): two-phase operations
 *    (vmm_arena_prepare_*, a vote through pipes standing in for the
 *    engine's collective, vmm_arena_commit or vmm_arena_abort), one rank's
 *    injected failure aborting on all, and every rank's allocations at the
 *    same offsets from its base after every step.
 */
#define _GNU_SOURCE
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "vmm_arena.h"
#include "check.h"

vmm_arena_status vmm_arena_testing_create_faulty(const vmm_arena_config *config, vmm_arena **out);
vmm_arena_status vmm_arena_testing_fail_nth(vmm_arena *arena, uint32_t call_kind, uint64_t n, uint32_t fault);
vmm_arena_status vmm_arena_testing_group_create_faulty(const vmm_arena_config *config, uint32_t count,
                                                       vmm_arena_group **out);
vmm_arena_status vmm_arena_testing_group_fail_nth(vmm_arena_group *group, uint32_t member, uint32_t call_kind,
                                                  uint64_t n, uint32_t fault);

#define K ((uint64_t)64 << 10)

static vmm_arena_config config(uint32_t flags, uint64_t chunks) {
  vmm_arena_config c;
  vmm_arena_config_default(&c);
  c.backend = VMM_ARENA_BACKEND_HOST;
  c.flags = flags;
  c.capacity_bytes = chunks * K;
  c.reserve_bytes = 4 * chunks * K;
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

static unsigned long moves_seen;
static void on_move(void *user, vmm_arena_id id, uint64_t old_ptr, uint64_t new_ptr, uint64_t size) {
  (void)user, (void)id, (void)old_ptr, (void)new_ptr, (void)size;
  moves_seen++;
}

static void members_from_c(void) {
  vmm_arena_config cfgs[2] = {config(VMM_ARENA_FLAG_EXPORTABLE, 16), config(0, 8)};
  cfgs[0].device = 10;
  cfgs[1].device = 11;
  vmm_arena_group *g = NULL;
  OK(vmm_arena_group_create_with_configs(cfgs, 2, 0, &g));
  vmm_arena_stats s0 = member_stats(g, 0), s1 = member_stats(g, 1);
  CHECK(s0.capacity_bytes == 16 * K && s1.capacity_bytes == 8 * K); /* per-member configs */
  cfgs[1].device = 10;
  vmm_arena_group *dup = NULL;
  EXPECT(vmm_arena_group_create_with_configs(cfgs, 2, 0, &dup), VMM_ARENA_ERR_INVALID_ARGUMENT);
  cfgs[1].device = 11;
  cfgs[1].struct_size = 3;
  EXPECT(vmm_arena_group_create_with_configs(cfgs, 2, 0, &dup), VMM_ARENA_ERR_INVALID_ARGUMENT);
  CHECK(vmm_arena_group_last_member() == 1 && dup == NULL);

  vmm_arena_group_id gid = 0;
  uint64_t ptrs[2] = {0, 0};
  OK(vmm_arena_group_alloc(g, 1000, &gid, ptrs, 2));
  vmm_arena_id mid[2] = {0, 0};
  for (uint32_t m = 0; m < 2; m++) OK(vmm_arena_group_query(g, gid, m, NULL, NULL, &mid[m]));
  vmm_arena *m0 = NULL, *m1 = NULL, *m1b = NULL;
  OK(vmm_arena_group_member(g, 0, &m0));
  OK(vmm_arena_group_member(g, 1, &m1));
  OK(vmm_arena_group_member(g, 1, &m1b));
  EXPECT(vmm_arena_group_member(g, 2, &m0), VMM_ARENA_ERR_INVALID_ARGUMENT);
  CHECK(m1 != m1b);
  /* A group allocation is whole chunks: a shard can be exported. */
  vmm_arena_export *e = NULL;
  OK(vmm_arena_export_open(m0, mid[0], &e));
  vmm_arena_export_close(e);
  OK(vmm_arena_pin(m1, mid[1]));
  OK(vmm_arena_set_move_callback(m1, on_move, NULL));
  /* Fragment member 1 and compact it: unpinned allocations move and the
   * callback installed through the member handle hears of it. */
  vmm_arena_id a = 0, b = 0, c = 0;
  uint64_t p = 0;
  OK(vmm_arena_alloc(m1, K, &a, &p));
  OK(vmm_arena_alloc(m1, K, &b, &p));
  OK(vmm_arena_alloc(m1, 2 * K, &c, &p));
  OK(vmm_arena_free(m1, a));
  vmm_arena_compact_report rep;
  memset(&rep, 0, sizeof rep);
  OK(vmm_arena_compact(m1, &rep));
  CHECK(rep.moved_allocations == moves_seen);
  uint64_t qp = 0;
  OK(vmm_arena_query(m1, mid[1], &qp, NULL));
  CHECK(qp == ptrs[1]); /* pinned: did not move */
  OK(vmm_arena_set_move_callback(m1, NULL, NULL));
  uint64_t released = 0;
  OK(vmm_arena_trim(m1b, 0, &released));
  /* Sleep and wake one member's shard by tag, through its handle. */
  OK(vmm_arena_unpin(m1, mid[1]));
  OK(vmm_arena_set_tag(m1, mid[1], 7));
  OK(vmm_arena_sleep(m1, 7, VMM_ARENA_SLEEP_BACKUP));
  EXPECT(vmm_arena_group_resize(g, gid, 2 * K, ptrs, 2), VMM_ARENA_ERR_ASLEEP);
  CHECK(vmm_arena_group_last_member() == 1);
  OK(vmm_arena_wake(m1, 7));
  OK(vmm_arena_group_resize(g, gid, 2 * K, ptrs, 2));
  vmm_arena_destroy(m1b); /* releases the handle only */
  OK(vmm_arena_group_free(g, gid));
  vmm_arena_destroy(m0);
  vmm_arena_group_destroy(g);
  /* m1 outlives the group: its arena is still there until released. */
  vmm_arena_stats s;
  memset(&s, 0, sizeof s);
  s.struct_size = sizeof s;
  OK(vmm_arena_stats_get(m1, &s));
  CHECK(s.live_allocations == 2);
  vmm_arena_destroy(m1);
}

/* Issue 30, finding 9, from C. */
static void undone_resize_maps_as_before(void) {
  vmm_arena_config c = config(0, 16);
  vmm_arena_group *g = NULL;
  OK(vmm_arena_testing_group_create_faulty(&c, 2, &g));
  vmm_arena_group_id gid = 0;
  uint64_t ptrs[2];
  OK(vmm_arena_group_alloc(g, 100 << 10 >> 4, &gid, ptrs, 2));
  uint64_t before0 = member_stats(g, 0).mapped_bytes, before1 = member_stats(g, 1).mapped_bytes;
  OK(vmm_arena_testing_group_fail_nth(g, 1, 3 /* create */, 1, 0));
  EXPECT(vmm_arena_group_resize(g, gid, 3 * K, ptrs, 2), VMM_ARENA_ERR_OUT_OF_MEMORY);
  CHECK(vmm_arena_group_last_member() == 1);
  CHECK(member_stats(g, 0).mapped_bytes == before0 && member_stats(g, 1).mapped_bytes == before1);
  uint64_t size = 0;
  OK(vmm_arena_group_query(g, gid, 0, NULL, &size, NULL));
  CHECK(size == (100 << 10 >> 4));
  vmm_arena_group_destroy(g);
}

/* ------------------------------------------------------ forked ranks */

#define RANKS 3
#define SLOTS 4

enum kind { ALLOC, RESIZE, FREE };
struct step {
  enum kind kind;
  int slot;
  uint64_t size, max;
  int fail_on; /* the rank whose next driver call fails, or -1 */
};

static const struct step script[] = {
    {ALLOC, 0, 3 * K, 3 * K, -1},     {ALLOC, 1, 4 * K, 4 * K, 1},  {ALLOC, 1, 2 * K, 6 * K, -1},
    {RESIZE, 1, 5 * K, 0, 2},         {RESIZE, 1, 5 * K, 0, -1},    {ALLOC, 2, 1000, 1000, 0},
    {ALLOC, 2, 1000, 1000, -1},       {FREE, 0, 0, 0, -1},          {ALLOC, 3, 2 * K, 2 * K, -1},
    {RESIZE, 1, K, 0, -1},            {ALLOC, 0, 4 * K, 4 * K, 2},  {ALLOC, 0, 4 * K, 4 * K, -1},
};
#define STEPS (sizeof script / sizeof script[0])

static void xwrite(int fd, const void *b, size_t n) {
  const char *p = b;
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w <= 0) _exit(20);
    p += w, n -= (size_t)w;
  }
}

static int xread(int fd, void *b, size_t n) {
  char *p = b;
  while (n > 0) {
    ssize_t r = read(fd, p, n);
    if (r <= 0) return 0;
    p += r, n -= (size_t)r;
  }
  return 1;
}

/* A rank: exits 0 when every step ran as planned. */
static int rank_main(int me, int up, int down) {
  vmm_arena_config c = config(VMM_ARENA_FLAG_DETERMINISTIC_PLACEMENT, 32);
  vmm_arena *a = NULL;
  if (vmm_arena_testing_create_faulty(&c, &a) != VMM_ARENA_OK) return 1;
  /* The base of the arena's range, from its snapshot. */
  static char json[1 << 16];
  size_t len = 0;
  if (vmm_arena_snapshot_json(a, json, sizeof json - 1, &len) != VMM_ARENA_OK) return 2;
  json[len < sizeof json ? len : sizeof json - 1] = 0;
  const char *at = strstr(json, "\"base\":");
  if (at == NULL) return 2;
  uint64_t base = strtoull(at + 7, NULL, 10);
  vmm_arena_id ids[SLOTS] = {0};
  for (size_t n = 0; n < STEPS; n++) {
    const struct step *s = &script[n];
    if (s->fail_on == me) vmm_arena_testing_fail_nth(a, 0, 1, 0);
    vmm_arena_prepared *p = NULL;
    vmm_arena_id id = 0;
    uint64_t ptr = 0;
    vmm_arena_status st;
    switch (s->kind) {
      case ALLOC:
        st = vmm_arena_prepare_alloc(a, s->size, s->max, s->max > s->size ? VMM_ARENA_PREPARE_GROWABLE : 0, &p,
                                     &id, &ptr);
        break;
      case RESIZE:
        st = vmm_arena_prepare_resize(a, ids[s->slot], s->size, &p, &ptr);
        break;
      default:
        st = vmm_arena_prepare_free(a, ids[s->slot], &p);
        break;
    }
    vmm_arena_testing_fail_nth(a, 0, 0, 0);
    if (st != VMM_ARENA_OK && s->fail_on != me) return 3;
    uint8_t vote = st == VMM_ARENA_OK, decision = 0;
    xwrite(up, &vote, 1);
    if (!xread(down, &decision, 1)) return 4;
    if (st == VMM_ARENA_OK) {
      if (decision) {
        if (vmm_arena_commit(a, p) != VMM_ARENA_OK) return 5;
        if (s->kind == ALLOC) ids[s->slot] = id;
        if (s->kind == FREE) ids[s->slot] = 0;
      } else if (vmm_arena_abort(a, p) != VMM_ARENA_OK) {
        return 6;
      }
    }
    uint64_t offsets[SLOTS];
    for (int i = 0; i < SLOTS; i++) {
      offsets[i] = UINT64_MAX;
      uint64_t q = 0;
      if (ids[i] && vmm_arena_query(a, ids[i], &q, NULL) == VMM_ARENA_OK) offsets[i] = q - base;
    }
    xwrite(up, offsets, sizeof offsets);
  }
  vmm_arena_destroy(a);
  return 0;
}

static void forked_ranks(void) {
  int up[RANKS][2], down[RANKS][2];
  pid_t pids[RANKS];
  fflush(NULL);
  for (int r = 0; r < RANKS; r++) {
    CHECK(pipe(up[r]) == 0 && pipe(down[r]) == 0);
    pids[r] = fork();
    CHECK(pids[r] >= 0);
    if (pids[r] == 0) {
      close(up[r][0]);
      close(down[r][1]);
      _exit(rank_main(r, up[r][1], down[r][0]));
    }
    close(up[r][1]);
    close(down[r][0]);
  }
  int aborted = 0;
  for (size_t n = 0; n < STEPS; n++) {
    uint8_t all = 1;
    for (int r = 0; r < RANKS; r++) {
      uint8_t v = 0;
      CHECK(xread(up[r][0], &v, 1));
      all &= v;
    }
    aborted += !all;
    for (int r = 0; r < RANKS; r++) xwrite(down[r][1], &all, 1);
    uint64_t view[RANKS][SLOTS];
    for (int r = 0; r < RANKS; r++) CHECK(xread(up[r][0], view[r], sizeof view[r]));
    for (int r = 1; r < RANKS; r++) CHECK(memcmp(view[r], view[0], sizeof view[0]) == 0);
  }
  CHECK(aborted >= 2);
  for (int r = 0; r < RANKS; r++) {
    int status = 0;
    CHECK(waitpid(pids[r], &status, 0) == pids[r]);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    close(up[r][0]);
    close(down[r][1]);
  }
  printf("forked ranks: %zu steps, %d aborted on every rank\n", STEPS, aborted);
}

int main(void) {
  members_from_c();
  undone_resize_maps_as_before();
  forked_ranks();
  FINISH("test_group_tp");
}
