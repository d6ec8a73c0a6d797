/*
 * cuda-standin: asynchronous work, events and host memory. Device-to-device
 * copies, memsets and the device half of host-to-device copies are queued
 * (one in-order queue: the legacy default stream, with which every other
 * stream synchronizes) and run only when a documented wait needs them:
 * cuStreamSynchronize, cuCtxSynchronize, cuEventSynchronize, a completed
 * cuEventQuery, or a device-to-host copy. Rules cite the CUDA Driver API
 * reference (12.x), "API synchronization behavior", "Event Management".
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "standin.h"

enum { W_COPY, W_SET32 };
struct work {
  int kind;
  uint64_t dst, len;
  uint64_t src;   /* W_COPY: device source, or 0 with `stage` */
  void *stage;    /* W_COPY from host: the staged bytes */
  uint32_t value; /* W_SET32 */
};

static struct work *queue;
static uint64_t q_head, q_tail, q_cap; /* sequence numbers: [head, tail) pending */

int work_touches(uint64_t va, uint64_t size) {
  for (uint64_t s = q_head; s < q_tail; s++) {
    struct work *w = &queue[s % q_cap];
    uint64_t len = w->kind == W_SET32 ? w->len * 4 : w->len;
    if (w->dst < va + size && va < w->dst + len) return 1;
    if (w->kind == W_COPY && !w->stage && w->src < va + size && va < w->src + len) return 1;
  }
  return 0;
}

void flush_work(uint64_t upto) {
  while (q_head < q_tail && q_head < upto) {
    struct work *w = &queue[q_head % q_cap];
    /* Accessibility was checked when queued, and unmapping a range with
     * queued work is refused, so the bytes are still there. */
    if (w->kind == W_SET32) {
      uint32_t *p = (uint32_t *)w->dst;
      for (uint64_t i = 0; i < w->len; i++) p[i] = w->value;
    } else if (w->stage) {
      memcpy((void *)w->dst, w->stage, w->len);
      free(w->stage);
    } else {
      memmove((void *)w->dst, (const void *)w->src, w->len);
    }
    q_head++;
  }
}

static CUresult enqueue(struct work w) {
  if (q_tail - q_head == q_cap) {
    uint64_t cap = q_cap ? q_cap * 2 : 64;
    struct work *nq = malloc(cap * sizeof *nq);
    if (!nq) return CUDA_ERROR_OUT_OF_MEMORY;
    for (uint64_t s = q_head; s < q_tail; s++) nq[s % cap] = queue[s % q_cap];
    free(queue);
    queue = nq;
    q_cap = cap;
  }
  queue[q_tail++ % q_cap] = w;
  return CUDA_SUCCESS;
}

static CUresult device_range(const char *call, uint64_t va, uint64_t len, int need) {
  if (range_accessible(va, len, need)) return CUDA_SUCCESS;
  return violation(CUDA_ERROR_INVALID_VALUE, call, "device memory is accessed only where it is mapped and "
                   "cuMemSetAccess granted that access", "%#llx+%#llx (%s)", (unsigned long long)va,
                   (unsigned long long)len, need == 3 ? "write" : "read");
}

CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t len) {
  const char *call = "cuMemcpyDtoD";
  CUresult r = enter_ctx(call);
  if (r) return r;
  if (!(r = device_range(call, src, len, 1)) && !(r = device_range(call, dst, len, 3)))
    /* "For transfers from device memory to device memory, no host-side
     * synchronization is performed": queued. */
    r = enqueue((struct work){.kind = W_COPY, .dst = dst, .src = src, .len = len});
  leave();
  return r;
}

