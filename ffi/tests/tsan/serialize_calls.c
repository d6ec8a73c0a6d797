/*
 * For the ThreadSanitizer build of the C/C++ thread tests (scripts/tsan.sh)
 * only: tells TSan where the library's lock orders threads.
 *
 * libvmm_arena is Rust and is not TSan-instrumented (that needs nightly
 * -Zsanitizer=thread and a rebuilt std). Its arena lock is a futex on
 * uninstrumented atomics, so TSan cannot see the happens-before edges it
 * creates: memory handed from one thread's free to another thread's alloc,
 * or a callback box installed by one thread and called by another inside
 * the lock, would all be reported as races that cannot happen.
 *
 * This file interposes every function of vmm_arena.h (the program's
 * definitions win over the shared library's; the real ones are found with
 * dlsym(RTLD_NEXT); ffi/tests/tsan_shim.rs fails when one has no wrapper
 * here) and runs each call under one process-wide recursive
 * pthread mutex, which TSan does see. That is exactly the ordering the
 * arena lock gives, and more: calls on different arenas are ordered too,
 * which can only hide races between code that touches two arenas, none of
 * which the tests share. Everything the C/C++ code does outside a library
 * call (the wrapper's own state, touching allocation memory, the move
 * callback's captured state) is checked as it is. Recursive, because a move
 * callback runs inside a call and may call the library again.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "vmm_arena.h"

static pthread_mutex_t big_lock;
static pthread_once_t big_lock_once = PTHREAD_ONCE_INIT;

static void big_lock_init(void) {
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_RECURSIVE);
  pthread_mutex_init(&big_lock, &attr);
  pthread_mutexattr_destroy(&attr);
}

static void enter(void) {
  pthread_once(&big_lock_once, big_lock_init);
  pthread_mutex_lock(&big_lock);
}

static void leave(void) { pthread_mutex_unlock(&big_lock); }

/* The library's definition of `name` (looked up under the lock, once). */
static void *real(const char *name) {
  void *f = dlsym(RTLD_NEXT, name);
  if (f == NULL) {
    fprintf(stderr, "serialize_calls: %s not found: %s\n", name, dlerror());
    abort();
  }
  return f;
}

