/*
 * vmm_arena.hpp: a header-only C++17 wrapper over the vmm_arena C ABI.
 *
 *   vmm::Arena arena(vmm::Config::host().capacity(1ull << 30));
 *   vmm::Allocation kv = arena.alloc_growable(2 << 20, 256 << 20);
 *   arena.set_move_callback([&](const vmm::MoveEvent& e) { ... e.new_ptr ... });
 *   kv.resize(64 << 20);           // grows in place: same address
 *   uint64_t p = kv.ptr();         // the current address (it may move)
 *
 * - vmm::Arena and vmm::Allocation are move-only RAII owners: an Arena
 *   destroys its arena, an Allocation frees its allocation. An Allocation
 *   must not outlive its Arena.
 * - Errors throw vmm::Error, which carries the vmm::Status and the
 *   library's message. Every throwing call has a non-throwing try_*
 *   twin returning vmm::Result<T> (the status, the message, or the value).
 * - The move callback is a std::function; it runs inside the call that
 *   moved (on that thread, under the arena's lock), must not call back into
 *   the arena (such calls fail with InvalidArgument), and must not throw:
 *   an exception leaving it calls std::terminate.
 * - Like the C API, an Arena may be used from many threads at once;
 *   Allocation objects themselves are not synchronized.
 * - vmm::Export and vmm::DmaBuf own an export and a DMA-BUF handle (closed
 *   when destroyed); vmm::Group owns a device group.
 */
#ifndef VMM_ARENA_HPP
#define VMM_ARENA_HPP

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "vmm_arena.h"

namespace vmm {

/* The C statuses, as a scoped enum with the same values. */
enum class Status : uint32_t {
  Ok = VMM_ARENA_OK,
  InvalidArgument = VMM_ARENA_ERR_INVALID_ARGUMENT,
  OutOfMemory = VMM_ARENA_ERR_OUT_OF_MEMORY,
  OutOfAddressSpace = VMM_ARENA_ERR_OUT_OF_ADDRESS_SPACE,
  UnknownAllocation = VMM_ARENA_ERR_UNKNOWN_ALLOCATION,
  Pinned = VMM_ARENA_ERR_PINNED,
  Unsupported = VMM_ARENA_ERR_UNSUPPORTED,
  Driver = VMM_ARENA_ERR_DRIVER,
  Internal = VMM_ARENA_ERR_INTERNAL,
  Asleep = VMM_ARENA_ERR_ASLEEP,
};

/* Every tag (Arena::sleep, Arena::wake), and the sleep flag that keeps the bytes. */
constexpr uint32_t all_tags = VMM_ARENA_ALL_TAGS;
constexpr uint32_t sleep_backup = VMM_ARENA_SLEEP_BACKUP;

/* "VMM_ARENA_ERR_PINNED" etc.; "UNKNOWN" for other values. */
inline const char *status_name(Status s) noexcept {
  return vmm_arena_status_name(static_cast<vmm_arena_status>(static_cast<uint32_t>(s)));
}

using Id = vmm_arena_id;
using Stats = vmm_arena_stats;
using CompactReport = vmm_arena_compact_report;

/* What a failing call threw: the status and the library's message. */
class Error : public std::runtime_error {
 public:
  Error(Status status, const std::string &message) : std::runtime_error(message), status_(status) {}
  Status status() const noexcept { return status_; }

 private:
  Status status_;
};

namespace detail {
inline Status to_status(vmm_arena_status s) noexcept { return static_cast<Status>(static_cast<uint32_t>(s)); }

/* The message for a failure that just happened on this thread. */
inline std::string describe(vmm_arena_status s) {
  std::string m = vmm_arena_status_name(s);
  const char *detail = vmm_arena_last_error();
  if (detail != nullptr && detail[0] != '\0') {
    m += ": ";
    m += detail;
  }
  return m;
}

inline void check(vmm_arena_status s) {
  if (s != VMM_ARENA_OK) throw Error(to_status(s), describe(s));
}
}  // namespace detail

/* A value or a failure (status and message), for the non-throwing API. */
template <class T>
class Result {
 public:
  Result(T value) : status_(Status::Ok), value_(std::move(value)) {}
  Result(Status status, std::string message) : status_(status), message_(std::move(message)) {}

