/*
 * The stand-in's own test: every rule it enforces, broken once on purpose,
 * is caught (the documented error code, and a counted violation where the
 * rule is one). Run by .ci/run with CUDA_STANDIN_STRICT_UNMAP=1.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../standin.h"

CUresult cuMemGetHandleForAddressRange(void *, CUdeviceptr, size_t, int, unsigned long long);
CUresult cuInit(unsigned);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDevicePrimaryCtxRetain(void **, CUdevice);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice);
CUresult cuCtxSetCurrent(void *);
CUresult cuCtxGetCurrent(void **);
CUresult cuCtxSynchronize(void);
CUresult cuMemAddressReserve(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult cuMemAddressFree(CUdeviceptr, size_t);
CUresult cuMemCreate(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
CUresult cuMemRelease(CUmemGenericAllocationHandle);
CUresult cuMemMap(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
CUresult cuMemSetAccess(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
CUresult cuMemUnmap(CUdeviceptr, size_t);
CUresult cuMemcpyHtoD_v2(CUdeviceptr, const void *, size_t);
CUresult cuMemcpyDtoH_v2(void *, CUdeviceptr, size_t);
CUresult cuMemcpyDtoD_v2(CUdeviceptr, CUdeviceptr, size_t);
CUresult cuEventCreate(void **, unsigned);
CUresult cuEventRecord(void *, void *);
CUresult cuEventQuery(void *);
CUresult cuEventSynchronize(void *);
CUresult cuEventDestroy_v2(void *);
CUresult cuMemHostAlloc(void **, size_t, unsigned);
CUresult cuMemFreeHost(void *);
CUresult cuMemExportToShareableHandle(void *, CUmemGenericAllocationHandle, int, unsigned long long);
CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *, void *, int);
unsigned long long cuda_standin_violations(void);
unsigned long long cuda_standin_rejections(void);
void cuda_standin_forgive(void);

static int failures;
static unsigned long long v0, r0;
#define G (2ull << 20)

/* A call must give `want`; `violates`: it must also count a violation. */
static void expect(const char *what, CUresult got, CUresult want, int violates) {
  unsigned long long v = cuda_standin_violations(), rj = cuda_standin_rejections();
  int counted = violates ? v > v0 : (want == CUDA_SUCCESS || want == CUDA_ERROR_NOT_READY || rj > r0);
  if (got != want || !counted || (!violates && v != v0)) {
    printf("FAIL %s: got %d want %d (violations %llu -> %llu, refusals %llu -> %llu)\n", what, got, want, v0, v,
           r0, rj);
    failures++;
  } else {
    printf("ok   %s\n", what);
  }
  v0 = v;
  r0 = rj;
}

static CUmemAllocationProp prop(int exportable) {
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = 1;
  p.location.type = 1;
  p.requestedHandleTypes = exportable;
  return p;
}

