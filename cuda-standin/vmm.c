/*
 * cuda-standin: the virtual memory management calls. A reservation is a
 * PROT_NONE host mapping; a physical allocation is a range of a memfd; a
 * mapping maps that range at the reserved address (no access yet), and
 * cuMemSetAccess makes it readable/writable. Rules cite the CUDA Driver API
 * reference (12.x), "Virtual Memory Management" section.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "standin.h"

#include <poll.h>
#include <sys/socket.h>

static int dmabuf_reaches(unsigned long long handle);
static int unmaps_dmabuf_memory(uint64_t va, uint64_t size);

#define DMABUF_RULE                                                                                           \
  "vmm-arena's DMA-BUF contract: memory an open DMA-BUF reaches stays mapped where it was until the DMA-BUF " \
  "is closed (else another allocation's bytes become reachable through it)"


#define GRAN_RULE "cuMemGetAllocationGranularity: sizes and addresses are multiples of the granularity"

struct alloc *find_alloc(unsigned long long handle) {
  for (int i = 0; i < S.nallocs; i++)
    if (S.allocs[i].handle == handle) return &S.allocs[i];
  return NULL;
}

struct reservation *find_reservation(uint64_t va, uint64_t size) {
  for (int i = 0; i < S.nres; i++)
    if (va >= S.res[i].va && size <= S.res[i].size && va - S.res[i].va <= S.res[i].size - size) return &S.res[i];
  return NULL;
}

static int overlaps(uint64_t a, uint64_t as, uint64_t b, uint64_t bs) { return a < b + bs && b < a + as; }

static CUresult check_prop(const char *call, const CUmemAllocationProp *p) {
  if (!p) return reject(CUDA_ERROR_INVALID_VALUE, call, "prop must not be NULL", "NULL");
  if (p->type != 1)
    return reject(CUDA_ERROR_INVALID_VALUE, call, "CUmemAllocationProp::type is CU_MEM_ALLOCATION_TYPE_PINNED",
                  "type %d", p->type);
  if (p->location.type != 1 || p->location.id != 0)
    return reject(CUDA_ERROR_INVALID_DEVICE, call, "CUmemAllocationProp::location is an existing device",
                  "location %d/%d", p->location.type, p->location.id);
  if (p->requestedHandleTypes & ~1)
    return reject(CUDA_ERROR_NOT_SUPPORTED, call, "only POSIX file descriptors are shareable here",
                  "handle types %#x", p->requestedHandleTypes);
  return CUDA_SUCCESS;
}

CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *prop, int option) {
  CUresult r = enter("cuMemGetAllocationGranularity");
  if (r) return r;
  if (!g) r = reject(CUDA_ERROR_INVALID_VALUE, "cuMemGetAllocationGranularity", "granularity not NULL", "NULL");
  else if (!(r = check_prop("cuMemGetAllocationGranularity", prop))) {
    if (option != 0 && option != 1)
      r = reject(CUDA_ERROR_INVALID_VALUE, "cuMemGetAllocationGranularity", "option is MINIMUM or RECOMMENDED",
                 "option %d", option);
    else *g = S.granularity;
  }
  leave();
  return r;
}

/* ---- reservations ------------------------------------------------------ */

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags) {
  const char *call = "cuMemAddressReserve";
  CUresult r = enter_ctx(call);
  if (r) return r;
  if (!ptr || size == 0) r = reject(CUDA_ERROR_INVALID_VALUE, call, "ptr not NULL, size > 0", "size %zu", size);
  else if (flags != 0) r = reject(CUDA_ERROR_INVALID_VALUE, call, "flags: currently unused, must be zero", "%llu", flags);
  else if (size % S.granularity)
    r = reject(CUDA_ERROR_INVALID_VALUE, call, GRAN_RULE, "size %#zx, granularity %#llx", size,
               (unsigned long long)S.granularity);
  else if (align && (align & (align - 1)))
    r = reject(CUDA_ERROR_INVALID_VALUE, call, "alignment: 0 (default) or a power of two", "align %#zx", align);
  else if (S.nres == MAX_RESERVATIONS)
    r = reject(CUDA_ERROR_OUT_OF_MEMORY, call, "stand-in limit", "%d reservations", S.nres);
  if (r) goto out;
  (void)addr; /* a hint: "the driver may ignore it" */
  uint64_t a = align > S.granularity ? align : S.granularity;
  uint64_t total = size + a;
  void *m = mmap(NULL, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) {
    r = reject(CUDA_ERROR_OUT_OF_MEMORY, call, "host address space", "%s", strerror(errno));
    goto out;
  }
  uint64_t base = ((uint64_t)m + a - 1) / a * a;
  S.res[S.nres++] = (struct reservation){base, size, (uint64_t)m, total};
  *ptr = base;
out:
  leave();
  return r;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  const char *call = "cuMemAddressFree";
  CUresult r = enter_ctx(call);
  if (r) return r;
  int i;
  for (i = 0; i < S.nres; i++)
    if (S.res[i].va == ptr) break;
  if (i == S.nres) {
    r = reject(CUDA_ERROR_INVALID_VALUE, call, "cuMemAddressFree frees a range reserved by cuMemAddressReserve",
               "%#llx is not a reservation", ptr);
  } else if (S.res[i].size != size) {
    r = reject(CUDA_ERROR_INVALID_VALUE, call, "cuMemAddressFree: the size must match what was given to "
               "cuMemAddressReserve", "size %#zx, reserved %#llx", size, (unsigned long long)S.res[i].size);
  } else {
    for (int m = 0; m < S.nmaps; m++)
      if (overlaps(S.maps[m].va, S.maps[m].size, ptr, size)) {
        r = violation(CUDA_ERROR_INVALID_VALUE, call, "cuMemUnmap before cuMemAddressFree: a freed range holds "
                      "no mappings", "mapping at %#llx still inside", (unsigned long long)S.maps[m].va);
        goto out;
      }
    munmap((void *)S.res[i].mmap_base, S.res[i].mmap_size);
    S.res[i] = S.res[--S.nres];
  }
out:
  leave();
  return r;
}