  bool ok() const noexcept { return status_ == Status::Ok; }
  explicit operator bool() const noexcept { return ok(); }
  Status status() const noexcept { return status_; }
  /* The library's message; "" on success. */
  const std::string &message() const noexcept { return message_; }

  /* The value; throws the Error when there is none. */
  T &value() & {
    throw_if_failed();
    return *value_;
  }
  T &&value() && {
    throw_if_failed();
    return std::move(*value_);
  }
  T *operator->() { return &value(); }
  T &operator*() & { return value(); }

 private:
  void throw_if_failed() const {
    if (!ok()) throw Error(status_, message_);
  }
  Status status_;
  std::string message_;
  std::optional<T> value_;
};

template <>
class Result<void> {
 public:
  Result() : status_(Status::Ok) {}
  Result(Status status, std::string message) : status_(status), message_(std::move(message)) {}
  bool ok() const noexcept { return status_ == Status::Ok; }
  explicit operator bool() const noexcept { return ok(); }
  Status status() const noexcept { return status_; }
  const std::string &message() const noexcept { return message_; }
  void value() const {
    if (!ok()) throw Error(status_, message_);
  }

 private:
  Status status_;
  std::string message_;
};

namespace detail {
template <class T>
Result<T> failure(vmm_arena_status s) {
  try {
    return Result<T>(to_status(s), describe(s));
  } catch (...) { /* out of memory for the message */
    return Result<T>(to_status(s), std::string());
  }
}
}  // namespace detail

/* Arena configuration; the defaults are the C ABI's (backend CUDA). */
class Config {
 public:
  Config() noexcept { vmm_arena_config_default(&raw_); }
  /* The host backend (Linux memory): runs anywhere, for tests and CPU use. */
  static Config host(uint64_t capacity_bytes = 0) noexcept {
    Config c;
    c.raw_.backend = VMM_ARENA_BACKEND_HOST;
    c.raw_.capacity_bytes = capacity_bytes;
    return c;
  }
  /* The CUDA backend on `device`. */
  static Config cuda(int32_t device = 0, uint64_t capacity_bytes = 0) noexcept {
    Config c;
    c.raw_.backend = VMM_ARENA_BACKEND_CUDA;
    c.raw_.device = device;
    c.raw_.capacity_bytes = capacity_bytes;
    return c;
  }
  Config &capacity(uint64_t bytes) noexcept { return raw_.capacity_bytes = bytes, *this; }
  Config &reserve(uint64_t bytes) noexcept { return raw_.reserve_bytes = bytes, *this; }
  Config &chunk(uint64_t bytes) noexcept { return raw_.chunk_bytes = bytes, *this; }
  Config &retain(uint64_t bytes) noexcept { return raw_.retain_bytes = bytes, *this; }
  Config &device(int32_t ordinal) noexcept { return raw_.device = ordinal, *this; }
  /* A background thread of the arena's own keeps the prefetch targets
     (VMM_ARENA_FLAG_BACKGROUND); destroying the arena stops and joins it. */
  Config &background(bool on = true) noexcept {
    if (on)
      raw_.flags |= VMM_ARENA_FLAG_BACKGROUND;
    else
      raw_.flags &= ~VMM_ARENA_FLAG_BACKGROUND;
    return *this;
  }
  Config &no_implicit_moves(bool on = true) noexcept {
    if (on)
      raw_.flags |= VMM_ARENA_FLAG_NO_IMPLICIT_MOVES;
    else
      raw_.flags &= ~VMM_ARENA_FLAG_NO_IMPLICIT_MOVES;
    return *this;
  }
  const vmm_arena_config &raw() const noexcept { return raw_; }
  vmm_arena_config &raw() noexcept { return raw_; }

