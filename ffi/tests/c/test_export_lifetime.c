/*
 * Lifetimes of what leaves an arena, through the C ABI, on the host backend,
 * under -fsanitize=address,undefined:
 *  - DMA-BUF handles (the host driver's stand-in, on in faulty arenas):
 *    close-on-exec; pinned while open; a free keeps the chunks until the
 *    close, and another allocation never shows through the DMA-BUF; a
 *    shrink below it refused, sleep leaves it awake; a fault matrix over
 *    vmm_arena_dmabuf_open;
 *  - vmm_arena_export_fds hands out duplicates the caller owns;
 *  - the layout record's minimum-size semantics (a version 1 caller's
 *    32-byte struct, a larger future one, reserved fields);
 *  - an export of more than VMM_ARENA_FDS_PER_MESSAGE chunks sent to a
 *    forked process in one vmm_arena_export_send / vmm_arena_import_recv;
 *  - an import of a sealed memfd no arena made is refused.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include "vmm_arena.h"
#include "check.h"

vmm_arena_status vmm_arena_testing_create_faulty(const vmm_arena_config *config, vmm_arena **out);
vmm_arena_status vmm_arena_testing_fail_nth(vmm_arena *arena, uint32_t call_kind, uint64_t n, uint32_t fault);
vmm_arena_status vmm_arena_testing_driver_objects(vmm_arena *arena, uint64_t *out_chunks, uint64_t *out_mappings);
vmm_arena_status vmm_arena_testing_driver_calls(vmm_arena *arena, uint64_t *out_calls, uint64_t *out_injected);
vmm_arena_status vmm_arena_testing_dmabuf_io(vmm_arena *arena, int32_t fd, uint64_t offset, uint8_t *buf, size_t len,
                                             uint32_t write);

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

static vmm_arena *faulty(uint32_t flags, uint64_t chunks) {
  vmm_arena_config c = config(flags, chunks);
  vmm_arena *a = NULL;
  OK(vmm_arena_testing_create_faulty(&c, &a));
  return a;
}

static vmm_arena *plain(uint32_t flags, uint64_t chunks) {
  vmm_arena_config c = config(flags, chunks);
  vmm_arena *a = NULL;
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

static uint64_t driver_chunks(vmm_arena *a) {
  uint64_t chunks = 0, mappings = 0;
  OK(vmm_arena_testing_driver_objects(a, &chunks, &mappings));
  return chunks;
}

static int cloexec(int fd) {
  int f = fcntl(fd, F_GETFD);
  return f >= 0 && (f & FD_CLOEXEC);
}

static void dmabuf_lifetime(void) {
  vmm_arena *a = faulty(0, 4);
  vmm_arena_id x = 0, y = 0;
  uint64_t xp = 0, yp = 0, bytes = 0;
  OK(vmm_arena_alloc(a, 2 * K, &x, &xp));
  memset((void *)(uintptr_t)xp, 0xAA, 2 * K);
  vmm_arena_dmabuf *d = NULL;
  OK(vmm_arena_dmabuf_open(a, x, &d));
  int32_t fd = -1;
  OK(vmm_arena_dmabuf_fd(d, &fd, &bytes));
  CHECK(fd >= 0 && bytes == 2 * K && cloexec(fd));
  EXPECT(vmm_arena_dmabuf_fd(NULL, &fd, NULL), VMM_ARENA_ERR_INVALID_ARGUMENT);
  /* Pinned while open; no shrink below it; sleep leaves it awake. */
  EXPECT(vmm_arena_resize(a, x, K, &xp), VMM_ARENA_ERR_INVALID_ARGUMENT);
  OK(vmm_arena_set_tag(a, x, 5));
  OK(vmm_arena_sleep(a, 5, 0));
  uint64_t qp = 0, qs = 0;
  OK(vmm_arena_query(a, x, &qp, &qs));
  CHECK(qp == xp && ((uint8_t *)(uintptr_t)xp)[0] == 0xAA);
  /* A free keeps the chunks; the next allocation never shows through. */
  OK(vmm_arena_free(a, x));
  EXPECT(vmm_arena_query(a, x, &qp, &qs), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
  CHECK(stats_of(a).mapped_bytes == 2 * K);
  EXPECT(vmm_arena_alloc(a, 3 * K, &y, &yp), VMM_ARENA_ERR_OUT_OF_MEMORY);
  OK(vmm_arena_alloc(a, 2 * K, &y, &yp));
  memset((void *)(uintptr_t)yp, 0xBB, 2 * K);
  uint8_t *seen = malloc(2 * K);
  CHECK(seen != NULL);
  OK(vmm_arena_testing_dmabuf_io(a, fd, 0, seen, 2 * K, 0));
  int foreign = 0;
  for (uint64_t i = 0; i < 2 * K; i++) foreign |= seen[i] != 0xAA;
  CHECK(!foreign);
  memset(seen, 0xCC, 2 * K);
  OK(vmm_arena_testing_dmabuf_io(a, fd, 0, seen, 2 * K, 1));
  CHECK(((uint8_t *)(uintptr_t)yp)[0] == 0xBB && ((uint8_t *)(uintptr_t)yp)[2 * K - 1] == 0xBB);
  free(seen);
  CHECK(driver_chunks(a) == 4);
  vmm_arena_dmabuf_close(d);
  vmm_arena_dmabuf_close(NULL);
  /* The next call gives the held chunks back to the driver. */
  uint64_t released = 0;
  OK(vmm_arena_trim(a, 0, &released));
  CHECK(driver_chunks(a) == 2);
  vmm_arena_stats s = stats_of(a);
  CHECK(s.mapped_bytes == 2 * K && s.pooled_bytes == 0);
  /* The handle-less call keeps its allocation's chunks until destroy. */
  int32_t legacy = -1;
  OK(vmm_arena_export_dmabuf(a, y, &legacy));
  CHECK(legacy >= 0 && cloexec(legacy));
  OK(vmm_arena_free(a, y));
  CHECK(driver_chunks(a) == 2);
  close(legacy);
  OK(vmm_arena_trim(a, 0, &released));
  CHECK(driver_chunks(a) == 2);
  vmm_arena_destroy(a);
  /* Without the stand-in the host has none. */
  vmm_arena *p = plain(0, 4);
  OK(vmm_arena_alloc(p, 2 * K, &x, &xp));
  d = NULL;
  EXPECT(vmm_arena_dmabuf_open(p, x, &d), VMM_ARENA_ERR_UNSUPPORTED);
  CHECK(d == NULL);
  OK(vmm_arena_resize(p, x, K, &xp)); /* nothing was marked */
  vmm_arena_destroy(p);
}