/* ---- physical allocations ---------------------------------------------- */

static int pool_take(uint64_t n, uint64_t *slot) {
  for (uint64_t s = 0; s + n <= S.nslots; s++) {
    uint64_t k = 0;
    while (k < n && !S.slots[s + k]) k++;
    if (k == n) {
      memset(S.slots + s, 1, n);
      *slot = s;
      return 1;
    }
    s += k;
  }
  return 0;
}

static struct alloc *new_alloc(void) {
  for (int i = 0; i < S.nallocs; i++)
    if (!S.allocs[i].handle) return &S.allocs[i];
  return S.nallocs < MAX_ALLOCS ? &S.allocs[S.nallocs++] : NULL;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop,
                     unsigned long long flags) {
  const char *call = "cuMemCreate";
  CUresult r = enter_ctx(call);
  if (r) return r;
  struct alloc *a = NULL;
  if (!h) r = reject(CUDA_ERROR_INVALID_VALUE, call, "handle not NULL", "NULL");
  else if (flags) r = reject(CUDA_ERROR_INVALID_VALUE, call, "flags: for future use, must be zero now", "%llu", flags);
  else if ((r = check_prop(call, prop))) {
  } else if (size == 0 || size % S.granularity)
    r = reject(CUDA_ERROR_INVALID_VALUE, call, "cuMemCreate: size must be a multiple of the granularity from "
               "cuMemGetAllocationGranularity with CU_MEM_ALLOC_GRANULARITY_MINIMUM", "size %#zx", size);
  else if (S.used_bytes + size > S.device_bytes || !(a = new_alloc()))
    r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r) goto out;
  memset(a, 0, sizeof *a);
  if (prop->requestedHandleTypes & 1) {
    int fd = memfd_create("cuda-standin-alloc", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
      if (fd >= 0) close(fd);
      r = CUDA_ERROR_OUT_OF_MEMORY;
      goto out;
    }
    *a = (struct alloc){.fd = fd, .own_fd = 1, .offset = 0, .size = size, .exportable = 1};
  } else {
    uint64_t slot;
    if (!pool_take(size / S.granularity, &slot)) {
      r = CUDA_ERROR_OUT_OF_MEMORY;
      goto out;
    }
    *a = (struct alloc){.fd = S.pool_fd, .offset = slot * S.granularity, .size = size};
  }
  S.used_bytes += size;
  a->handle = S.next_handle++;
  *h = a->handle;
out:
  leave();
  return r;
}