 private:
  vmm_arena_config raw_;
};

/* One move by remapping, as the callback reports it. */
struct MoveEvent {
  Id id;
  uint64_t old_ptr;
  uint64_t new_ptr;
  uint64_t size;
};

using MoveCallback = std::function<void(const MoveEvent &)>;

class Arena;

/* Owns one allocation: frees it when destroyed (unless released). */
class Allocation {
 public:
  Allocation() noexcept = default;
  Allocation(const Allocation &) = delete;
  Allocation &operator=(const Allocation &) = delete;
  Allocation(Allocation &&o) noexcept : arena_(o.arena_), id_(std::exchange(o.id_, 0)) {}
  Allocation &operator=(Allocation &&o) noexcept {
    if (this != &o) {
      reset();
      arena_ = o.arena_;
      id_ = std::exchange(o.id_, 0);
    }
    return *this;
  }
  ~Allocation() { reset(); }

  /* Takes ownership of `id` in the arena `arena` (a C handle). */
  static Allocation adopt(vmm_arena *arena, Id id) noexcept { return Allocation(arena, id); }

  explicit operator bool() const noexcept { return id_ != 0; }
  Id id() const noexcept { return id_; }

  /* The current address: ask again after anything that may move it. */
  uint64_t ptr() const {
    uint64_t p = 0;
    detail::check(vmm_arena_query(arena_, id_, &p, nullptr));
    return p;
  }
  /* A typed pointer to the current address (host backend: dereferenceable;
   * CUDA backend: a device pointer). */
  template <class T>
  T *as() const {
    return reinterpret_cast<T *>(static_cast<uintptr_t>(ptr()));
  }
  uint64_t size() const {
    uint64_t s = 0;
    detail::check(vmm_arena_query(arena_, id_, nullptr, &s));
    return s;
  }

  /* Grows or shrinks, keeping the first min(old, new) bytes; returns the
   * (maybe new) address. */
  uint64_t resize(uint64_t new_size) {
    uint64_t p = 0;
    detail::check(vmm_arena_resize(arena_, id_, new_size, &p));
    return p;
  }
  Result<uint64_t> try_resize(uint64_t new_size) noexcept {
    uint64_t p = 0;
    vmm_arena_status s = vmm_arena_resize(arena_, id_, new_size, &p);
    if (s != VMM_ARENA_OK) return detail::failure<uint64_t>(s);
    return p;
  }
  /* Resizes like resize(); a shrink is also ordered after the work queued
     so far on `stream` (a CUstream, 0: the legacy default stream), so that
     the chunks it drops are reused or given back without a device
     synchronize once that work is done: see vmm_arena_resize_on_stream. */
  uint64_t resize_on_stream(uint64_t new_size, uint64_t stream) {
    uint64_t p = 0;
    detail::check(vmm_arena_resize_on_stream(arena_, id_, new_size, stream, &p));
    return p;
  }
  Result<uint64_t> try_resize_on_stream(uint64_t new_size, uint64_t stream) noexcept {
    uint64_t p = 0;
    vmm_arena_status s = vmm_arena_resize_on_stream(arena_, id_, new_size, stream, &p);
    if (s != VMM_ARENA_OK) return detail::failure<uint64_t>(s);
    return p;
  }
  /* Promises that no more device work uses this allocation after the work
     queued so far on `stream` (a CUstream, 0: the legacy default stream),
     until it grows: what it gives up later (free, shrink, a move's old
     range) is then reused or given back without a device synchronize. Do
     not queue work through it before it grows again: see
     vmm_arena_quiesce_on_stream. */
  void quiesce_on_stream(uint64_t stream) { detail::check(vmm_arena_quiesce_on_stream(arena_, id_, stream)); }
  Result<void> try_quiesce_on_stream(uint64_t stream) noexcept {
    vmm_arena_status s = vmm_arena_quiesce_on_stream(arena_, id_, stream);
    if (s != VMM_ARENA_OK) return detail::failure<void>(s);
    return Result<void>();
  }
  /* Ends that promise, before queueing work through it again without
     growing it (see vmm_arena_unquiesce). */
  void unquiesce() { detail::check(vmm_arena_unquiesce(arena_, id_)); }
  Result<void> try_unquiesce() noexcept {
    vmm_arena_status s = vmm_arena_unquiesce(arena_, id_);
    if (s != VMM_ARENA_OK) return detail::failure<void>(s);
    return Result<void>();
  }
  void pin() { detail::check(vmm_arena_pin(arena_, id_)); }
  void unpin() { detail::check(vmm_arena_unpin(arena_, id_)); }
  /* The tag Arena::sleep and Arena::wake select by. Every allocation takes
     one; a small one moves (by copy) into a slab of the new tag, which a
     pinned (Pinned) or sleeping (Asleep) one refuses (see vmm_arena_set_tag). */
  void set_tag(uint32_t tag) { detail::check(vmm_arena_set_tag(arena_, id_, tag)); }
  Result<void> try_set_tag(uint32_t tag) noexcept {
    vmm_arena_status s = vmm_arena_set_tag(arena_, id_, tag);
    if (s != VMM_ARENA_OK) return detail::failure<void>(s);
    return Result<void>();
  }

