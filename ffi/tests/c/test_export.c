/*
 * Export and import through the C ABI, on the host backend, under
 * -fsanitize=address,undefined:
 *  - in one process: bytes both ways, the layout and the descriptors, stats,
 *    pinning while an export is open, the exporter freeing first;
 *  - refusals: bad layout records, negative and closed descriptors, NULLs,
 *    unknown flags, a small allocation, an arena without exportable chunks,
 *    DMA-BUF (GPU only);
 *  - a fault matrix: every driver call of export and of import fails in
 *    turn (testing hooks), with both kinds: the fault's status, nothing
 *    kept (driver chunks, mappings, stats as before), and a retry succeeds;
 *  - two processes: fork, the descriptors over a Unix socket (SCM_RIGHTS),
 *    bytes both ways, the exporter frees first; bounded by socket timeouts
 *    and a reaped child.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "vmm_arena.h"
#include "check.h"

vmm_arena_status vmm_arena_testing_create_faulty(const vmm_arena_config *config, vmm_arena **out);
vmm_arena_status vmm_arena_testing_fail_nth(vmm_arena *arena, uint32_t call_kind, uint64_t n, uint32_t fault);
vmm_arena_status vmm_arena_testing_driver_objects(vmm_arena *arena, uint64_t *out_chunks, uint64_t *out_mappings);
vmm_arena_status vmm_arena_testing_driver_calls(vmm_arena *arena, uint64_t *out_calls, uint64_t *out_injected);

#define K ((uint64_t)64 << 10)
#define SIZE (3 * K - 1000)

static vmm_arena_config config(uint32_t flags) {
  vmm_arena_config c;
  vmm_arena_config_default(&c);
  c.backend = VMM_ARENA_BACKEND_HOST;
  c.flags = flags;
  c.capacity_bytes = 8 * K;
  c.reserve_bytes = 32 * K;
  c.chunk_bytes = K;
  return c;
}

static vmm_arena *make(uint32_t flags) {
  vmm_arena_config c = config(flags);
  vmm_arena *a = NULL;
  OK(vmm_arena_create(&c, &a));
  return a;
}

static uint8_t pattern(uint32_t seed, uint64_t i) { return (uint8_t)(seed * 29u + i * 13u + (i >> 9)); }

static void fill(uint64_t ptr, uint64_t len, uint32_t seed) {
  uint8_t *p = (uint8_t *)(uintptr_t)ptr;
  for (uint64_t i = 0; i < len; i++)
    p[i] = pattern(seed, i);
}

static int same(uint64_t ptr, uint64_t len, uint32_t seed) {
  const uint8_t *p = (const uint8_t *)(uintptr_t)ptr;
  for (uint64_t i = 0; i < len; i++)
    if (p[i] != pattern(seed, i))
      return 0;
  return 1;
}

static vmm_arena_export_layout layout_of(const vmm_arena_export *e) {
  vmm_arena_export_layout l;
  memset(&l, 0, sizeof l);
  l.struct_size = sizeof l;
  OK(vmm_arena_export_layout_get(e, &l));
  return l;
}

static size_t fds_of(const vmm_arena_export *e, int32_t *fds, size_t cap) {
  size_t n = 0;
  OK(vmm_arena_export_fds(e, NULL, 0, &n));
  CHECK(n <= cap);
  OK(vmm_arena_export_fds(e, fds, cap, &n));
  return n;
}

static void test_in_one_process(void) {
  vmm_arena *ex = make(VMM_ARENA_FLAG_EXPORTABLE);
  vmm_arena *im = make(0);
  vmm_arena_id x = 0;
  uint64_t xp = 0;
  OK(vmm_arena_alloc(ex, SIZE, &x, &xp));
  fill(xp, SIZE, 1);
  vmm_arena_export *e = NULL;
  OK(vmm_arena_export_open(ex, x, &e));
  vmm_arena_export_layout l = layout_of(e);
  CHECK(l.version == VMM_ARENA_EXPORT_FORMAT_VERSION && l.chunk_bytes == K && l.chunk_count == 3 && l.size == SIZE);
  int32_t fds[8];
  CHECK(fds_of(e, fds, 8) == 3);
  vmm_arena_id y = 0;
  uint64_t yp = 0;
  OK(vmm_arena_import(im, &l, fds, 3, 0, &y, &yp));
  CHECK(yp != 0 && yp != xp);
  CHECK(same(yp, SIZE, 1));
  memcpy((void *)(uintptr_t)(yp + 100), "importer", 8);
  CHECK(memcmp((void *)(uintptr_t)(xp + 100), "importer", 8) == 0);
  uint64_t ptr = 0, size = 0;
  OK(vmm_arena_query(im, y, &ptr, &size));
  CHECK(ptr == yp && size == SIZE);
  uint64_t n_imp = 0, b_imp = 0, n_exp = 0;
  OK(vmm_arena_sharing_stats(im, &n_imp, &b_imp, NULL));
  CHECK(n_imp == 1 && b_imp == 3 * K);
  OK(vmm_arena_sharing_stats(ex, NULL, NULL, &n_exp));
  CHECK(n_exp == 1);
  vmm_arena_stats s;
  s.struct_size = sizeof s;
  OK(vmm_arena_stats_get(im, &s));
  CHECK(s.live_allocations == 0 && s.mapped_bytes == 0);
  EXPECT(vmm_arena_resize(im, y, K, &ptr), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_resize_on_stream(im, y, K, 0, &ptr), VMM_ARENA_ERR_INVALID_ARGUMENT); /* as resize */
  OK(vmm_arena_quiesce_on_stream(im, y, 0)); /* an import: nothing to record, unchanged */
  OK(vmm_arena_query(im, y, &ptr, &size));
  CHECK(ptr == yp && size == SIZE && same(yp, 100, 1));

  /* Pinned while open: growth past the neighbour is refused. */
  vmm_arena_id nb = 0;
  uint64_t nbp = 0;
  OK(vmm_arena_alloc(ex, K, &nb, &nbp));
  OK(vmm_arena_pin(ex, nb));
  EXPECT(vmm_arena_resize(ex, x, 6 * K, &ptr), VMM_ARENA_ERR_PINNED);
  EXPECT(vmm_arena_resize(ex, x, K, &ptr), VMM_ARENA_ERR_INVALID_ARGUMENT); /* below its exported chunks */
  EXPECT(vmm_arena_resize_on_stream(ex, x, 6 * K, 1, &ptr), VMM_ARENA_ERR_PINNED);
  EXPECT(vmm_arena_resize_on_stream(ex, x, K, 1, &ptr), VMM_ARENA_ERR_INVALID_ARGUMENT);
  OK(vmm_arena_quiesce_on_stream(ex, x, 1)); /* an export: nothing to record */
  OK(vmm_arena_query(ex, x, NULL, &size));
  CHECK(size == SIZE && same(xp, 100, 1)); /* unchanged (the importer wrote at 100) */
  vmm_arena_export_close(e);
  vmm_arena_export_close(NULL);

  /* The exporter frees first; the importer keeps its bytes. */
  OK(vmm_arena_free(ex, x));
  OK(vmm_arena_stats_get(ex, &s));
  CHECK(s.pooled_bytes == 0);
  vmm_arena_id z = 0;
  uint64_t zp = 0;
  OK(vmm_arena_alloc(ex, 6 * K, &z, &zp)); /* takes every chunk left */
  fill(zp, 6 * K, 9);
  CHECK(memcmp((void *)(uintptr_t)(yp + 100), "importer", 8) == 0);
  for (uint64_t i = 200; i < SIZE; i += 37)
    CHECK(((uint8_t *)(uintptr_t)yp)[i] == pattern(1, i));
  OK(vmm_arena_free(im, y));
  EXPECT(vmm_arena_free(im, y), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
  EXPECT(vmm_arena_quiesce_on_stream(im, y, 0), VMM_ARENA_ERR_UNKNOWN_ALLOCATION); /* a freed import */
  OK(vmm_arena_sharing_stats(im, &n_imp, &b_imp, NULL));
  CHECK(n_imp == 0 && b_imp == 0);

  /* Read-only. */
  vmm_arena_id r = 0;
  uint64_t rp = 0;
  OK(vmm_arena_alloc(ex, K, &r, &rp));
  memcpy((void *)(uintptr_t)rp, "read only", 9);
  OK(vmm_arena_export_open(ex, r, &e));
  l = layout_of(e);
  CHECK(fds_of(e, fds, 8) == 1);
  OK(vmm_arena_import(im, &l, fds, 1, VMM_ARENA_IMPORT_READ_ONLY, &y, &yp));
  CHECK(memcmp((void *)(uintptr_t)yp, "read only", 9) == 0);
  OK(vmm_arena_free(im, y));
  vmm_arena_export_close(e);

  OK(vmm_arena_free(ex, z));
  OK(vmm_arena_free(ex, r));
  OK(vmm_arena_free(ex, nb));
  vmm_arena_destroy(im);
  vmm_arena_destroy(ex);
}