/* Frees the bytes of a released allocation once nothing maps it ("the
 * memory allocation will be freed when all outstanding mappings to the
 * memory are unmapped and when all outstanding references to the handle
 * ... are also released"). */
void drop_alloc_if_unused(struct alloc *a) {
  if (!a->released || a->mappings) return;
  if (a->own_fd) {
    close(a->fd);
  } else {
    /* Give the host pages back, as the device would reuse them. */
    fallocate(a->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)a->offset, (off_t)a->size);
    memset(S.slots + a->offset / S.granularity, 0, a->size / S.granularity);
  }
  S.used_bytes -= a->size;
  a->handle = 0;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
  const char *call = "cuMemRelease";
  CUresult r = enter_ctx(call);
  if (r) return r;
  struct alloc *a = find_alloc(h);
  if (!a) {
    r = violation(CUDA_ERROR_INVALID_VALUE, call, "cuMemRelease: a handle from cuMemCreate or an import",
                  "unknown handle %#llx", h);
  } else if (a->released) {
    r = violation(CUDA_ERROR_INVALID_VALUE, call, "cuMemRelease: each handle is released once (double release)",
                  "handle %#llx was already released", h);
  } else if (dmabuf_reaches(h)) {
    r = violation(CUDA_ERROR_NOT_PERMITTED, call, DMABUF_RULE, "handle %#llx is released", h);
  } else {
    a->released = 1;
    drop_alloc_if_unused(a);
  }
  leave();
  return r;
}