  /* Frees now (no-op when empty); errors are ignored, as in a destructor. */
  void reset() noexcept {
    if (id_ != 0) (void)vmm_arena_free(arena_, std::exchange(id_, 0));
  }
  /* Frees now and reports failure. */
  void free() {
    if (id_ != 0) detail::check(vmm_arena_free(arena_, std::exchange(id_, 0)));
  }
  /* Frees ordered after the work queued so far on `stream` (a CUstream, 0:
     the legacy default stream): see vmm_arena_free_on_stream. Empty after,
     even on failure (the id is given up either way, as by reset()). */
  void free_on_stream(uint64_t stream) {
    if (id_ != 0) detail::check(vmm_arena_free_on_stream(arena_, std::exchange(id_, 0), stream));
  }
  /* Gives up ownership: the caller frees the id. */
  Id release() noexcept { return std::exchange(id_, 0); }

 private:
  friend class Arena;
  Allocation(vmm_arena *arena, Id id) noexcept : arena_(arena), id_(id) {}
  vmm_arena *arena_ = nullptr;
  Id id_ = 0;
};

/* Pins an allocation for a scope: it does not move meanwhile. */
class PinGuard {
 public:
  explicit PinGuard(Allocation &a) : a_(&a) { a.pin(); }
  PinGuard(const PinGuard &) = delete;
  PinGuard &operator=(const PinGuard &) = delete;
  ~PinGuard() {
    try {
      a_->unpin();
    } catch (...) {
    }
  }

 private:
  Allocation *a_;
};

/* Owns one arena. */
class Arena {
 public:
  /* Creates an arena; throws Error. */
  explicit Arena(const Config &config = Config::host()) {
    detail::check(vmm_arena_create(&config.raw(), &handle_));
  }
  /* Creates an arena without throwing. */
  static Result<Arena> create(const Config &config = Config::host()) noexcept {
    vmm_arena *h = nullptr;
    vmm_arena_status s = vmm_arena_create(&config.raw(), &h);
    if (s != VMM_ARENA_OK) return detail::failure<Arena>(s);
    return Arena(h);
  }
  Arena(const Arena &) = delete;
  Arena &operator=(const Arena &) = delete;
  Arena(Arena &&o) noexcept : handle_(std::exchange(o.handle_, nullptr)), callback_(std::move(o.callback_)) {}
  Arena &operator=(Arena &&o) noexcept {
    if (this != &o) {
      destroy();
      handle_ = std::exchange(o.handle_, nullptr);
      callback_ = std::move(o.callback_);
    }
    return *this;
  }
  ~Arena() { destroy(); }

