/*
 * cuda-standin: a strict stand-in for libcuda (the CUDA driver API), for
 * running vmm-arena's CUDA backend on machines without a GPU. Device memory
 * is host memory (memfd), device virtual addresses are host addresses, and
 * every call checks the rules NVIDIA's driver API reference states for it.
 * See README.md beside this file for the rules and the environment.
 *
 * This header is internal to the stand-in: the exported functions keep the
 * driver's C prototypes, written here with plain integer types.
 */
#ifndef CUDA_STANDIN_H
#define CUDA_STANDIN_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_ALREADY_MAPPED = 208,
  CUDA_ERROR_NOT_MAPPED = 211,
  CUDA_ERROR_INVALID_HANDLE = 400,
  CUDA_ERROR_NOT_READY = 600,
  CUDA_ERROR_ILLEGAL_ADDRESS = 700,
  CUDA_ERROR_CONTEXT_IS_DESTROYED = 709,
  CUDA_ERROR_NOT_PERMITTED = 800,
  CUDA_ERROR_NOT_SUPPORTED = 801,
};

/* The driver's structs, as in cuda.h (CUDA 12.x). */
typedef struct {
  int type; /* CUmemLocationType: 1 = device */
  int id;
} CUmemLocation;

typedef struct {
  int type;                 /* CUmemAllocationType: 1 = pinned */
  int requestedHandleTypes; /* CUmemAllocationHandleType bit set */
  CUmemLocation location;
  void *win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
} CUmemAllocationProp;

typedef struct {
  CUmemLocation location;
  int flags; /* CUmemAccess_flags: 0 none, 1 read, 3 read-write */
} CUmemAccessDesc;

/* ---- shared state (one lock guards all of it) ------------------------- */

/* A physical allocation (cuMemCreate or an import): a range of a memfd. */
struct alloc {
  unsigned long long handle; /* 0 once the slot is free */
  int fd;                    /* the memfd holding the bytes */
  int own_fd;                /* the fd is this allocation's alone (close it) */
  uint64_t offset, size;     /* where in the memfd */
  int exportable;            /* created with the POSIX fd handle type */
  int released;              /* cuMemRelease was called: the handle is dead */
  int mappings;              /* live mappings of it */
};

struct mapping {
  uint64_t va, size;
  struct alloc *alloc; /* index-stable: allocs never move (fixed table) */
  int access;          /* 0 none yet, 1 read, 3 read-write */
};

struct reservation {
  uint64_t va, size;
  uint64_t mmap_base, mmap_size; /* the host mapping (aligned inside) */
};

#define MAX_ALLOCS 65536
#define MAX_MAPPINGS 65536
#define MAX_RESERVATIONS 4096

struct standin {
  pthread_mutex_t lock;
  int initialised;
  uint64_t granularity;  /* CUDA_STANDIN_GRANULARITY, default 2 MiB */
  uint64_t device_bytes; /* CUDA_STANDIN_DEVICE_BYTES, default 16 GiB */
  uint64_t used_bytes;
  int strict_unmap;      /* CUDA_STANDIN_STRICT_UNMAP=1 */
  int event_polls;       /* CUDA_STANDIN_EVENT_POLLS: NOT_READY answers first */
  int quiet;             /* CUDA_STANDIN_QUIET=1: no per-rejection lines */
  int pool_fd;           /* the memfd of non-exportable allocations */
  unsigned char *slots;  /* pool slot map, one byte per granule */
  uint64_t nslots;
  unsigned long long next_handle;
  struct alloc allocs[MAX_ALLOCS];
  int nallocs;
  struct mapping *maps;
  int nmaps;
  struct reservation res[MAX_RESERVATIONS];
  int nres;
  uint64_t violations, rejections;
};

extern struct standin S;

/* Takes the lock and checks cuInit was called (rule: "If cuInit() has not
 * been called, any function from the driver API will return
 * CUDA_ERROR_NOT_INITIALIZED"). Returns CUDA_SUCCESS with the lock held,
 * or an error without it. */
CUresult enter(const char *call);
/* enter() plus a current, live context on this thread. */
CUresult enter_ctx(const char *call);
void leave(void);

/* A call refused with a documented error: reported, counted, returned. */
CUresult reject(CUresult code, const char *call, const char *rule, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Misuse the real driver may not report (use after release, stream order,
 * leaks): reported, counted as a violation (nonzero exit), and returned. */
CUresult violation(CUresult code, const char *call, const char *rule, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

struct alloc *find_alloc(unsigned long long handle);
struct reservation *find_reservation(uint64_t va, uint64_t size);
void drop_alloc_if_unused(struct alloc *a);
/* Runs stream work queued up to sequence number `upto` (all: UINT64_MAX). */
void flush_work(uint64_t upto);
/* Whether queued, unexecuted work touches [va, va+size). */
int work_touches(uint64_t va, uint64_t size);
/* Whether [va, va+size) is mapped and `need` access (1 read, 3 write) set. */
int range_accessible(uint64_t va, uint64_t size, int need);
/* Leak counts for the exit report and cuDevicePrimaryCtxRelease. */
int live_events(void);
int live_host_allocs(void);
/* DMA-BUFs the caller has not closed yet. */
int live_dmabufs(void);

#endif