/* ---- mappings ---------------------------------------------------------- */

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h, unsigned long long flags) {
  const char *call = "cuMemMap";
  CUresult r = enter_ctx(call);
  if (r) return r;
  struct alloc *a = find_alloc(h);
  if (!a || a->released) {
    r = violation(CUDA_ERROR_INVALID_HANDLE, call, "cuMemMap: handle is a live allocation handle (not released)",
                  "handle %#llx %s", h, a ? "was released" : "is unknown");
  } else if (flags) {
    r = reject(CUDA_ERROR_INVALID_VALUE, call, "cuMemMap: flags for future use, must be zero now", "%llu", flags);
  } else if (offset != 0) {
    r = reject(CUDA_ERROR_INVALID_VALUE, call, "cuMemMap: offset - currently must be zero", "offset %#zx", offset);
  } else if (size == 0 || size % S.granularity || ptr % S.granularity) {
    r = reject(CUDA_ERROR_INVALID_VALUE, call, GRAN_RULE, "ptr %#llx size %#zx", ptr, size);
  } else if (offset + size > a->size) {
    r = reject(CUDA_ERROR_INVALID_VALUE, call, "cuMemMap: [offset, offset+size) lies within the allocation",
               "size %#zx past an allocation of %#llx", size, (unsigned long long)a->size);
  } else if (!find_reservation(ptr, size)) {
    r = reject(CUDA_ERROR_INVALID_VALUE, call, "cuMemMap: the range lies within one cuMemAddressReserve range",
               "%#llx+%#zx", ptr, size);
  } else if (S.nmaps == MAX_MAPPINGS) {
    r = reject(CUDA_ERROR_OUT_OF_MEMORY, call, "stand-in limit", "%d mappings", S.nmaps);
  }
  if (r) goto out;
  if (dmabuf_reaches(h)) {
    r = violation(CUDA_ERROR_NOT_PERMITTED, call, DMABUF_RULE, "handle %#llx is mapped again at %#llx", h, ptr);
    goto out;
  }
  for (int i = 0; i < S.nmaps; i++)
    if (overlaps(S.maps[i].va, S.maps[i].size, ptr, size)) {
      r = reject(CUDA_ERROR_ALREADY_MAPPED, call, "cuMemMap: the range is not already mapped",
                 "overlaps the mapping at %#llx", (unsigned long long)S.maps[i].va);
      goto out;
    }
  if (mmap((void *)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, a->fd, (off_t)(a->offset + offset)) == MAP_FAILED) {
    r = reject(CUDA_ERROR_OUT_OF_MEMORY, call, "host mmap", "%s", strerror(errno));
    goto out;
  }
  S.maps[S.nmaps++] = (struct mapping){ptr, size, a, 0};
  a->mappings++;
out:
  leave();
  return r;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
  const char *call = "cuMemSetAccess";
  CUresult r = enter_ctx(call);
  if (r) return r;
  int flags = -1;
  if (!desc || count == 0) {
    r = reject(CUDA_ERROR_INVALID_VALUE, call, "desc: at least one descriptor", "count %zu", count);
    goto out;
  }
  for (size_t i = 0; i < count; i++) {
    if (desc[i].location.type != 1 || desc[i].location.id != 0) {
      r = reject(CUDA_ERROR_INVALID_DEVICE, call, "CUmemAccessDesc::location is an existing device", "%d/%d",
                 desc[i].location.type, desc[i].location.id);
      goto out;
    }
    if (desc[i].flags != 0 && desc[i].flags != 1 && desc[i].flags != 3) {
      r = reject(CUDA_ERROR_INVALID_VALUE, call, "CUmemAccess_flags", "flags %d", desc[i].flags);
      goto out;
    }
    flags = desc[i].flags;
  }
  /* "Set the access flags for each location specified in desc for the
   * given virtual address range": the range must be fully mapped. */
  uint64_t covered = 0;
  for (int i = 0; i < S.nmaps; i++)
    if (overlaps(S.maps[i].va, S.maps[i].size, ptr, size)) {
      if (S.maps[i].va < ptr || S.maps[i].va + S.maps[i].size > ptr + size) {
        r = reject(CUDA_ERROR_INVALID_VALUE, call, "cuMemSetAccess covers whole mappings", "mapping %#llx",
                   (unsigned long long)S.maps[i].va);
        goto out;
      }
      covered += S.maps[i].size;
    }
  if (size == 0 || covered != size) {
    r = reject(CUDA_ERROR_INVALID_VALUE, call, "cuMemSetAccess: only over mapped ranges (every byte of "
               "[ptr, ptr+size) mapped)", "%#llx+%#zx: %#llx bytes mapped", ptr, size, (unsigned long long)covered);
    goto out;
  }
  int prot = flags == 3 ? PROT_READ | PROT_WRITE : flags == 1 ? PROT_READ : PROT_NONE;
  mprotect((void *)ptr, size, prot);
  for (int i = 0; i < S.nmaps; i++)
    if (overlaps(S.maps[i].va, S.maps[i].size, ptr, size)) S.maps[i].access = flags;
out:
  leave();
  return r;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  const char *call = "cuMemUnmap";
  CUresult r = enter_ctx(call);
  if (r) return r;
  int n = 0;
  uint64_t covered = 0;
  for (int i = 0; i < S.nmaps; i++)
    if (overlaps(S.maps[i].va, S.maps[i].size, ptr, size)) {
      if (S.maps[i].va < ptr || S.maps[i].va + S.maps[i].size > ptr + size) {
        r = reject(CUDA_ERROR_INVALID_VALUE, call, "cuMemUnmap: the range must be the entire contiguous address "
                   "range that was mapped to; it cannot unmap a sub-range", "%#llx+%#zx cuts the mapping %#llx+%#llx",
                   ptr, size, (unsigned long long)S.maps[i].va, (unsigned long long)S.maps[i].size);
        goto out;
      }
      covered += S.maps[i].size;
      n++;
    }
  if (n == 0 || covered != size) {
    r = reject(CUDA_ERROR_INVALID_VALUE, call, "cuMemUnmap: the range must be an address range that was mapped",
               "%#llx+%#zx: %#llx bytes mapped", ptr, size, (unsigned long long)covered);
  } else if (n > 1 && S.strict_unmap) {
    r = reject(CUDA_ERROR_INVALID_VALUE, call, "cuMemUnmap, strict reading (CUDA_STANDIN_STRICT_UNMAP=1): one "
               "call unmaps one mapping, \"the entire contiguous address range that was mapped to\"",
               "%#llx+%#zx spans %d mappings", ptr, size, n);
  } else if (unmaps_dmabuf_memory(ptr, size)) {
    r = violation(CUDA_ERROR_NOT_PERMITTED, call, DMABUF_RULE, "%#llx+%#zx is unmapped", ptr, size);
  } else if (work_touches(ptr, size)) {
    r = violation(CUDA_ERROR_INVALID_VALUE, call, "stream order: memory is unmapped only once no queued device "
                  "work uses it (wait for it: cuStreamSynchronize, cuEventSynchronize, cuCtxSynchronize)",
                  "%#llx+%#zx has unfinished work", ptr, size);
  }
  if (r) goto out;
  mmap((void *)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  for (int i = 0; i < S.nmaps;) {
    if (overlaps(S.maps[i].va, S.maps[i].size, ptr, size)) {
      struct alloc *a = S.maps[i].alloc;
      a->mappings--;
      S.maps[i] = S.maps[--S.nmaps];
      drop_alloc_if_unused(a);
    } else {
      i++;
    }
  }
out:
  leave();
  return r;
}

int range_accessible(uint64_t va, uint64_t size, int need) {
  uint64_t covered = 0;
  for (int i = 0; i < S.nmaps; i++) {
    struct mapping *m = &S.maps[i];
    if (!overlaps(m->va, m->size, va, size)) continue;
    if ((m->access & need) != need) return 0;
    uint64_t lo = m->va > va ? m->va : va, hi = m->va + m->size < va + size ? m->va + m->size : va + size;
    covered += hi - lo;
  }
  return covered == size;
}

/* ---- sharing ----------------------------------------------------------- */

CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type, unsigned long long flags) {
  const char *call = "cuMemExportToShareableHandle";
  CUresult r = enter_ctx(call);
  if (r) return r;
  struct alloc *a = find_alloc(h);
  if (!a || a->released) {
    r = violation(CUDA_ERROR_INVALID_HANDLE, call, "a live allocation handle", "handle %#llx", h);
  } else if (!out || flags || type != 1) {
    r = reject(CUDA_ERROR_INVALID_VALUE, call, "POSIX fd type, flags 0", "type %d", type);
  } else if (!a->exportable) {
    r = reject(CUDA_ERROR_NOT_PERMITTED, call, "cuMemExportToShareableHandle: the handle was created with the "
               "requested handle type in CUmemAllocationProp::requestedHandleTypes", "handle %#llx", h);
  } else {
    int fd = fcntl(a->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) r = CUDA_ERROR_OUT_OF_MEMORY;
    else *(int *)out = fd;
  }
  leave();
  return r;
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *os_handle, int type) {
  const char *call = "cuMemImportFromShareableHandle";
  CUresult r = enter_ctx(call);
  if (r) return r;
  int fd = (int)(intptr_t)os_handle;
  char path[64], target[256] = {0};
  struct stat st;
  struct alloc *a = NULL;
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  if (!h || type != 1) {
    r = reject(CUDA_ERROR_INVALID_VALUE, call, "POSIX fd type", "type %d", type);
  } else if (readlink(path, target, sizeof target - 1) < 0 || strncmp(target, "/memfd:cuda-standin-alloc", 25) != 0 ||
             fstat(fd, &st) != 0) {
    r = reject(CUDA_ERROR_INVALID_VALUE, call, "cuMemImportFromShareableHandle: a handle from "
               "cuMemExportToShareableHandle", "fd %d is %s", fd, target[0] ? target : "not open");
  } else if (!(a = new_alloc())) {
    r = CUDA_ERROR_OUT_OF_MEMORY;
  } else {
    int dup = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (dup < 0) {
      r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
      /* The bytes are the exporter's: counted once, by the exporter, but
       * an import in another process counts here too. */
      *a = (struct alloc){.handle = S.next_handle++, .fd = dup, .own_fd = 1, .size = (uint64_t)st.st_size,
                          .exportable = 1};
      S.used_bytes += a->size;
      *h = a->handle;
    }
  }
  leave();
  return r;
}