CUresult cuMemsetD32_v2(CUdeviceptr dst, unsigned value, size_t count) {
  const char *call = "cuMemsetD32";
  CUresult r = enter_ctx(call);
  if (r) return r;
  if (dst % 4) r = reject(CUDA_ERROR_INVALID_VALUE, call, "cuMemsetD32: dstDevice is 4-byte aligned", "%#llx", dst);
  else if (!(r = device_range(call, dst, count * 4, 3)))
    /* Memset on device memory is asynchronous with respect to the host. */
    r = enqueue((struct work){.kind = W_SET32, .dst = dst, .len = count, .value = value});
  leave();
  return r;
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t len) {
  const char *call = "cuMemcpyHtoD";
  CUresult r = enter_ctx(call);
  if (r) return r;
  if (!src) r = reject(CUDA_ERROR_INVALID_VALUE, call, "srcHost not NULL", "NULL");
  else if (!(r = device_range(call, dst, len, 3))) {
    /* "For transfers from pageable host memory to device memory, a stream
     * sync is performed before the copy is initiated. The function will
     * return once the pageable buffer has been copied to the staging memory
     * for DMA transfer to device memory, but the DMA to final destination
     * may not have completed." */
    flush_work(UINT64_MAX);
    void *stage = malloc(len ? len : 1);
    if (!stage) r = CUDA_ERROR_OUT_OF_MEMORY;
    else {
      memcpy(stage, src, len);
      r = enqueue((struct work){.kind = W_COPY, .dst = dst, .stage = stage, .len = len});
    }
  }
  leave();
  return r;
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t len) {
  const char *call = "cuMemcpyDtoH";
  CUresult r = enter_ctx(call);
  if (r) return r;
  if (!dst) r = reject(CUDA_ERROR_INVALID_VALUE, call, "dstHost not NULL", "NULL");
  else if (!(r = device_range(call, src, len, 1))) {
    /* "For transfers from device to either pageable or pinned host memory,
     * the function returns only once the copy has completed" (after the
     * work queued before it on the legacy stream). */
    flush_work(UINT64_MAX);
    memcpy(dst, (const void *)src, len);
  }
  leave();
  return r;
}

/* ---- streams ----------------------------------------------------------- */

/* The legacy default stream (0 or CU_STREAM_LEGACY = 0x1) and the per-thread
 * default stream (CU_STREAM_PER_THREAD = 0x2) are the only streams here. */
static CUresult check_stream(const char *call, uintptr_t s) {
  if (s <= 2) return CUDA_SUCCESS;
  return violation(CUDA_ERROR_INVALID_HANDLE, call, "a stream handle from cuStreamCreate, 0, CU_STREAM_LEGACY or "
                   "CU_STREAM_PER_THREAD (the stand-in creates no other streams)", "stream %#lx", (unsigned long)s);
}

CUresult cuStreamSynchronize(void *stream) {
  CUresult r = enter_ctx("cuStreamSynchronize");
  if (r) return r;
  if (!(r = check_stream("cuStreamSynchronize", (uintptr_t)stream))) flush_work(UINT64_MAX);
  leave();
  return r;
}

CUresult cuCtxSynchronize(void) {
  CUresult r = enter_ctx("cuCtxSynchronize");
  if (r) return r;
  flush_work(UINT64_MAX);
  leave();
  return r;
}

/* ---- events ------------------------------------------------------------ */

struct event {
  int magic;
  int destroyed;
  int recorded;
  uint64_t seq;   /* work before it: [.., seq) */
  int polls_left; /* NOT_READY answers still to give */
  struct event *next; /* every event stays listed (and reachable), destroyed or not */
};
static struct event *all_events;
#define EVENT_MAGIC 0x45564e54
static int events_live;

int live_events(void) { return events_live; }

static CUresult check_event(const char *call, struct event *e) {
  if (!e || e->magic != EVENT_MAGIC)
    return violation(CUDA_ERROR_INVALID_HANDLE, call, "an event from cuEventCreate", "%p", (void *)e);
  if (e->destroyed)
    return violation(CUDA_ERROR_INVALID_HANDLE, call, "an event is not used after cuEventDestroy", "%p", (void *)e);
  return CUDA_SUCCESS;
}