  /* The C handle, for calls the wrapper does not cover. */
  vmm_arena *get() const noexcept { return handle_; }
  explicit operator bool() const noexcept { return handle_ != nullptr; }

  Allocation alloc(uint64_t size) {
    return new_allocation(vmm_arena_alloc, size);
  }
  Result<Allocation> try_alloc(uint64_t size) noexcept {
    return try_new_allocation(vmm_arena_alloc, size);
  }
  /* alloc with a tag: it sleeps and wakes with tag; a small one goes into a
   * slab of that tag only (see vmm_arena_alloc_tagged). */
  Allocation alloc_tagged(uint64_t size, uint32_t tag) {
    return new_allocation(vmm_arena_alloc_tagged, size, tag);
  }
  Result<Allocation> try_alloc_tagged(uint64_t size, uint32_t tag) noexcept {
    return try_new_allocation(vmm_arena_alloc_tagged, size, tag);
  }
  /* alloc_growable with a tag (see alloc_tagged). */
  Allocation alloc_growable_tagged(uint64_t size, uint64_t max_size, uint32_t tag) {
    return new_allocation(vmm_arena_alloc_growable_tagged, size, max_size, tag);
  }
  Result<Allocation> try_alloc_growable_tagged(uint64_t size, uint64_t max_size, uint32_t tag) noexcept {
    return try_new_allocation(vmm_arena_alloc_growable_tagged, size, max_size, tag);
  }
  /* Reserves address space for max_size, backs size: growth up to
   * max_size never moves it. */
  Allocation alloc_growable(uint64_t size, uint64_t max_size) {
    return new_allocation(vmm_arena_alloc_growable, size, max_size);
  }
  Result<Allocation> try_alloc_growable(uint64_t size, uint64_t max_size) noexcept {
    return try_new_allocation(vmm_arena_alloc_growable, size, max_size);
  }
  /* Allocations whose work is ordered on stream (a CUstream; 0 = the legacy
   * default stream): they may take memory freed or shrunk on that same
   * stream at once, with no event wait and no synchronization; memory given
   * up on another stream is reused only after its event. See
   * vmm_arena_alloc_on_stream; grow them with resize_on_stream on the same
   * stream. Errors: as alloc() and alloc_growable(). */
  Allocation alloc_on_stream(uint64_t size, uint64_t stream) {
    return new_allocation(vmm_arena_alloc_on_stream, size, stream);
  }
  Result<Allocation> try_alloc_on_stream(uint64_t size, uint64_t stream) noexcept {
    return try_new_allocation(vmm_arena_alloc_on_stream, size, stream);
  }
  Allocation alloc_growable_on_stream(uint64_t size, uint64_t max_size, uint64_t stream) {
    return new_allocation(vmm_arena_alloc_growable_on_stream, size, max_size, stream);
  }
  Result<Allocation> try_alloc_growable_on_stream(uint64_t size, uint64_t max_size, uint64_t stream) noexcept {
    return try_new_allocation(vmm_arena_alloc_growable_on_stream, size, max_size, stream);
  }
  /* Zero-copy sharing: a new growable allocation (size bytes, reserving
   * max_size) whose first bytes are src's chunks of [src_offset, src_offset +
   * bytes), mapped a second time; writes through either are seen through the
   * other (see vmm_arena_alloc_shared for the argument rules). */
  Allocation alloc_shared(Id src, uint64_t src_offset, uint64_t bytes, uint64_t max_size) {
    return new_allocation(vmm_arena_alloc_shared, src, src_offset, bytes, max_size);
  }
  Allocation alloc_shared(const Allocation &src, uint64_t src_offset, uint64_t bytes, uint64_t max_size) {
    return alloc_shared(src.id(), src_offset, bytes, max_size);
  }
  Result<Allocation> try_alloc_shared(Id src, uint64_t src_offset, uint64_t bytes, uint64_t max_size) noexcept {
    return try_new_allocation(vmm_arena_alloc_shared, src, src_offset, bytes, max_size);
  }
  Result<Allocation> try_alloc_shared(const Allocation &src, uint64_t src_offset, uint64_t bytes,
                                      uint64_t max_size) noexcept {
    return try_alloc_shared(src.id(), src_offset, bytes, max_size);
  }

