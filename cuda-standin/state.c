/*
 * cuda-standin: initialisation, devices, contexts, error names, and the
 * report of violations and leaks at process exit. Rules are quoted (or
 * closely paraphrased) from NVIDIA's CUDA Driver API reference, 12.x.
 */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include "standin.h"

struct standin S = {.lock = PTHREAD_MUTEX_INITIALIZER};

/* ---- contexts ---------------------------------------------------------- */

/* One device, one primary context. A context handle is a pointer to one of
 * these; a reset makes a new one, so a stale handle stays recognisable. */
struct context {
  int alive;
  int magic;
  struct context *next; /* every incarnation stays listed (and reachable) */
};
static struct context *all_contexts;
#define CTX_MAGIC 0x43545821
static struct context *primary;  /* the current incarnation, or NULL */
static int primary_refs;
static __thread struct context *current;

static uint64_t env_u64(const char *name, uint64_t dflt) {
  const char *v = getenv(name);
  if (!v || !*v) return dflt;
  return strtoull(v, NULL, 0);
}

static void report_line(const char *kind, CUresult code, const char *call, const char *rule,
                        const char *fmt, va_list ap) {
  char msg[512];
  vsnprintf(msg, sizeof msg, fmt, ap);
  fprintf(stderr, "cuda-standin: %s in %s (-> %d): %s [rule: %s]\n", kind, call, code, msg, rule);
}

CUresult reject(CUresult code, const char *call, const char *rule, const char *fmt, ...) {
  S.rejections++;
  if (!S.quiet) {
    va_list ap;
    va_start(ap, fmt);
    report_line("refused", code, call, rule, fmt, ap);
    va_end(ap);
  }
  return code;
}

CUresult violation(CUresult code, const char *call, const char *rule, const char *fmt, ...) {
  S.violations++;
  va_list ap;
  va_start(ap, fmt);
  report_line("VIOLATION", code, call, rule, fmt, ap);
  va_end(ap);
  return code;
}

CUresult enter(const char *call) {
  pthread_mutex_lock(&S.lock);
  if (!S.initialised) {
    CUresult r = violation(CUDA_ERROR_NOT_INITIALIZED, call, "cuInit: if cuInit() has not been called, any "
                           "function from the driver API will return CUDA_ERROR_NOT_INITIALIZED", "no cuInit");
    pthread_mutex_unlock(&S.lock);
    return r;
  }
  return CUDA_SUCCESS;
}

CUresult enter_ctx(const char *call) {
  CUresult r = enter(call);
  if (r) return r;
  if (!current) {
    r = violation(CUDA_ERROR_INVALID_CONTEXT, call,
                  "driver API: calls that act on a context use the calling thread's current context; "
                  "CUDA_ERROR_INVALID_CONTEXT when none is current", "no context is current on this thread");
  } else if (!current->alive) {
    r = violation(CUDA_ERROR_CONTEXT_IS_DESTROYED, call,
                  "cuDevicePrimaryCtxRelease: the context is reset once the last reference is released; "
                  "a thread still holding it gets CUDA_ERROR_CONTEXT_IS_DESTROYED",
                  "this thread's current context was destroyed");
  }
  if (r) pthread_mutex_unlock(&S.lock);
  return r;
}

void leave(void) { pthread_mutex_unlock(&S.lock); }

/* ---- init and devices -------------------------------------------------- */

CUresult cuInit(unsigned flags) {
  pthread_mutex_lock(&S.lock);
  CUresult r = CUDA_SUCCESS;
  if (flags != 0) {
    r = reject(CUDA_ERROR_INVALID_VALUE, "cuInit", "cuInit: Flags: currently must be 0", "flags %u", flags);
  } else if (!S.initialised) {
    S.granularity = env_u64("CUDA_STANDIN_GRANULARITY", 2ull << 20);
    S.device_bytes = env_u64("CUDA_STANDIN_DEVICE_BYTES", 16ull << 30) / S.granularity * S.granularity;
    S.strict_unmap = (int)env_u64("CUDA_STANDIN_STRICT_UNMAP", 0);
    S.event_polls = (int)env_u64("CUDA_STANDIN_EVENT_POLLS", 0);
    S.quiet = (int)env_u64("CUDA_STANDIN_QUIET", 0);
    S.nslots = S.device_bytes / S.granularity;
    S.slots = calloc(S.nslots, 1);
    S.maps = calloc(MAX_MAPPINGS, sizeof *S.maps);
    S.pool_fd = memfd_create("cuda-standin-pool", MFD_CLOEXEC);
    if (!S.slots || !S.maps || S.pool_fd < 0 || ftruncate(S.pool_fd, (off_t)S.device_bytes) != 0) {
      fprintf(stderr, "cuda-standin: cannot set up %llu bytes of emulated device memory\n",
              (unsigned long long)S.device_bytes);
      r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
      /* One memfd per exportable allocation: allow many descriptors. */
      struct rlimit rl;
      if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
      }
      S.next_handle = 0x1000;
      S.initialised = 1;
    }
  }
  pthread_mutex_unlock(&S.lock);
  return r;
}

