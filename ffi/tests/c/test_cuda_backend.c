/*
 * The C ABI on the CUDA backend: an arena on device 0 through alloc,
 * growth (in place and by moving), compaction, shrinks, stream-ordered
 * frees and shrinks, quiesce, sleep with backup and wake, trim and destroy,
 * with the bytes checked through the driver's own copies (libcuda is
 * opened here with dlopen, the program's primary context retained and made
 * current, as a CUDA runtime would). Also checks that the arena leaves the
 * calling thread's context as it found it: the program's own, or none on
 * a thread that had none.
 *
 * Without a usable CUDA driver it prints why and passes, unless
 * VMM_ARENA_REQUIRE_GPU=1. CI runs it against cuda-standin (both unmap
 * readings); on a GPU machine it runs against the real driver.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "check.h"

typedef int (*fn_init)(unsigned);
typedef int (*fn_device_get)(int *, int);
typedef int (*fn_retain)(void **, int);
typedef int (*fn_release)(int);
typedef int (*fn_set_current)(void *);
typedef int (*fn_get_current)(void **);
typedef int (*fn_htod)(uint64_t, const void *, size_t);
typedef int (*fn_dtoh)(void *, uint64_t, size_t);

static struct {
  fn_init init;
  fn_device_get device_get;
  fn_retain retain;
  fn_release release;
  fn_set_current set_current;
  fn_get_current get_current;
  fn_htod htod;
  fn_dtoh dtoh;
} cu;

#define MIB (1ull << 20)

static int load_cuda(void) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (!lib) lib = dlopen("libcuda.so", RTLD_NOW);
  if (!lib) return 0;
  cu.init = (fn_init)dlsym(lib, "cuInit");
  cu.device_get = (fn_device_get)dlsym(lib, "cuDeviceGet");
  cu.retain = (fn_retain)dlsym(lib, "cuDevicePrimaryCtxRetain");
  cu.release = (fn_release)dlsym(lib, "cuDevicePrimaryCtxRelease_v2");
  cu.set_current = (fn_set_current)dlsym(lib, "cuCtxSetCurrent");
  cu.get_current = (fn_get_current)dlsym(lib, "cuCtxGetCurrent");
  cu.htod = (fn_htod)dlsym(lib, "cuMemcpyHtoD_v2");
  cu.dtoh = (fn_dtoh)dlsym(lib, "cuMemcpyDtoH_v2");
  return cu.init && cu.device_get && cu.retain && cu.release && cu.set_current && cu.get_current && cu.htod &&
         cu.dtoh;
}

static void *current(void) {
  void *ctx = (void *)1;
  CHECK(cu.get_current(&ctx) == 0);
  return ctx;
}

static unsigned char pattern_byte(uint64_t i, unsigned seed) { return (unsigned char)(i * 31u + seed); }

static void fill(uint64_t ptr, uint64_t len, unsigned seed) {
  unsigned char *buf = malloc(len);
  CHECK(buf != NULL);
  for (uint64_t i = 0; i < len; i++) buf[i] = pattern_byte(i, seed);
  CHECK(cu.htod(ptr, buf, len) == 0);
  free(buf);
}

static void expect_bytes(uint64_t ptr, uint64_t len, unsigned seed) {
  unsigned char *buf = malloc(len);
  CHECK(buf != NULL);
  CHECK(cu.dtoh(buf, ptr, len) == 0);
  uint64_t bad = 0;
  for (uint64_t i = 0; i < len; i++) bad += buf[i] != pattern_byte(i, seed);
  free(buf);
  CHECK(bad == 0);
}

static vmm_arena_stats stats_of(vmm_arena *a) {
  vmm_arena_stats s;
  memset(&s, 0, sizeof s);
  s.struct_size = sizeof s;
  OK(vmm_arena_stats_get(a, &s));
  return s;
}

static uint64_t ptr_of(vmm_arena *a, vmm_arena_id id) {
  uint64_t ptr = 0, size = 0;
  OK(vmm_arena_query(a, id, &ptr, &size));
  return ptr;
}

/* A thread with no context: an arena's life leaves it with none. */
static void *contextless_thread(void *arg) {
  vmm_arena_config *cfg = arg;
  CHECK(current() == NULL);
  vmm_arena *a = NULL;
  vmm_arena_id id;
  uint64_t p;
  OK(vmm_arena_create(cfg, &a));
  CHECK(current() == NULL);
  OK(vmm_arena_alloc(a, 3 * MIB, &id, &p));
  OK(vmm_arena_free(a, id));
  vmm_arena_destroy(a);
  CHECK(current() == NULL);
  return NULL;
}