  CompactReport compact() {
    CompactReport r{};
    detail::check(vmm_arena_compact(handle_, &r));
    return r;
  }
  Result<CompactReport> try_compact() noexcept {
    CompactReport r{};
    vmm_arena_status s = vmm_arena_compact(handle_, &r);
    if (s != VMM_ARENA_OK) return detail::failure<CompactReport>(s);
    return r;
  }
  void release_retired() { detail::check(vmm_arena_release_retired(handle_)); }
  /* Sleeps every awake allocation with this tag (all_tags: all), keeping
     its bytes with sleep_backup in flags; wakes them at the same addresses
     (see vmm_arena_sleep, vmm_arena_wake). Both are all or nothing. */
  void sleep(uint32_t tag, uint32_t flags = 0) { detail::check(vmm_arena_sleep(handle_, tag, flags)); }
  Result<void> try_sleep(uint32_t tag, uint32_t flags = 0) noexcept {
    vmm_arena_status s = vmm_arena_sleep(handle_, tag, flags);
    if (s != VMM_ARENA_OK) return detail::failure<void>(s);
    return Result<void>();
  }
  void wake(uint32_t tag) { detail::check(vmm_arena_wake(handle_, tag)); }
  Result<void> try_wake(uint32_t tag) noexcept {
    vmm_arena_status s = vmm_arena_wake(handle_, tag);
    if (s != VMM_ARENA_OK) return detail::failure<void>(s);
    return Result<void>();
  }
  /* Prefetch targets (see vmm_arena_set_prefetch); maintain() does the work
     now on this thread (or the background thread, Config::background). */
  void set_prefetch(uint64_t precreate_bytes, uint64_t map_ahead_bytes) {
    detail::check(vmm_arena_set_prefetch(handle_, precreate_bytes, map_ahead_bytes));
  }
  /* Admission map-ahead (see vmm_arena_set_admission_prefetch). */
  void set_admission_prefetch(uint64_t reservation_bytes, uint64_t ready_bytes, uint32_t count) {
    detail::check(vmm_arena_set_admission_prefetch(handle_, reservation_bytes, ready_bytes, count));
  }
  void maintain() { detail::check(vmm_arena_maintain(handle_)); }
  Result<void> try_maintain() noexcept {
    vmm_arena_status s = vmm_arena_maintain(handle_);
    if (s != VMM_ARENA_OK) return detail::failure<void>(s);
    return Result<void>();
  }
  /* Resizes several allocations at once, all or nothing (see
     vmm_arena_resize_many); returns their addresses, in order. */
  std::vector<uint64_t> resize_many(const std::vector<Id> &ids, const std::vector<uint64_t> &new_sizes) {
    if (ids.size() != new_sizes.size())
      throw Error(Status::InvalidArgument,
                  std::string(status_name(Status::InvalidArgument)) + ": resize_many: ids and new_sizes differ in length");
    std::vector<uint64_t> ptrs(ids.size());
    detail::check(vmm_arena_resize_many(handle_, ids.data(), new_sizes.data(), ids.size(), ptrs.data()));
    return ptrs;
  }
  /* Gives pooled memory back beyond keep_bytes; returns the bytes released. */
  uint64_t trim(uint64_t keep_bytes = 0) {
    uint64_t released = 0;
    detail::check(vmm_arena_trim(handle_, keep_bytes, &released));
    return released;
  }
  Stats stats() const {
    Stats s{};
    s.struct_size = sizeof s;
    detail::check(vmm_arena_stats_get(handle_, &s));
    return s;
  }
  Result<Stats> try_stats() const noexcept {
    Stats s{};
    s.struct_size = sizeof s;
    vmm_arena_status st = vmm_arena_stats_get(handle_, &s);
    if (st != VMM_ARENA_OK) return detail::failure<Stats>(st);
    return s;
  }
  /* The JSON snapshot of every range and the stats. */
  std::string snapshot_json() const {
    std::string out;
    for (;;) { /* the size may change between the two calls */
      size_t need = 0;
      detail::check(vmm_arena_snapshot_json(handle_, nullptr, 0, &need));
      out.assign(need, '\0');
      size_t got = 0;
      detail::check(vmm_arena_snapshot_json(handle_, &out[0], out.size(), &got));
      if (got <= need) {
        out.resize(got - 1);
        return out;
      }
    }
  }