static void test_refusals(void) {
  vmm_arena *ex = make(VMM_ARENA_FLAG_EXPORTABLE);
  vmm_arena *im = make(0);
  vmm_arena_id x = 0, y = 0;
  uint64_t xp = 0, yp = 0;
  OK(vmm_arena_alloc(ex, 2 * K, &x, &xp));
  vmm_arena_export *e = NULL;
  EXPECT(vmm_arena_export_open(ex, x, NULL), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_export_open(NULL, x, &e), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_export_open(ex, 12345, &e), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
  OK(vmm_arena_export_open(ex, x, &e));
  vmm_arena_export_layout good = layout_of(e), l;
  int32_t fds[4];
  CHECK(fds_of(e, fds, 4) == 2);
  size_t n = 0;
  EXPECT(vmm_arena_export_fds(NULL, fds, 4, &n), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_export_fds(e, fds, 4, NULL), VMM_ARENA_ERR_INVALID_ARGUMENT);
  l = good;
  l.struct_size = 8;
  EXPECT(vmm_arena_export_layout_get(e, &l), VMM_ARENA_ERR_INVALID_ARGUMENT);

#define BAD_LAYOUT(field, value)                                                             \
  do {                                                                                       \
    l = good;                                                                                \
    l.field = value;                                                                         \
    EXPECT(vmm_arena_import(im, &l, fds, 2, 0, &y, &yp), VMM_ARENA_ERR_INVALID_ARGUMENT);   \
  } while (0)
  BAD_LAYOUT(struct_size, 16);
  BAD_LAYOUT(version, 7);
  BAD_LAYOUT(chunk_bytes, 2 * K);
  BAD_LAYOUT(chunk_count, 3);
  BAD_LAYOUT(size, 0);
  BAD_LAYOUT(size, K);
  BAD_LAYOUT(size, 2 * K + 1);
  EXPECT(vmm_arena_import(im, NULL, fds, 2, 0, &y, &yp), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_import(im, &good, NULL, 2, 0, &y, &yp), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_import(im, &good, fds, 2, 0x10, &y, &yp), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_import(im, &good, fds, 2, 0, NULL, &yp), VMM_ARENA_ERR_INVALID_ARGUMENT);
  int32_t neg[2] = {fds[0], -1};
  EXPECT(vmm_arena_import(im, &good, neg, 2, 0, &y, &yp), VMM_ARENA_ERR_INVALID_ARGUMENT);
  int closed = dup(fds[1]);
  CHECK(closed >= 0 && close(closed) == 0);
  int32_t with_closed[2] = {fds[0], closed};
  EXPECT(vmm_arena_import(im, &good, with_closed, 2, 0, &y, &yp), VMM_ARENA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(vmm_arena_last_error(), "not open") != NULL);
  int32_t not_chunks[2] = {fds[0], STDOUT_FILENO};
  EXPECT(vmm_arena_import(im, &good, not_chunks, 2, 0, &y, &yp), VMM_ARENA_ERR_INVALID_ARGUMENT);
  uint64_t n_imp = 1;
  OK(vmm_arena_sharing_stats(im, &n_imp, NULL, NULL));
  CHECK(n_imp == 0);
  CHECK(y == 0 && yp == 0); /* untouched on failure */

  vmm_arena_id small = 0;
  uint64_t sp = 0;
  OK(vmm_arena_alloc(ex, 100, &small, &sp));
  vmm_arena_export *e2 = NULL;
  EXPECT(vmm_arena_export_open(ex, small, &e2), VMM_ARENA_ERR_INVALID_ARGUMENT);
  vmm_arena_id p = 0;
  uint64_t pp = 0;
  OK(vmm_arena_alloc(im, K, &p, &pp));
  EXPECT(vmm_arena_export_open(im, p, &e2), VMM_ARENA_ERR_UNSUPPORTED);
  int32_t dmabuf = -1;
  EXPECT(vmm_arena_export_dmabuf(ex, x, &dmabuf), VMM_ARENA_ERR_UNSUPPORTED);
  CHECK(e2 == NULL && dmabuf == -1);
  vmm_arena_export_close(e);
  vmm_arena_destroy(im);
  vmm_arena_destroy(ex);
}

/* ------------------------------------------------------------ fault matrix */

static vmm_arena *faulty(uint32_t flags) {
  vmm_arena_config c = config(flags);
  vmm_arena *a = NULL;
  OK(vmm_arena_testing_create_faulty(&c, &a));
  return a;
}

static void check_objects(vmm_arena *a, uint64_t want_chunks) {
  uint64_t chunks = 0, mappings = 0;
  OK(vmm_arena_testing_driver_objects(a, &chunks, &mappings));
  CHECK(chunks == want_chunks);
}

/* An exportable faulty arena with one allocation of 3 chunks, stamped. */
static vmm_arena *export_case(vmm_arena_id *x, uint64_t *xp) {
  vmm_arena *a = faulty(VMM_ARENA_FLAG_EXPORTABLE);
  OK(vmm_arena_alloc(a, 3 * K, x, xp));
  fill(*xp, 3 * K, 4);
  return a;
}

static uint64_t calls_of(vmm_arena *a) {
  uint64_t calls = 0, injected = 0;
  OK(vmm_arena_testing_driver_calls(a, &calls, &injected));
  return calls;
}

static unsigned long export_faults(void) {
  vmm_arena_id x = 0;
  uint64_t xp = 0;
  vmm_arena *twin = export_case(&x, &xp);
  uint64_t c0 = calls_of(twin);
  vmm_arena_export *e = NULL;
  OK(vmm_arena_export_open(twin, x, &e));
  uint64_t calls = calls_of(twin) - c0;
  CHECK(calls == 4); /* a synchronize (the ordering rule), one export per chunk */
  vmm_arena_export_close(e);
  vmm_arena_destroy(twin);
  unsigned long faults = 0;
  for (uint64_t i = 1; i <= calls; i++) {
    for (uint32_t kind = 0; kind < 2; kind++) {
      vmm_arena *a = export_case(&x, &xp);
      OK(vmm_arena_testing_fail_nth(a, 0, i, kind));
      e = NULL;
      EXPECT(vmm_arena_export_open(a, x, &e), kind == 0 ? VMM_ARENA_ERR_OUT_OF_MEMORY : VMM_ARENA_ERR_DRIVER);
      CHECK(e == NULL);
      uint64_t n_exp = 1;
      OK(vmm_arena_sharing_stats(a, NULL, NULL, &n_exp));
      CHECK(n_exp == 0);
      check_objects(a, 3);
      CHECK(same(xp, 3 * K, 4));
      OK(vmm_arena_export_open(a, x, &e)); /* a retry succeeds */
      vmm_arena_export_close(e);
      OK(vmm_arena_free(a, x));
      vmm_arena_destroy(a);
      faults++;
    }
  }
  return faults;
}

static unsigned long import_faults(void) {
  vmm_arena *ex = make(VMM_ARENA_FLAG_EXPORTABLE);
  vmm_arena_id x = 0, y = 0;
  uint64_t xp = 0, yp = 0;
  OK(vmm_arena_alloc(ex, 3 * K, &x, &xp));
  fill(xp, 3 * K, 5);
  vmm_arena_export *e = NULL;
  OK(vmm_arena_export_open(ex, x, &e));
  vmm_arena_export_layout l = layout_of(e);
  int32_t fds[4];
  CHECK(fds_of(e, fds, 4) == 3);
  vmm_arena *twin = faulty(0);
  uint64_t c0 = calls_of(twin);
  OK(vmm_arena_import(twin, &l, fds, 3, 0, &y, &yp));
  uint64_t calls = calls_of(twin) - c0;
  CHECK(calls == 8); /* reserve, 3 imports, 3 maps, 1 access */
  vmm_arena_destroy(twin);
  unsigned long faults = 0;
  for (uint64_t i = 1; i <= calls; i++) {
    for (uint32_t kind = 0; kind < 2; kind++) {
      vmm_arena *a = faulty(0);
      OK(vmm_arena_testing_fail_nth(a, 0, i, kind));
      y = 0;
      EXPECT(vmm_arena_import(a, &l, fds, 3, 0, &y, &yp), kind == 0 ? VMM_ARENA_ERR_OUT_OF_MEMORY : VMM_ARENA_ERR_DRIVER);
      CHECK(y == 0);
      uint64_t chunks = 1, mappings = 1;
      OK(vmm_arena_testing_driver_objects(a, &chunks, &mappings));
      CHECK(chunks == 0 && mappings == 0);
      OK(vmm_arena_import(a, &l, fds, 3, 0, &y, &yp)); /* a retry succeeds */
      CHECK(same(yp, 3 * K, 5));
      OK(vmm_arena_free(a, y));
      check_objects(a, 0);
      vmm_arena_destroy(a);
      faults++;
    }
  }
  vmm_arena_export_close(e);
  vmm_arena_destroy(ex);
  return faults;
}

/* ----------------------------------------------------------- two processes */

static void send_msg(int sock, const void *data, size_t len, const int32_t *fds, size_t nfds) {
  struct iovec iov = {(void *)data, len};
  char control[CMSG_SPACE(sizeof(int32_t) * 8)];
  memset(control, 0, sizeof control);
  struct msghdr msg;
  memset(&msg, 0, sizeof msg);
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (nfds > 0) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int32_t) * nfds);
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int32_t) * nfds);
    memcpy(CMSG_DATA(c), fds, sizeof(int32_t) * nfds);
  }
  CHECK(sendmsg(sock, &msg, 0) == (ssize_t)len);
}