/* ---- DMA-BUFs ------------------------------------------------------------ */

/* DMA-BUFs handed out by cuMemGetHandleForAddressRange. The caller's
 * descriptor is one end of a socket pair; the stand-in keeps the other, and
 * its hang-up (POLLHUP) says the caller closed every copy of it. While one
 * is open, the physical allocations its range mapped stay reachable through
 * it (on a GPU, by any device that registered it), so vmm-arena's contract
 * is that they stay mapped where they were: unmapping, releasing or mapping
 * one of them elsewhere while it is open is a violation here. */
#define MAX_DMABUFS 256
#define MAX_DMABUF_ALLOCS 64
struct dmabuf {
  int keep; /* our end; -1 for a free slot */
  int nallocs;
  unsigned long long handles[MAX_DMABUF_ALLOCS];
};
static struct dmabuf dmabufs[MAX_DMABUFS];
static int dmabufs_ready;

static void dmabufs_init(void) {
  if (!dmabufs_ready) {
    for (int i = 0; i < MAX_DMABUFS; i++) dmabufs[i].keep = -1;
    dmabufs_ready = 1;
  }
}

/* Forgets the DMA-BUFs whose caller's end is closed. */
static void dmabufs_reap(void) {
  dmabufs_init();
  for (int i = 0; i < MAX_DMABUFS; i++) {
    if (dmabufs[i].keep < 0) continue;
    struct pollfd p = {dmabufs[i].keep, 0, 0};
    if (poll(&p, 1, 0) == 1 && (p.revents & (POLLHUP | POLLERR))) {
      close(dmabufs[i].keep);
      dmabufs[i].keep = -1;
    }
  }
}