/* Every driver call of vmm_arena_dmabuf_open fails in turn, both kinds. */
static unsigned long dmabuf_faults(void) {
  unsigned long n = 0;
  vmm_arena *twin = faulty(0, 8);
  vmm_arena_id x = 0, b = 0;
  uint64_t xp = 0, bp = 0, c0 = 0, c1 = 0, inj = 0;
  OK(vmm_arena_alloc(twin, K, &x, &xp));
  OK(vmm_arena_alloc(twin, K, &b, &bp));
  OK(vmm_arena_resize(twin, x, 2 * K, &xp)); /* moves: a retired range */
  OK(vmm_arena_testing_driver_calls(twin, &c0, &inj));
  vmm_arena_dmabuf *d = NULL;
  OK(vmm_arena_dmabuf_open(twin, x, &d));
  OK(vmm_arena_testing_driver_calls(twin, &c1, &inj));
  vmm_arena_dmabuf_close(d);
  vmm_arena_destroy(twin);
  uint64_t calls = c1 - c0;
  CHECK(calls >= 3);
  for (uint64_t i = 1; i <= calls; i++) {
    for (uint32_t kind = 0; kind < 2; kind++) {
      vmm_arena *a = faulty(0, 8);
      OK(vmm_arena_alloc(a, K, &x, &xp));
      OK(vmm_arena_alloc(a, K, &b, &bp));
      OK(vmm_arena_resize(a, x, 2 * K, &xp));
      vmm_arena_stats before = stats_of(a);
      uint64_t chunks = driver_chunks(a);
      OK(vmm_arena_testing_fail_nth(a, 0, i, kind));
      d = NULL;
      EXPECT(vmm_arena_dmabuf_open(a, x, &d), kind == 0 ? VMM_ARENA_ERR_OUT_OF_MEMORY : VMM_ARENA_ERR_DRIVER);
      CHECK(d == NULL);
      vmm_arena_stats after = stats_of(a);
      CHECK(after.mapped_bytes == before.mapped_bytes && after.retired_va_bytes == before.retired_va_bytes);
      CHECK(driver_chunks(a) == chunks);
      uint64_t n_exp = 1;
      OK(vmm_arena_sharing_stats(a, NULL, NULL, &n_exp));
      CHECK(n_exp == 0);
      OK(vmm_arena_dmabuf_open(a, x, &d)); /* a retry works */
      vmm_arena_dmabuf_close(d);
      vmm_arena_destroy(a);
      n++;
    }
  }
  return n;
}