CUresult cuEventCreate(void **ev, unsigned flags) {
  CUresult r = enter_ctx("cuEventCreate");
  if (r) return r;
  if (!ev || (flags & ~0xfu)) {
    r = reject(CUDA_ERROR_INVALID_VALUE, "cuEventCreate", "CUevent_flags", "flags %#x", flags);
  } else {
    struct event *e = calloc(1, sizeof *e);
    e->magic = EVENT_MAGIC;
    e->next = all_events;
    all_events = e;
    events_live++;
    *ev = e;
  }
  leave();
  return r;
}

CUresult cuEventRecord(void *ev, void *stream) {
  CUresult r = enter_ctx("cuEventRecord");
  if (r) return r;
  struct event *e = ev;
  if (!(r = check_event("cuEventRecord", e)) && !(r = check_stream("cuEventRecord", (uintptr_t)stream))) {
    e->recorded = 1;
    e->seq = q_tail;
    e->polls_left = S.event_polls;
  }
  leave();
  return r;
}

static void complete(struct event *e) {
  flush_work(e->seq);
  e->polls_left = 0;
}

CUresult cuEventQuery(void *ev) {
  CUresult r = enter_ctx("cuEventQuery");
  if (r) return r;
  struct event *e = ev;
  if (!(r = check_event("cuEventQuery", e)) && e->recorded) {
    /* Work finishes when waited for, or after CUDA_STANDIN_EVENT_POLLS
     * queries answered CUDA_ERROR_NOT_READY. */
    if (e->polls_left > 0) {
      e->polls_left--;
      r = CUDA_ERROR_NOT_READY;
    } else {
      complete(e);
    }
  }
  leave();
  return r;
}

CUresult cuEventSynchronize(void *ev) {
  CUresult r = enter_ctx("cuEventSynchronize");
  if (r) return r;
  struct event *e = ev;
  if (!(r = check_event("cuEventSynchronize", e)) && e->recorded) complete(e);
  leave();
  return r;
}

CUresult cuEventDestroy_v2(void *ev) {
  CUresult r = enter_ctx("cuEventDestroy");
  if (r) return r;
  struct event *e = ev;
  /* "In case hEvent has been recorded but has not completed yet ... the
   * function will return immediately and the resources ... released once
   * the device has completed hEvent": legal. The struct is kept (marked)
   * so that a use after destroy is recognised. */
  if (!(r = check_event("cuEventDestroy", e))) {
    e->destroyed = 1;
    events_live--;
  }
  leave();
  return r;
}

/* ---- page-locked host memory ------------------------------------------- */

struct host_block {
  void *p;
  struct host_block *next;
};
static struct host_block *hosts;
static int hosts_live;

int live_host_allocs(void) { return hosts_live; }

CUresult cuMemHostAlloc(void **pp, size_t len, unsigned flags) {
  CUresult r = enter_ctx("cuMemHostAlloc");
  if (r) return r;
  struct host_block *b = NULL;
  if (!pp || len == 0 || (flags & ~0xfu)) {
    r = reject(CUDA_ERROR_INVALID_VALUE, "cuMemHostAlloc", "pp not NULL, bytesize > 0, known flags", "len %zu", len);
  } else if (!(b = malloc(sizeof *b)) || !(b->p = malloc(len))) {
    free(b);
    r = CUDA_ERROR_OUT_OF_MEMORY;
  } else {
    b->next = hosts;
    hosts = b;
    hosts_live++;
    *pp = b->p;
  }
  leave();
  return r;
}

CUresult cuMemFreeHost(void *p) {
  CUresult r = enter_ctx("cuMemFreeHost");
  if (r) return r;
  struct host_block **at = &hosts;
  while (*at && (*at)->p != p) at = &(*at)->next;
  if (!*at) {
    r = violation(CUDA_ERROR_INVALID_VALUE, "cuMemFreeHost", "cuMemFreeHost frees memory from cuMemHostAlloc, "
                  "once", "%p", p);
  } else {
    struct host_block *b = *at;
    *at = b->next;
    free(b->p);
    free(b);
    hosts_live--;
  }
  leave();
  return r;
}