/* Whether an open DMA-BUF reaches the allocation of this handle. */
static int dmabuf_reaches(unsigned long long handle) {
  dmabufs_reap();
  for (int i = 0; i < MAX_DMABUFS; i++)
    for (int j = 0; dmabufs[i].keep >= 0 && j < dmabufs[i].nallocs; j++)
      if (dmabufs[i].handles[j] == handle) return 1;
  return 0;
}

int live_dmabufs(void) {
  dmabufs_reap();
  int n = 0;
  for (int i = 0; i < MAX_DMABUFS; i++) n += dmabufs[i].keep >= 0;
  return n;
}

CUresult cuMemGetHandleForAddressRange(void *out, CUdeviceptr ptr, size_t size, int type, unsigned long long flags) {
  const char *call = "cuMemGetHandleForAddressRange";
  CUresult r = enter_ctx(call);
  if (r) return r;
  uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
  dmabufs_reap();
  int slot = -1;
  for (int i = 0; i < MAX_DMABUFS && slot < 0; i++)
    if (dmabufs[i].keep < 0) slot = i;
  if (!out) {
    r = reject(CUDA_ERROR_INVALID_VALUE, call, "cuMemGetHandleForAddressRange: handle is a valid pointer", "NULL");
  } else if (type != 1) {
    r = reject(CUDA_ERROR_INVALID_VALUE, call, "handleType: CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD (1)", "%d", type);
  } else if (flags != 0) {
    r = reject(CUDA_ERROR_INVALID_VALUE, call, "flags: 0 (or a mapping type this stand-in does not model)", "%llu",
               flags);
  } else if (size == 0 || ptr % page || size % page) {
    r = reject(CUDA_ERROR_INVALID_VALUE, call, "dptr and size aligned to the host page size", "%#llx+%#zx", ptr,
               size);
  } else if (!range_accessible(ptr, size, 1)) {
    r = reject(CUDA_ERROR_INVALID_VALUE, call, "the range is mapped memory of this context", "%#llx+%#zx", ptr,
               size);
  } else if (slot < 0) {
    r = reject(CUDA_ERROR_OUT_OF_MEMORY, call, "stand-in limit", "%d open DMA-BUFs", MAX_DMABUFS);
  }
  if (r) goto out;
  struct dmabuf d = {-1, 0, {0}};
  for (int i = 0; i < S.nmaps; i++) {
    if (!overlaps(S.maps[i].va, S.maps[i].size, ptr, size)) continue;
    if (d.nallocs == MAX_DMABUF_ALLOCS) {
      r = reject(CUDA_ERROR_OUT_OF_MEMORY, call, "stand-in limit", "a DMA-BUF over more than %d allocations",
                 MAX_DMABUF_ALLOCS);
      goto out;
    }
    d.handles[d.nallocs++] = S.maps[i].alloc->handle;
  }
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    r = reject(CUDA_ERROR_OUT_OF_MEMORY, call, "host socketpair", "%s", strerror(errno));
    goto out;
  }
  d.keep = sv[0];
  dmabufs[slot] = d;
  *(int *)out = sv[1];
out:
  leave();
  return r;
}

/* Whether [va, va+size) maps an allocation an open DMA-BUF reaches. */
static int unmaps_dmabuf_memory(uint64_t va, uint64_t size) {
  for (int i = 0; i < S.nmaps; i++)
    if (overlaps(S.maps[i].va, S.maps[i].size, va, size) && dmabuf_reaches(S.maps[i].alloc->handle)) return 1;
  return 0;
}
