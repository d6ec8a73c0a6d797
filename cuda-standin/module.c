/*
 * cuda-standin: the calls of the GPU check's attention kernels
 * (sim/src/bin/gpu_measure/attention.rs). The stand-in runs no kernels and
 * has no linear device allocator, so each of these is refused with
 * CUDA_ERROR_NOT_SUPPORTED, a status the driver API documents for a feature
 * the device does not support. The caller then reports the attention part as
 * not measured, through its ordinary error path, and the process keeps the
 * driver measurements; without these symbols the dynamic loader's lookup
 * would fail instead.
 */
#include <stddef.h>

#include "standin.h"

static const char *const no_kernels =
    "cuda-standin emulates no kernels and no cuMemAlloc heap (RELIABILITY.md: what it cannot emulate)";

static CUresult unsupported(const char *call) {
  CUresult r = enter_ctx(call);
  if (r) return r;
  r = reject(CUDA_ERROR_NOT_SUPPORTED, call, no_kernels, "not emulated");
  leave();
  return r;
}

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes) {
  (void)bytes;
  if (dptr) *dptr = 0;
  return unsupported("cuMemAlloc");
}

CUresult cuMemFree_v2(CUdeviceptr dptr) {
  (void)dptr;
  return unsupported("cuMemFree");
}

CUresult cuModuleLoadData(void **module, const void *image) {
  (void)image;
  if (module) *module = NULL;
  return unsupported("cuModuleLoadData");
}

CUresult cuModuleGetFunction(void **fn, void *module, const char *name) {
  (void)module;
  (void)name;
  if (fn) *fn = NULL;
  return unsupported("cuModuleGetFunction");
}

CUresult cuModuleUnload(void *module) {
  (void)module;
  return unsupported("cuModuleUnload");
}

CUresult cuLaunchKernel(void *fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shared_bytes, void *stream, void **params, void **extra) {
  (void)fn, (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz;
  (void)shared_bytes, (void)stream, (void)params, (void)extra;
  return unsupported("cuLaunchKernel");
}