#define WRAP(ret, name, params, args)                          \
  ret name params {                                            \
    static ret(*real_fn) params;                               \
    enter();                                                   \
    if (real_fn == NULL) real_fn = (ret(*) params)real(#name); \
    ret ret_ = real_fn args;                                    \
    leave();                                                   \
    return ret_;                                              \
  }

#define WRAP_VOID(name, params, args)                           \
  void name params {                                            \
    static void(*real_fn) params;                               \
    enter();                                                    \
    if (real_fn == NULL) real_fn = (void(*) params)real(#name); \
    real_fn args;                                               \
    leave();                                                    \
  }

WRAP(uint32_t, vmm_arena_abi_version, (void), ())
WRAP(const char *, vmm_arena_status_name, (vmm_arena_status s), (s))
WRAP(const char *, vmm_arena_last_error, (void), ())
WRAP_VOID(vmm_arena_config_default, (vmm_arena_config * c), (c))
WRAP(vmm_arena_status, vmm_arena_create, (const vmm_arena_config *c, vmm_arena **out), (c, out))
WRAP_VOID(vmm_arena_destroy, (vmm_arena * a), (a))
WRAP(vmm_arena_status, vmm_arena_alloc, (vmm_arena * a, uint64_t size, vmm_arena_id *id, uint64_t *p),
     (a, size, id, p))
WRAP(vmm_arena_status, vmm_arena_alloc_growable,
     (vmm_arena * a, uint64_t size, uint64_t max, vmm_arena_id *id, uint64_t *p), (a, size, max, id, p))
WRAP(vmm_arena_status, vmm_arena_alloc_tagged,
     (vmm_arena * a, uint64_t size, uint32_t tag, vmm_arena_id *id, uint64_t *p), (a, size, tag, id, p))
WRAP(vmm_arena_status, vmm_arena_alloc_growable_tagged,
     (vmm_arena * a, uint64_t size, uint64_t max, uint32_t tag, vmm_arena_id *id, uint64_t *p),
     (a, size, max, tag, id, p))
WRAP(vmm_arena_status, vmm_arena_alloc_on_stream,
     (vmm_arena * a, uint64_t size, uint64_t stream, vmm_arena_id *id, uint64_t *p), (a, size, stream, id, p))
WRAP(vmm_arena_status, vmm_arena_alloc_growable_on_stream,
     (vmm_arena * a, uint64_t size, uint64_t max, uint64_t stream, vmm_arena_id *id, uint64_t *p),
     (a, size, max, stream, id, p))
WRAP(vmm_arena_status, vmm_arena_alloc_shared,
     (vmm_arena * a, vmm_arena_id src, uint64_t offset, uint64_t bytes, uint64_t max, vmm_arena_id *id, uint64_t *p),
     (a, src, offset, bytes, max, id, p))
WRAP(vmm_arena_status, vmm_arena_free, (vmm_arena * a, vmm_arena_id id), (a, id))
WRAP(vmm_arena_status, vmm_arena_resize, (vmm_arena * a, vmm_arena_id id, uint64_t size, uint64_t *p),
     (a, id, size, p))
WRAP(vmm_arena_status, vmm_arena_resize_on_stream,
     (vmm_arena * a, vmm_arena_id id, uint64_t size, uint64_t stream, uint64_t *p), (a, id, size, stream, p))
WRAP(vmm_arena_status, vmm_arena_quiesce_on_stream, (vmm_arena * a, vmm_arena_id id, uint64_t stream),
     (a, id, stream))
WRAP(vmm_arena_status, vmm_arena_unquiesce, (vmm_arena * a, vmm_arena_id id), (a, id))
WRAP(vmm_arena_status, vmm_arena_query, (vmm_arena * a, vmm_arena_id id, uint64_t *p, uint64_t *size),
     (a, id, p, size))
WRAP(vmm_arena_status, vmm_arena_pin, (vmm_arena * a, vmm_arena_id id), (a, id))
WRAP(vmm_arena_status, vmm_arena_unpin, (vmm_arena * a, vmm_arena_id id), (a, id))
WRAP(vmm_arena_status, vmm_arena_set_tag, (vmm_arena * a, vmm_arena_id id, uint32_t tag), (a, id, tag))
WRAP(vmm_arena_status, vmm_arena_sleep, (vmm_arena * a, uint32_t tag, uint32_t flags), (a, tag, flags))
WRAP(vmm_arena_status, vmm_arena_set_backup_cache, (vmm_arena * a, uint32_t keep), (a, keep))
WRAP(vmm_arena_status, vmm_arena_release_backup_cache, (vmm_arena * a, uint64_t *released), (a, released))
WRAP(vmm_arena_status, vmm_arena_read_backup, (vmm_arena * a, vmm_arena_id id, uint64_t offset, void *dst, size_t len),
     (a, id, offset, dst, len))
WRAP(vmm_arena_status, vmm_arena_kv_layout_get,
     (const vmm_arena_kv_geometry *g, uint64_t chunk, uint64_t block_tokens, vmm_arena_kv_layout *out),
     (g, chunk, block_tokens, out))
WRAP(vmm_arena_status, vmm_arena_kv_token_offset,
     (const vmm_arena_kv_geometry *g, uint64_t chunk, uint64_t block_tokens, uint32_t layer, uint32_t value,
      uint64_t token, uint64_t *out),
     (g, chunk, block_tokens, layer, value, token, out))
WRAP(vmm_arena_status, vmm_arena_block_table,
     (vmm_arena * a, vmm_arena_id id, int32_t *blocks, size_t cap, size_t *count), (a, id, blocks, cap, count))
WRAP(vmm_arena_status, vmm_arena_va_range, (vmm_arena * a, uint64_t *base, uint64_t *bytes), (a, base, bytes))
WRAP(vmm_arena_status, vmm_arena_wake, (vmm_arena * a, uint32_t tag), (a, tag))
WRAP(vmm_arena_status, vmm_arena_compact, (vmm_arena * a, vmm_arena_compact_report *r), (a, r))
WRAP(vmm_arena_status, vmm_arena_release_retired, (vmm_arena * a), (a))
WRAP(vmm_arena_status, vmm_arena_trim, (vmm_arena * a, uint64_t keep, uint64_t *out), (a, keep, out))
WRAP(vmm_arena_status, vmm_arena_stats_get, (vmm_arena * a, vmm_arena_stats *s), (a, s))
WRAP(vmm_arena_status, vmm_arena_set_move_callback, (vmm_arena * a, vmm_arena_move_fn fn, void *user),
     (a, fn, user))
WRAP(vmm_arena_status, vmm_arena_snapshot_json, (vmm_arena * a, char *buf, size_t cap, size_t *len),
     (a, buf, cap, len))
WRAP(vmm_arena_status, vmm_arena_free_on_stream, (vmm_arena * a, vmm_arena_id id, uint64_t stream), (a, id, stream))
WRAP(vmm_arena_status, vmm_arena_set_prefetch, (vmm_arena * a, uint64_t precreate, uint64_t ahead), (a, precreate, ahead))
WRAP(vmm_arena_status, vmm_arena_set_admission_prefetch, (vmm_arena * a, uint64_t reservation, uint64_t ready, uint32_t count),
     (a, reservation, ready, count))
WRAP(vmm_arena_status, vmm_arena_maintain, (vmm_arena * a), (a))
WRAP(vmm_arena_status, vmm_arena_resize_many,
     (vmm_arena * a, const vmm_arena_id *ids, const uint64_t *sizes, size_t n, uint64_t *out), (a, ids, sizes, n, out))

/* Device groups (test_group.c's threads share one group). */
WRAP(vmm_arena_status, vmm_arena_group_create,
     (const vmm_arena_config *c, const int32_t *devices, uint32_t count, uint32_t flags, struct vmm_arena_group **out),
     (c, devices, count, flags, out))
WRAP_VOID(vmm_arena_group_destroy, (struct vmm_arena_group * g), (g))
WRAP(int32_t, vmm_arena_group_last_member, (void), ())
WRAP(vmm_arena_status, vmm_arena_group_member_count, (struct vmm_arena_group * g, uint32_t *n), (g, n))
WRAP(vmm_arena_status, vmm_arena_group_alloc,
     (struct vmm_arena_group * g, uint64_t size, vmm_arena_group_id *id, uint64_t *ptrs, uint32_t n),
     (g, size, id, ptrs, n))
WRAP(vmm_arena_status, vmm_arena_group_alloc_growable,
     (struct vmm_arena_group * g, uint64_t size, uint64_t max, vmm_arena_group_id *id, uint64_t *ptrs, uint32_t n),
     (g, size, max, id, ptrs, n))
WRAP(vmm_arena_status, vmm_arena_group_resize,
     (struct vmm_arena_group * g, vmm_arena_group_id id, uint64_t size, uint64_t *ptrs, uint32_t n),
     (g, id, size, ptrs, n))
WRAP(vmm_arena_status, vmm_arena_group_free, (struct vmm_arena_group * g, vmm_arena_group_id id), (g, id))
WRAP(vmm_arena_status, vmm_arena_group_query,
     (struct vmm_arena_group * g, vmm_arena_group_id id, uint32_t m, uint64_t *p, uint64_t *size, vmm_arena_id *mid),
     (g, id, m, p, size, mid))
WRAP(vmm_arena_status, vmm_arena_group_stats_get, (struct vmm_arena_group * g, uint32_t m, vmm_arena_stats *s),
     (g, m, s))
WRAP(vmm_arena_status, vmm_arena_group_snapshot_json,
     (struct vmm_arena_group * g, char *buf, size_t cap, size_t *len), (g, buf, cap, len))
WRAP(vmm_arena_status, vmm_arena_group_create_with_configs,
     (const vmm_arena_config *c, uint32_t count, uint32_t flags, struct vmm_arena_group **out), (c, count, flags, out))
WRAP(vmm_arena_status, vmm_arena_group_member, (struct vmm_arena_group * g, uint32_t m, vmm_arena **out), (g, m, out))

/* Export and import (closing an export drops its pin, which the arena reads). */
WRAP(vmm_arena_status, vmm_arena_export_open, (vmm_arena * a, vmm_arena_id id, vmm_arena_export **out), (a, id, out))
WRAP(vmm_arena_status, vmm_arena_export_layout_get, (const vmm_arena_export *h, vmm_arena_export_layout *l), (h, l))
WRAP(vmm_arena_status, vmm_arena_export_fds, (const vmm_arena_export *h, int32_t *fds, size_t cap, size_t *n),
     (h, fds, cap, n))
WRAP_VOID(vmm_arena_export_close, (vmm_arena_export * h), (h))
WRAP(vmm_arena_status, vmm_arena_import,
     (vmm_arena * a, const vmm_arena_export_layout *l, const int32_t *fds, size_t count, uint32_t flags,
      vmm_arena_id *id, uint64_t *p),
     (a, l, fds, count, flags, id, p))
WRAP(vmm_arena_status, vmm_arena_export_dmabuf, (vmm_arena * a, vmm_arena_id id, int32_t *fd), (a, id, fd))
WRAP(vmm_arena_status, vmm_arena_sharing_stats,
     (vmm_arena * a, uint64_t *imported, uint64_t *imported_bytes, uint64_t *exported),
     (a, imported, imported_bytes, exported))
WRAP(vmm_arena_status, vmm_arena_export_send, (const vmm_arena_export *h, int32_t sock), (h, sock))
WRAP(vmm_arena_status, vmm_arena_import_recv,
     (vmm_arena * a, int32_t sock, uint32_t flags, vmm_arena_id *id, uint64_t *p), (a, sock, flags, id, p))

/* DMA-BUF handles (closing one may let the arena reap a held free). */
WRAP(vmm_arena_status, vmm_arena_dmabuf_open, (vmm_arena * a, vmm_arena_id id, vmm_arena_dmabuf **out), (a, id, out))
WRAP(vmm_arena_status, vmm_arena_dmabuf_fd, (const vmm_arena_dmabuf *h, int32_t *fd, uint64_t *bytes), (h, fd, bytes))
WRAP_VOID(vmm_arena_dmabuf_close, (vmm_arena_dmabuf * h), (h))

/* Two-phase operations. */
WRAP(vmm_arena_status, vmm_arena_prepare_alloc,
     (vmm_arena * a, uint64_t size, uint64_t max, uint32_t flags, vmm_arena_prepared **out, vmm_arena_id *id,
      uint64_t *p),
     (a, size, max, flags, out, id, p))
WRAP(vmm_arena_status, vmm_arena_prepare_resize,
     (vmm_arena * a, vmm_arena_id id, uint64_t size, vmm_arena_prepared **out, uint64_t *p), (a, id, size, out, p))
WRAP(vmm_arena_status, vmm_arena_prepare_free, (vmm_arena * a, vmm_arena_id id, vmm_arena_prepared **out),
     (a, id, out))
WRAP(vmm_arena_status, vmm_arena_commit, (vmm_arena * a, vmm_arena_prepared *p), (a, p))
WRAP(vmm_arena_status, vmm_arena_abort, (vmm_arena * a, vmm_arena_prepared *p), (a, p))