static void fds_are_the_callers(void) {
  vmm_arena *ex = plain(VMM_ARENA_FLAG_EXPORTABLE, 8);
  vmm_arena *im = plain(0, 8);
  vmm_arena_id x = 0, y = 0;
  uint64_t xp = 0, yp = 0;
  OK(vmm_arena_alloc(ex, 3 * K, &x, &xp));
  memcpy((void *)(uintptr_t)xp, "owned", 5);
  vmm_arena_export *e = NULL;
  OK(vmm_arena_export_open(ex, x, &e));
  int32_t fds[3] = {-1, -1, -1}, again[3] = {-1, -1, -1};
  size_t n = 0;
  OK(vmm_arena_export_fds(e, fds, 3, &n));
  CHECK(n == 3 && cloexec(fds[0]) && cloexec(fds[2]));
  OK(vmm_arena_export_fds(e, again, 3, &n));
  CHECK(again[0] != fds[0]); /* a new duplicate each call */
  for (int i = 0; i < 3; i++) close(fds[i]); /* the caller's to close */
  vmm_arena_export_layout l;
  memset(&l, 0, sizeof l);
  l.struct_size = sizeof l;
  OK(vmm_arena_export_layout_get(e, &l));
  CHECK(l.version == VMM_ARENA_EXPORT_FORMAT_VERSION && l.handle_type == VMM_ARENA_EXPORT_HANDLE_HOST_MEMFD);
  CHECK(l.device == -1 && l.backend == VMM_ARENA_BACKEND_HOST);
  OK(vmm_arena_import(im, &l, again, 3, VMM_ARENA_IMPORT_READ_ONLY, &y, &yp));
  CHECK(memcmp((void *)(uintptr_t)yp, "owned", 5) == 0);
  for (int i = 0; i < 3; i++) close(again[i]);
  OK(vmm_arena_free(im, y));

  /* Minimum-size semantics. A version 1 caller's 32-byte record: only
   * those bytes are written, and it imports. */
  unsigned char raw[sizeof(vmm_arena_export_layout) + 16];
  memset(raw, 0x5A, sizeof raw);
  vmm_arena_export_layout *v1 = (vmm_arena_export_layout *)raw;
  v1->struct_size = VMM_ARENA_EXPORT_LAYOUT_MIN_SIZE;
  OK(vmm_arena_export_layout_get(e, v1));
  CHECK(raw[VMM_ARENA_EXPORT_LAYOUT_MIN_SIZE] == 0x5A); /* untouched past it */
  OK(vmm_arena_export_fds(e, again, 3, &n));
  OK(vmm_arena_import(im, v1, again, 3, 0, &y, &yp));
  OK(vmm_arena_free(im, y));
  /* Too small: refused. */
  v1->struct_size = VMM_ARENA_EXPORT_LAYOUT_MIN_SIZE - 8;
  EXPECT(vmm_arena_export_layout_get(e, v1), VMM_ARENA_ERR_INVALID_ARGUMENT);
  EXPECT(vmm_arena_import(im, v1, again, 3, 0, &y, &yp), VMM_ARENA_ERR_INVALID_ARGUMENT);
  /* A later version's larger record: read up to our size. */
  memset(raw, 0, sizeof raw);
  v1->struct_size = sizeof raw;
  OK(vmm_arena_export_layout_get(e, v1));
  OK(vmm_arena_import(im, v1, again, 3, 0, &y, &yp));
  OK(vmm_arena_free(im, y));
  /* Reserved fields must be zero; another handle type is refused. */
  vmm_arena_export_layout bad = l;
  bad.reserved[2] = 1;
  EXPECT(vmm_arena_import(im, &bad, again, 3, 0, &y, &yp), VMM_ARENA_ERR_INVALID_ARGUMENT);
  bad = l;
  bad.handle_type = VMM_ARENA_EXPORT_HANDLE_CUDA_POSIX_FD;
  EXPECT(vmm_arena_import(im, &bad, again, 3, 0, &y, &yp), VMM_ARENA_ERR_INVALID_ARGUMENT);
  for (int i = 0; i < 3; i++) close(again[i]);

  /* A sealed memfd the caller made is no exported chunk. */
  int m = memfd_create("not-a-chunk", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  CHECK(m >= 0 && ftruncate(m, (off_t)K) == 0);
  CHECK(fcntl(m, F_ADD_SEALS, F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL) == 0);
  vmm_arena_export_layout one = l;
  one.chunk_count = 1;
  one.size = K;
  EXPECT(vmm_arena_import(im, &one, &m, 1, 0, &y, &yp), VMM_ARENA_ERR_INVALID_ARGUMENT);
  close(m);
  vmm_arena_export_close(e);
  vmm_arena_destroy(im);
  vmm_arena_destroy(ex);
}

/* 300 chunks (more than one message carries) to a forked child in one call. */
static void send_to_a_child(void) {
  const uint64_t chunks = 300;
  CHECK(chunks > VMM_ARENA_FDS_PER_MESSAGE);
  vmm_arena *ex = plain(VMM_ARENA_FLAG_EXPORTABLE, chunks + 4);
  vmm_arena_id x = 0;
  uint64_t xp = 0;
  OK(vmm_arena_alloc(ex, chunks * K, &x, &xp));
  for (uint64_t i = 0; i < chunks; i++) memcpy((void *)(uintptr_t)(xp + i * K + 16), &i, sizeof i);
  vmm_arena_export *e = NULL;
  OK(vmm_arena_export_open(ex, x, &e));
  int sv[2];
  CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
  struct timeval tv = {10, 0};
  CHECK(setsockopt(sv[1], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) == 0);
  fflush(NULL);
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    close(sv[0]);
    vmm_arena *im = plain(0, 4);
    vmm_arena_id y = 0;
    uint64_t yp = 0;
    if (vmm_arena_import_recv(im, sv[1], 0, &y, &yp) != VMM_ARENA_OK) _exit(2);
    for (uint64_t i = 0; i < chunks; i++) {
      uint64_t v = 0;
      memcpy(&v, (void *)(uintptr_t)(yp + i * K + 16), sizeof v);
      if (v != i) _exit(3);
    }
    if (vmm_arena_free(im, y) != VMM_ARENA_OK) _exit(4);
    vmm_arena_destroy(im);
    _exit(0);
  }
  close(sv[1]);
  OK(vmm_arena_export_send(e, sv[0]));
  EXPECT(vmm_arena_export_send(e, -1), VMM_ARENA_ERR_INVALID_ARGUMENT);
  int status = 0;
  CHECK(waitpid(pid, &status, 0) == pid);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  close(sv[0]);
  vmm_arena_export_close(e);
  vmm_arena_destroy(ex);
}

int main(void) {
  dmabuf_lifetime();
  unsigned long faults = dmabuf_faults();
  printf("C ABI DMA-BUF fault matrix size: %lu\n", faults);
  fds_are_the_callers();
  send_to_a_child();
  FINISH("test_export_lifetime");
}