static ssize_t recv_msg(int sock, void *data, size_t len, int32_t *fds, size_t *nfds) {
  struct iovec iov = {data, len};
  char control[CMSG_SPACE(sizeof(int32_t) * 8)];
  struct msghdr msg;
  memset(&msg, 0, sizeof msg);
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  if (nfds)
    *nfds = 0;
  for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); n >= 0 && c != NULL; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS && nfds) {
      *nfds = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int32_t);
      memcpy(fds, CMSG_DATA(c), *nfds * sizeof(int32_t));
    }
  }
  return n;
}

/* The importer: returns 0 when every check passed (CHECK exits otherwise). */
static int importer_child(int sock) {
  vmm_arena *im = make(0);
  vmm_arena_export_layout l;
  int32_t fds[8];
  size_t nfds = 0;
  CHECK(recv_msg(sock, &l, sizeof l, fds, &nfds) == (ssize_t)sizeof l);
  CHECK(nfds == 3 && l.chunk_count == 3);
  vmm_arena_id y = 0;
  uint64_t yp = 0;
  OK(vmm_arena_import(im, &l, fds, nfds, 0, &y, &yp));
  for (size_t i = 0; i < nfds; i++)
    close(fds[i]); /* the arena keeps its own */
  CHECK(same(yp, SIZE, 1));
  memcpy((void *)(uintptr_t)(yp + 2 * K), "child wrote", 11);
  send_msg(sock, "wrote", 5, NULL, 0);
  char buf[8] = {0};
  CHECK(recv_msg(sock, buf, sizeof buf, NULL, NULL) == 5 && memcmp(buf, "freed", 5) == 0);
  CHECK(memcmp((void *)(uintptr_t)(yp + 2 * K), "child wrote", 11) == 0);
  CHECK(same(yp, 2 * K, 1)); /* the parent freed first: still here */
  OK(vmm_arena_free(im, y));
  vmm_arena_destroy(im);
  send_msg(sock, "done", 4, NULL, 0);
  return 0;
}