  /* Installs the move callback (an empty function removes it). Once this
   * returns, the previous callback is not running and will not run again.
   * Safe to call from several threads at once: the last install wins. */
  /* Receives an export sent with Export::send (vmm_arena_import_recv) and
   * imports it (flags: 0 or VMM_ARENA_IMPORT_READ_ONLY). */
  Allocation import_recv(int sock, uint32_t flags = 0) {
    return new_allocation(vmm_arena_import_recv, sock, flags);
  }
  void set_move_callback(MoveCallback callback) {
    std::unique_ptr<MoveCallback> box;
    if (callback) box = std::make_unique<MoveCallback>(std::move(callback));
    {
      // The C install and the swap of the box we keep alive are one step:
      // otherwise another thread's swap could free the box the library now
      // calls. The old box is freed only after the C call returned (the
      // library then no longer runs it), and outside the lock, so that a
      // capture's destructor may itself install a callback.
      std::lock_guard<std::mutex> lock(callback_mutex_);
      detail::check(vmm_arena_set_move_callback(handle_, box ? &Arena::trampoline : nullptr, box.get()));
      std::swap(callback_, box);
    }
  }
  void clear_move_callback() { set_move_callback(MoveCallback()); }

 private:
  friend class Group;
  explicit Arena(vmm_arena *h) noexcept : handle_(h) {}
  /* The allocation made by c_fn(handle_, args..., &id, &ptr), one of the C
   * allocating calls; throws Error when it fails. */
  template <class F, class... A>
  Allocation new_allocation(F c_fn, A... args) {
    Id id = 0;
    uint64_t p = 0;
    detail::check(c_fn(handle_, args..., &id, &p));
    return Allocation(handle_, id);
  }
  /* new_allocation for the non-throwing API: the failure as a Result. */
  template <class F, class... A>
  Result<Allocation> try_new_allocation(F c_fn, A... args) noexcept {
    Id id = 0;
    uint64_t p = 0;
    vmm_arena_status s = c_fn(handle_, args..., &id, &p);
    if (s != VMM_ARENA_OK) return detail::failure<Allocation>(s);
    return Allocation(handle_, id);
  }
  void destroy() noexcept {
    vmm_arena_destroy(std::exchange(handle_, nullptr));
    callback_.reset();
  }
  static void trampoline(void *user, vmm_arena_id id, uint64_t old_ptr, uint64_t new_ptr,
                         uint64_t size) noexcept {
    (*static_cast<MoveCallback *>(user))(MoveEvent{id, old_ptr, new_ptr, size});
  }

  vmm_arena *handle_ = nullptr;
  std::unique_ptr<MoveCallback> callback_;
  // Serializes set_move_callback; not moved (each Arena object has its own).
  std::mutex callback_mutex_;
};

}  // namespace vmm

/* The owners of exports, DMA-BUFs, prepared two-phase operations and
 * groups. */
#include "vmm_arena_handles.hpp"

#endif /* VMM_ARENA_HPP */