int main(void) {
  CUmemAllocationProp p = prop(0), px = prop(1);
  CUmemAccessDesc rw = {{1, 0}, 3};
  CUmemGenericAllocationHandle a, b, c;
  CUdeviceptr va;
  void *ctx, *cur, *ev;
  CUdevice dev;
  int strict = getenv("CUDA_STANDIN_STRICT_UNMAP") && atoi(getenv("CUDA_STANDIN_STRICT_UNMAP"));

  expect("any call before cuInit is CUDA_ERROR_NOT_INITIALIZED", cuDeviceGet(&dev, 0), CUDA_ERROR_NOT_INITIALIZED, 1);
  expect("cuInit", cuInit(0), CUDA_SUCCESS, 0);
  expect("cuDeviceGet", cuDeviceGet(&dev, 0), CUDA_SUCCESS, 0);
  expect("memory calls need a current context", cuMemCreate(&a, G, &p, 0), CUDA_ERROR_INVALID_CONTEXT, 1);
  expect("retain", cuDevicePrimaryCtxRetain(&ctx, dev), CUDA_SUCCESS, 0);
  expect("set current", cuCtxSetCurrent(ctx), CUDA_SUCCESS, 0);

  expect("cuMemCreate: size a multiple of the granularity", cuMemCreate(&a, G / 2, &p, 0), CUDA_ERROR_INVALID_VALUE, 0);
  expect("cuMemAddressReserve: size a multiple of the granularity", cuMemAddressReserve(&va, G + 4096, 0, 0, 0),
         CUDA_ERROR_INVALID_VALUE, 0);
  expect("reserve 4 granules", cuMemAddressReserve(&va, 4 * G, 0, 0, 0), CUDA_SUCCESS, 0);
  expect("create a", cuMemCreate(&a, G, &p, 0), CUDA_SUCCESS, 0);
  expect("create b", cuMemCreate(&b, G, &p, 0), CUDA_SUCCESS, 0);
  expect("create c (2 granules)", cuMemCreate(&c, 2 * G, &px, 0), CUDA_SUCCESS, 0);
  expect("cuMemMap: offset must be zero", cuMemMap(va, G, G, c, 0), CUDA_ERROR_INVALID_VALUE, 0);
  expect("cuMemMap: size within the allocation", cuMemMap(va, 2 * G, 0, a, 0), CUDA_ERROR_INVALID_VALUE, 0);
  expect("cuMemMap: aligned address", cuMemMap(va + 4096, G, 0, a, 0), CUDA_ERROR_INVALID_VALUE, 0);
  expect("cuMemMap: inside a reservation", cuMemMap(va + 4 * G, G, 0, a, 0), CUDA_ERROR_INVALID_VALUE, 0);
  expect("map a at 0", cuMemMap(va, G, 0, a, 0), CUDA_SUCCESS, 0);
  expect("cuMemMap: not over a mapping", cuMemMap(va, G, 0, b, 0), CUDA_ERROR_ALREADY_MAPPED, 0);
  expect("map b at 1", cuMemMap(va + G, G, 0, b, 0), CUDA_SUCCESS, 0);
  expect("cuMemSetAccess: only over mapped ranges", cuMemSetAccess(va, 3 * G, &rw, 1), CUDA_ERROR_INVALID_VALUE, 0);
  expect("set access over a and b", cuMemSetAccess(va, 2 * G, &rw, 1), CUDA_SUCCESS, 0);

  char buf[64] = "stand-in bytes", back[64] = {0};
  expect("copy in", cuMemcpyHtoD_v2(va, buf, sizeof buf), CUDA_SUCCESS, 0);
  expect("copy a -> b (queued)", cuMemcpyDtoD_v2(va + G, va, sizeof buf), CUDA_SUCCESS, 0);
  expect("stream order: no unmap under queued work", cuMemUnmap(va + G, G), CUDA_ERROR_INVALID_VALUE, 1);
  expect("event create", cuEventCreate(&ev, 2), CUDA_SUCCESS, 0);
  expect("event record", cuEventRecord(ev, NULL), CUDA_SUCCESS, 0);
  if (getenv("CUDA_STANDIN_EVENT_POLLS") && atoi(getenv("CUDA_STANDIN_EVENT_POLLS")) > 0)
    expect("event pending at first poll", cuEventQuery(ev), CUDA_ERROR_NOT_READY, 0);
  expect("event synchronize", cuEventSynchronize(ev), CUDA_SUCCESS, 0);
  expect("event complete after the wait", cuEventQuery(ev), CUDA_SUCCESS, 0);
  expect("copy out", cuMemcpyDtoH_v2(back, va + G, sizeof back), CUDA_SUCCESS, 0);
  if (strcmp(back, buf) != 0) {
    printf("FAIL the queued copy's bytes did not arrive\n");
    failures++;
  }
  expect("event destroy", cuEventDestroy_v2(ev), CUDA_SUCCESS, 0);
  expect("events are not used after destroy", cuEventQuery(ev), CUDA_ERROR_INVALID_HANDLE, 1);

  /* DMA-BUFs: a range of mapped memory; while one is open, the memory it
   * reaches stays mapped where it is (vmm-arena's contract). */
  int dbuf = -1;
  expect("DMA-BUF: the range is mapped", cuMemGetHandleForAddressRange(&dbuf, va + 2 * G, G, 1, 0),
         CUDA_ERROR_INVALID_VALUE, 0);
  expect("DMA-BUF: handle type DMA_BUF_FD", cuMemGetHandleForAddressRange(&dbuf, va, G, 2, 0),
         CUDA_ERROR_INVALID_VALUE, 0);
  expect("DMA-BUF: page-aligned", cuMemGetHandleForAddressRange(&dbuf, va + 1, G, 1, 0), CUDA_ERROR_INVALID_VALUE,
         0);
  expect("DMA-BUF of a", cuMemGetHandleForAddressRange(&dbuf, va, G, 1, 0), CUDA_SUCCESS, 0);
  if (dbuf < 0) {
    printf("FAIL the DMA-BUF descriptor was not written\n");
    failures++;
  }
  expect("DMA-BUF contract: no unmap of the memory it reaches", cuMemUnmap(va, G), CUDA_ERROR_NOT_PERMITTED, 1);
  expect("DMA-BUF contract: no release of the memory it reaches", cuMemRelease(a), CUDA_ERROR_NOT_PERMITTED, 1);
  expect("DMA-BUF contract: not mapped elsewhere", cuMemMap(va + 2 * G, G, 0, a, 0), CUDA_ERROR_NOT_PERMITTED, 1);
  close(dbuf);
  expect("closed, its memory may be mapped elsewhere", cuMemMap(va + 2 * G, G, 0, a, 0), CUDA_SUCCESS, 0);
  expect("and unmapped", cuMemUnmap(va + 2 * G, G), CUDA_SUCCESS, 0);

  expect("cuMemUnmap: no sub-range of a mapping", cuMemUnmap(va, G / 2), CUDA_ERROR_INVALID_VALUE, 0);
  expect("cuMemUnmap: only mapped ranges", cuMemUnmap(va + 2 * G, G), CUDA_ERROR_INVALID_VALUE, 0);
  if (strict) {
    expect("strict unmap: one call unmaps one mapping", cuMemUnmap(va, 2 * G), CUDA_ERROR_INVALID_VALUE, 0);
    expect("unmap a", cuMemUnmap(va, G), CUDA_SUCCESS, 0);
    expect("unmap b", cuMemUnmap(va + G, G), CUDA_SUCCESS, 0);
  } else {
    expect("unmap a and b at once (lenient reading)", cuMemUnmap(va, 2 * G), CUDA_SUCCESS, 0);
  }
  expect("device memory is read only where mapped", cuMemcpyDtoH_v2(back, va, 8), CUDA_ERROR_INVALID_VALUE, 1);

  expect("map c", cuMemMap(va, 2 * G, 0, c, 0), CUDA_SUCCESS, 0);
  expect("release c while mapped is allowed", cuMemRelease(c), CUDA_SUCCESS, 0);
  expect("cuMemSetAccess after release, while mapped", cuMemSetAccess(va, 2 * G, &rw, 1), CUDA_SUCCESS, 0);
  expect("the bytes stay until unmapped", cuMemcpyHtoD_v2(va, buf, 8), CUDA_SUCCESS, 0);
  expect("a released handle is not mapped again", cuMemMap(va + 2 * G, 2 * G, 0, c, 0), CUDA_ERROR_INVALID_HANDLE, 1);
  expect("cuMemRelease: each handle once", cuMemRelease(c), CUDA_ERROR_INVALID_VALUE, 1);
  expect("cuMemAddressFree: no mappings inside", cuMemAddressFree(va, 4 * G), CUDA_ERROR_INVALID_VALUE, 1);
  expect("wait for the copy", cuCtxSynchronize(), CUDA_SUCCESS, 0);
  expect("unmap c", cuMemUnmap(va, 2 * G), CUDA_SUCCESS, 0);
  expect("cuMemAddressFree: the reserved size", cuMemAddressFree(va, 2 * G), CUDA_ERROR_INVALID_VALUE, 0);
  expect("export needs the requested handle type", cuMemExportToShareableHandle(&(int){0}, a, 1, 0),
         CUDA_ERROR_NOT_PERMITTED, 0);
  expect("import only exported handles", cuMemImportFromShareableHandle(&c, (void *)(intptr_t)0, 1),
         CUDA_ERROR_INVALID_VALUE, 0);
  void *host;
  expect("host alloc", cuMemHostAlloc(&host, 100, 0), CUDA_SUCCESS, 0);
  expect("cuMemFreeHost: memory from cuMemHostAlloc", cuMemFreeHost(buf), CUDA_ERROR_INVALID_VALUE, 1);
  expect("host free", cuMemFreeHost(host), CUDA_SUCCESS, 0);
  expect("release a", cuMemRelease(a), CUDA_SUCCESS, 0);

  /* Leaks: b and the reservation are still live when the last context
   * reference goes; the reset reports them. */
  expect("leaks at the context's reset are reported", cuDevicePrimaryCtxRelease_v2(dev), CUDA_SUCCESS, 1);
  expect("cuCtxGetCurrent", cuCtxGetCurrent(&cur), CUDA_SUCCESS, 0);
  expect("a destroyed context is not used", cuCtxSynchronize(), CUDA_ERROR_CONTEXT_IS_DESTROYED, 1);
  expect("release more than retained", cuDevicePrimaryCtxRelease_v2(dev), CUDA_ERROR_INVALID_CONTEXT, 1);

  /* Every violation above was provoked on purpose. The leak report at exit
   * is checked by running this program with CUDA_STANDIN_LEAK_AT_EXIT=1,
   * which must exit nonzero. */
  cuda_standin_forgive();
  v0 = 0;
  if (!getenv("CUDA_STANDIN_LEAK_AT_EXIT")) {
    expect("retain again", cuDevicePrimaryCtxRetain(&ctx, dev), CUDA_SUCCESS, 0);
    expect("set current", cuCtxSetCurrent(ctx), CUDA_SUCCESS, 0);
    expect("release b", cuMemRelease(b), CUDA_SUCCESS, 0);
    expect("free the reservation", cuMemAddressFree(va, 4 * G), CUDA_SUCCESS, 0);
    expect("release", cuDevicePrimaryCtxRelease_v2(dev), CUDA_SUCCESS, 0);
  }
  printf("%s: %d failure(s)\n", failures ? "FAILED" : "passed", failures);
  return failures ? 1 : 0;
}