static void test_two_processes(void) {
  int sv[2];
  CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) == 0);
  struct timeval tv = {10, 0};
  for (int i = 0; i < 2; i++)
    CHECK(setsockopt(sv[i], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) == 0);
  fflush(stdout);
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    close(sv[0]);
    _exit(importer_child(sv[1]));
  }
  close(sv[1]);
  vmm_arena *ex = make(VMM_ARENA_FLAG_EXPORTABLE);
  vmm_arena_id x = 0;
  uint64_t xp = 0;
  OK(vmm_arena_alloc(ex, SIZE, &x, &xp));
  fill(xp, SIZE, 1);
  vmm_arena_export *e = NULL;
  OK(vmm_arena_export_open(ex, x, &e));
  vmm_arena_export_layout l = layout_of(e);
  int32_t fds[8];
  size_t n = fds_of(e, fds, 8);
  send_msg(sv[0], &l, sizeof l, fds, n);
  vmm_arena_export_close(e);
  char buf[8] = {0};
  CHECK(recv_msg(sv[0], buf, sizeof buf, NULL, NULL) == 5 && memcmp(buf, "wrote", 5) == 0);
  CHECK(memcmp((void *)(uintptr_t)(xp + 2 * K), "child wrote", 11) == 0);
  OK(vmm_arena_free(ex, x));
  send_msg(sv[0], "freed", 5, NULL, 0);
  memset(buf, 0, sizeof buf);
  CHECK(recv_msg(sv[0], buf, sizeof buf, NULL, NULL) == 4 && memcmp(buf, "done", 4) == 0);
  /* Reap within 20 s, or kill. */
  int status = 0;
  pid_t r = 0;
  for (int waited = 0; waited < 2000 && (r = waitpid(pid, &status, WNOHANG)) == 0; waited++) {
    struct timespec ts = {0, 10 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  if (r == 0) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
  }
  CHECK(r == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
  close(sv[0]);
  vmm_arena_destroy(ex);
}

/* Only whole fields of a layout record count: a struct_size ending inside
 * handle_type (33) reads as the 32-byte record (handle_type unread, so a
 * CUDA type in byte 32 is not seen), and the writer leaves the partial
 * field's bytes alone. */
static void test_partial_fields(void) {
  vmm_arena *ex = make(VMM_ARENA_FLAG_EXPORTABLE);
  vmm_arena *im = make(0);
  vmm_arena_id x = 0, y = 0;
  uint64_t xp = 0, yp = 0;
  OK(vmm_arena_alloc(ex, 2 * K, &x, &xp));
  vmm_arena_export *e = NULL;
  OK(vmm_arena_export_open(ex, x, &e));
  vmm_arena_export_layout good = layout_of(e), l;
  int32_t fds[4];
  CHECK(fds_of(e, fds, 4) == 2);
  l = good;
  l.struct_size = 32;
  l.handle_type = VMM_ARENA_EXPORT_HANDLE_CUDA_POSIX_FD;
  OK(vmm_arena_import(im, &l, fds, 2, 0, &y, &yp));
  OK(vmm_arena_free(im, y));
  l.struct_size = 33;
  OK(vmm_arena_import(im, &l, fds, 2, 0, &y, &yp));
  OK(vmm_arena_free(im, y));
  /* A whole handle_type is read: the CUDA type is refused on the host. */
  l.struct_size = 36;
  EXPECT(vmm_arena_import(im, &l, fds, 2, 0, &y, &yp), VMM_ARENA_ERR_INVALID_ARGUMENT);
  for (uint32_t size = 33; size < 36; size++) {
    unsigned char raw[sizeof(vmm_arena_export_layout)];
    memset(raw, 0xAB, sizeof raw);
    memcpy(raw, &size, sizeof size);
    OK(vmm_arena_export_layout_get(e, (vmm_arena_export_layout *)(void *)raw));
    for (size_t i = 32; i < sizeof raw; i++)
      CHECK(raw[i] == 0xAB);
  }
  for (int i = 0; i < 2; i++)
    close(fds[i]);
  vmm_arena_export_close(e);
  vmm_arena_destroy(im);
  vmm_arena_destroy(ex);
}

/* A SOCK_SEQPACKET record longer than the header (a valid header and 44
 * bytes more) is something other than what vmm_arena_export_send sends:
 * INVALID_ARGUMENT, nothing imported, the descriptors closed. */
static void test_seqpacket_record_too_long(void) {
  vmm_arena *ex = make(VMM_ARENA_FLAG_EXPORTABLE);
  vmm_arena *im = make(0);
  vmm_arena_id x = 0, y = 0;
  uint64_t xp = 0, yp = 0;
  OK(vmm_arena_alloc(ex, 2 * K, &x, &xp));
  vmm_arena_export *e = NULL;
  OK(vmm_arena_export_open(ex, x, &e));
  int a[2], b[2];
  CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, a) == 0);
  CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, b) == 0);
  OK(vmm_arena_export_send(e, a[0]));
  unsigned char rec[200];
  memset(rec, 0x5A, sizeof rec);
  int32_t fds[8];
  size_t nfds = 0;
  ssize_t n = recv_msg(a[1], rec, sizeof rec, fds, &nfds);
  CHECK(n == 56 && nfds == 2);
  /* As sent, the record imports. */
  send_msg(b[0], rec, 56, fds, nfds);
  OK(vmm_arena_import_recv(im, b[1], 0, &y, &yp));
  OK(vmm_arena_free(im, y));
  y = 0;
  yp = 0;
  send_msg(b[0], rec, 100, fds, nfds);
  EXPECT(vmm_arena_import_recv(im, b[1], 0, &y, &yp), VMM_ARENA_ERR_INVALID_ARGUMENT);
  CHECK(y == 0 && yp == 0);
  uint64_t imports = 1;
  OK(vmm_arena_sharing_stats(im, &imports, NULL, NULL));
  CHECK(imports == 0);
  for (size_t i = 0; i < nfds; i++)
    close(fds[i]);
  for (int i = 0; i < 2; i++) {
    close(a[i]);
    close(b[i]);
  }
  vmm_arena_export_close(e);
  vmm_arena_destroy(im);
  vmm_arena_destroy(ex);
}

int main(void) {
  test_in_one_process();
  test_refusals();
  test_partial_fields();
  test_seqpacket_record_too_long();
  unsigned long ef = export_faults(), imf = import_faults();
  printf("C ABI export/import fault matrix size: %lu (export %lu, import %lu)\n", ef + imf, ef, imf);
  test_two_processes();
  FINISH("test_export");
}