CUresult cuDriverGetVersion(int *v) {
  if (!v) return reject(CUDA_ERROR_INVALID_VALUE, "cuDriverGetVersion", "driverVersion must not be NULL", "NULL");
  *v = 12080;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *n) {
  CUresult r = enter("cuDeviceGetCount");
  if (r) return r;
  if (n) *n = 1;
  leave();
  return n ? CUDA_SUCCESS : reject(CUDA_ERROR_INVALID_VALUE, "cuDeviceGetCount", "count must not be NULL", "NULL");
}

CUresult cuDeviceGet(CUdevice *d, int ordinal) {
  CUresult r = enter("cuDeviceGet");
  if (r) return r;
  if (!d) r = reject(CUDA_ERROR_INVALID_VALUE, "cuDeviceGet", "device must not be NULL", "NULL");
  else if (ordinal != 0)
    r = reject(CUDA_ERROR_INVALID_DEVICE, "cuDeviceGet", "ordinal in [0, cuDeviceGetCount())", "ordinal %d", ordinal);
  else *d = 0;
  leave();
  return r;
}

static CUresult check_device(const char *call, CUdevice d) {
  if (d != 0) return reject(CUDA_ERROR_INVALID_DEVICE, call, "a device from cuDeviceGet", "device %d", d);
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
  CUresult r = enter("cuDeviceGetName");
  if (r) return r;
  if (!(r = check_device("cuDeviceGetName", d))) {
    if (!name || len <= 0) r = reject(CUDA_ERROR_INVALID_VALUE, "cuDeviceGetName", "name, len > 0", "len %d", len);
    else snprintf(name, (size_t)len, "cuda-standin (host memory)");
  }
  leave();
  return r;
}

CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) {
  CUresult r = enter("cuDeviceGetAttribute");
  if (r) return r;
  if (!(r = check_device("cuDeviceGetAttribute", d))) {
    if (!v) r = reject(CUDA_ERROR_INVALID_VALUE, "cuDeviceGetAttribute", "pi must not be NULL", "NULL");
    else if (attr == 102 || attr == 103) *v = 1; /* VMM supported; POSIX fd handles supported */
    else *v = 0;
  }
  leave();
  return r;
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) {
  CUresult r = enter("cuDeviceTotalMem");
  if (r) return r;
  if (!(r = check_device("cuDeviceTotalMem", d))) {
    if (!bytes) r = reject(CUDA_ERROR_INVALID_VALUE, "cuDeviceTotalMem", "bytes must not be NULL", "NULL");
    else *bytes = S.device_bytes;
  }
  leave();
  return r;
}

CUresult cuDeviceCanAccessPeer(int *v, CUdevice d, CUdevice peer) {
  CUresult r = enter("cuDeviceCanAccessPeer");
  if (r) return r;
  if (!(r = check_device("cuDeviceCanAccessPeer", d)) && !(r = check_device("cuDeviceCanAccessPeer", peer)))
    if (v) *v = 0;
  leave();
  return r;
}

/* ---- contexts ---------------------------------------------------------- */

CUresult cuDevicePrimaryCtxRetain(void **ctx, CUdevice d) {
  CUresult r = enter("cuDevicePrimaryCtxRetain");
  if (r) return r;
  if (!(r = check_device("cuDevicePrimaryCtxRetain", d))) {
    if (!ctx) {
      r = reject(CUDA_ERROR_INVALID_VALUE, "cuDevicePrimaryCtxRetain", "pctx must not be NULL", "NULL");
    } else {
      if (!primary) {
        primary = calloc(1, sizeof *primary);
        primary->alive = 1;
        primary->magic = CTX_MAGIC;
        primary->next = all_contexts;
        all_contexts = primary;
      }
      primary_refs++;
      *ctx = primary;
    }
  }
  leave();
  return r;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
  CUresult r = enter("cuDevicePrimaryCtxRelease");
  if (r) return r;
  if (!(r = check_device("cuDevicePrimaryCtxRelease", d))) {
    if (primary_refs == 0) {
      r = violation(CUDA_ERROR_INVALID_CONTEXT, "cuDevicePrimaryCtxRelease",
                    "cuDevicePrimaryCtxRelease: releases one reference taken by cuDevicePrimaryCtxRetain",
                    "no reference is held");
    } else if (--primary_refs == 0) {
      /* "The context is automatically reset once the last reference to it
       * is released": everything it owned goes; what was still live leaked. */
      flush_work(UINT64_MAX);
      int handles = 0;
      for (int i = 0; i < S.nallocs; i++) handles += S.allocs[i].handle && !S.allocs[i].released;
      if (handles || S.nmaps || S.nres || live_events() || live_host_allocs())
        violation(CUDA_SUCCESS, "cuDevicePrimaryCtxRelease", "leak: everything made in a context is released "
                  "before its last reference goes (the reset destroys it)",
                  "%d handles, %d mappings, %d reservations, %d events, %d host buffers still live at reset",
                  handles, S.nmaps, S.nres, live_events(), live_host_allocs());
      primary->alive = 0; /* kept allocated: stale handles stay recognisable */
      primary = NULL;
    }
  }
  leave();
  return r;
}