int main(void) {
  setvbuf(stdout, NULL, _IONBF, 0);
  const char *require = getenv("VMM_ARENA_REQUIRE_GPU");
  int required = require && strcmp(require, "1") == 0;
  vmm_arena_config cfg;
  vmm_arena_config_default(&cfg);
  CHECK(cfg.backend == VMM_ARENA_BACKEND_CUDA);
  cfg.capacity_bytes = 64 * MIB;
  cfg.reserve_bytes = 256 * MIB;
  vmm_arena *a = NULL;
  vmm_arena_status s = vmm_arena_create(&cfg, &a);
  if (s == VMM_ARENA_ERR_UNSUPPORTED && !required) {
    printf("no usable CUDA driver (%s): skipped\n", vmm_arena_last_error());
    FINISH("test_cuda_backend");
  }
  OK(s);
  CHECK(load_cuda());
  int dev = -1;
  void *ctx = NULL;
  CHECK(cu.init(0) == 0 && cu.device_get(&dev, 0) == 0 && cu.retain(&ctx, dev) == 0);
  CHECK(cu.set_current(ctx) == 0);

  /* Growth in place, growth by moving, compaction: bytes follow. */
  vmm_arena_id x, y, z;
  uint64_t px, py, pz;
  OK(vmm_arena_alloc(a, 3 * MIB, &x, &px));
  OK(vmm_arena_alloc(a, 2 * MIB, &y, &py));
  fill(px, 3 * MIB, 1);
  fill(py, 2 * MIB, 2);
  CHECK(current() == ctx); /* the program's own context stays current */
  OK(vmm_arena_resize(a, x, 9 * MIB, &px));
  expect_bytes(px, 3 * MIB, 1);
  expect_bytes(ptr_of(a, y), 2 * MIB, 2);
  OK(vmm_arena_alloc_growable(a, 2 * MIB, 16 * MIB, &z, &pz));
  fill(pz, 2 * MIB, 3);
  OK(vmm_arena_resize(a, z, 12 * MIB, &pz));
  expect_bytes(pz, 2 * MIB, 3);
  OK(vmm_arena_free(a, y));
  OK(vmm_arena_compact(a, NULL));
  expect_bytes(ptr_of(a, x), 3 * MIB, 1);
  expect_bytes(ptr_of(a, z), 2 * MIB, 3);

  /* Shrinks: plain and stream-ordered (the legacy default stream, 0). */
  OK(vmm_arena_resize(a, x, 1 * MIB, &px));
  expect_bytes(px, 1 * MIB, 1);
  OK(vmm_arena_resize_on_stream(a, z, 3 * MIB, 0, &pz));
  expect_bytes(pz, 2 * MIB, 3);
  OK(vmm_arena_quiesce_on_stream(a, x, 0));
  OK(vmm_arena_unquiesce(a, x));

  /* Stream-ordered frees: the memory comes back once the event completes. */
  vmm_arena_id w;
  uint64_t pw;
  OK(vmm_arena_alloc(a, 4 * MIB, &w, &pw));
  fill(pw, 4 * MIB, 4);
  OK(vmm_arena_free_on_stream(a, w, 0));
  for (int i = 0; i < 8; i++) {
    vmm_arena_id t;
    uint64_t pt;
    OK(vmm_arena_alloc(a, 40 * MIB, &t, &pt)); /* needs the freed chunks, eventually by waiting */
    OK(vmm_arena_free(a, t));
  }

  /* Sleep with backup, wake: the bytes come back at the same address. */
  OK(vmm_arena_set_tag(a, x, 7));
  OK(vmm_arena_sleep(a, 7, VMM_ARENA_SLEEP_BACKUP));
  CHECK(stats_of(a).mapped_bytes < 20 * MIB);
  OK(vmm_arena_wake(a, 7));
  CHECK(ptr_of(a, x) == px);
  expect_bytes(px, 1 * MIB, 1);

  /* DMA-BUF (cuMemGetHandleForAddressRange; on cuda-standin a descriptor
   * whose memory must stay mapped where it is while it is open, which the
   * stand-in enforces): a free while it is open keeps the chunks mapped;
   * trim, compaction and sleep leave them; a shrink below them is refused;
   * once it is closed, the next operation gives them back to the driver.
   * A device without DMA-BUF support answers UNSUPPORTED. */
  vmm_arena_id d;
  uint64_t pd;
  OK(vmm_arena_alloc(a, 4 * MIB, &d, &pd));
  fill(pd, 4 * MIB, 5);
  vmm_arena_dmabuf *buf = NULL;
  vmm_arena_status ds = vmm_arena_dmabuf_open(a, d, &buf);
  if (ds == VMM_ARENA_ERR_UNSUPPORTED) {
    printf("DMA-BUF not supported by this driver: %s\n", vmm_arena_last_error());
    OK(vmm_arena_free(a, d));
  } else {
    OK(ds);
    int32_t dfd = -1;
    uint64_t dbytes = 0;
    OK(vmm_arena_dmabuf_fd(buf, &dfd, &dbytes));
    CHECK(dfd >= 0 && dbytes == 4 * MIB);
    EXPECT(vmm_arena_resize(a, d, 2 * MIB, &pd), VMM_ARENA_ERR_INVALID_ARGUMENT);
    uint64_t mapped_open = stats_of(a).mapped_bytes;
    OK(vmm_arena_free(a, d));
    OK(vmm_arena_trim(a, 0, NULL));
    OK(vmm_arena_compact(a, NULL));
    OK(vmm_arena_sleep(a, VMM_ARENA_ALL_TAGS, VMM_ARENA_SLEEP_BACKUP));
    OK(vmm_arena_wake(a, VMM_ARENA_ALL_TAGS));
    CHECK(stats_of(a).mapped_bytes == mapped_open); /* still held: mapped where they were */
    vmm_arena_dmabuf_close(buf);
    OK(vmm_arena_trim(a, 0, NULL)); /* the first operation after the close releases them */
    CHECK(stats_of(a).mapped_bytes == mapped_open - 4 * MIB);
  }
  expect_bytes(ptr_of(a, x), 1 * MIB, 1);

  /* Trim gives pooled chunks back; the stats agree with what is live. */
  uint64_t released = 0;
  OK(vmm_arena_trim(a, 0, &released));
  vmm_arena_stats st = stats_of(a);
  CHECK(st.live_allocations == 2);
  CHECK(st.pooled_bytes == 0);
  CHECK(st.mapped_bytes == (1 + 2) * 2 * MIB); /* whole 2 MiB chunks: 1 MiB and 3 MiB */
  OK(vmm_arena_free(a, x));
  OK(vmm_arena_free(a, z));
  vmm_arena_destroy(a);
  CHECK(current() == ctx);

  /* A thread that had no context has none after an arena's whole life. */
  pthread_t t;
  CHECK(pthread_create(&t, NULL, contextless_thread, &cfg) == 0);
  CHECK(pthread_join(t, NULL) == 0);

  CHECK(cu.set_current(NULL) == 0);
  CHECK(cu.release(dev) == 0);
  FINISH("test_cuda_backend");
}