CUresult cuCtxGetCurrent(void **ctx) {
  CUresult r = enter("cuCtxGetCurrent");
  if (r) return r;
  if (!ctx) r = reject(CUDA_ERROR_INVALID_VALUE, "cuCtxGetCurrent", "pctx must not be NULL", "NULL");
  else *ctx = current;
  leave();
  return r;
}

CUresult cuCtxSetCurrent(void *ctx) {
  CUresult r = enter("cuCtxSetCurrent");
  if (r) return r;
  struct context *c = ctx;
  if (c && c->magic != CTX_MAGIC) {
    r = violation(CUDA_ERROR_INVALID_CONTEXT, "cuCtxSetCurrent", "a context handle from the driver", "%p", ctx);
  } else if (c && !c->alive) {
    r = violation(CUDA_ERROR_CONTEXT_IS_DESTROYED, "cuCtxSetCurrent",
                  "a context is usable until its last reference is released", "context %p was destroyed", ctx);
  } else {
    current = c;
  }
  leave();
  return r;
}

/* ---- error names ------------------------------------------------------- */

static const struct {
  int code;
  const char *name, *text;
} NAMES[] = {
    {0, "CUDA_SUCCESS", "no error"},
    {1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {208, "CUDA_ERROR_ALREADY_MAPPED", "resource already mapped"},
    {211, "CUDA_ERROR_NOT_MAPPED", "resource not mapped"},
    {400, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {600, "CUDA_ERROR_NOT_READY", "device not ready"},
    {700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {709, "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
    {800, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {801, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
};

static CUresult lookup(int code, const char **out, int text) {
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < sizeof NAMES / sizeof NAMES[0]; i++)
    if (NAMES[i].code == code) {
      *out = text ? NAMES[i].text : NAMES[i].name;
      return CUDA_SUCCESS;
    }
  *out = NULL;
  return CUDA_ERROR_INVALID_VALUE; /* "CUDA_ERROR_INVALID_VALUE if error is not a valid error code" */
}

CUresult cuGetErrorName(int code, const char **s) { return lookup(code, s, 0); }
CUresult cuGetErrorString(int code, const char **s) { return lookup(code, s, 1); }

/* ---- counters for the stand-in's own tests ------------------------------ */

unsigned long long cuda_standin_violations(void) { return S.violations; }
unsigned long long cuda_standin_rejections(void) { return S.rejections; }
/* Forgets counted violations (a test that provoked them on purpose). */
void cuda_standin_forgive(void) { S.violations = 0; }

/* ---- the exit report --------------------------------------------------- */

__attribute__((destructor)) static void report_at_exit(void) {
  if (!S.initialised || getenv("CUDA_STANDIN_NO_EXIT_REPORT")) return;
  pthread_mutex_lock(&S.lock);
  flush_work(UINT64_MAX);
  int handles = 0;
  for (int i = 0; i < S.nallocs; i++) handles += S.allocs[i].handle && !S.allocs[i].released;
  int events = live_events(), hosts = live_host_allocs();
  if (handles || S.nmaps || S.nres || events || hosts)
    violation(CUDA_SUCCESS, "process exit", "leak: every handle released, mapping unmapped, reservation "
              "freed, event destroyed and host buffer freed before exit",
              "%d handles, %d mappings, %d reservations, %d events, %d host buffers still live",
              handles, S.nmaps, S.nres, events, hosts);
  uint64_t v = S.violations;
  if (!S.quiet || v)
    fprintf(stderr, "cuda-standin: %llu violation(s), %llu refused call(s)\n", (unsigned long long)v,
            (unsigned long long)S.rejections);
  pthread_mutex_unlock(&S.lock);
  if (v) {
    fflush(NULL);
    _exit(86);
  }
}
