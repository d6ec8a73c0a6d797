/*
 * vmm_arena_handles.hpp: the C++17 wrapper's RAII owners of what an arena
 * hands out beside allocations: vmm::Export, vmm::DmaBuf, vmm::Prepared (a
 * two-phase operation) and vmm::Group. Included by vmm_arena.hpp; may be
 * included alone.
 */
#ifndef VMM_ARENA_HANDLES_HPP
#define VMM_ARENA_HANDLES_HPP

#include "vmm_arena.hpp"

namespace vmm {

/* An open export of an allocation (vmm_arena_export_open): move-only, closes
 * the export when destroyed. The allocation stays pinned while any export of
 * it is open. An Export may outlive its Arena (its descriptors keep the
 * memory alive). */
class Export {
 public:
  Export() noexcept = default;
  explicit Export(vmm_arena_export *h) noexcept : handle_(h) {}
  static Export open(Arena &arena, Id id);
  static Result<Export> try_open(Arena &arena, Id id) noexcept;
  Export(const Export &) = delete;
  Export &operator=(const Export &) = delete;
  Export(Export &&o) noexcept : handle_(std::exchange(o.handle_, nullptr)) {}
  Export &operator=(Export &&o) noexcept {
    if (this != &o) {
      vmm_arena_export_close(handle_);
      handle_ = std::exchange(o.handle_, nullptr);
    }
    return *this;
  }
  ~Export() { vmm_arena_export_close(handle_); }

  vmm_arena_export *get() const noexcept { return handle_; }
  explicit operator bool() const noexcept { return handle_ != nullptr; }

  /* The layout record to send with the descriptors. */
  vmm_arena_export_layout layout() const {
    vmm_arena_export_layout l{};
    l.struct_size = sizeof l;
    detail::check(vmm_arena_export_layout_get(handle_, &l));
    return l;
  }
  /* New duplicates of the descriptors, owned by the caller (close each). */
  std::vector<int32_t> dup_fds() const {
    size_t n = 0;
    detail::check(vmm_arena_export_fds(handle_, nullptr, 0, &n));
    std::vector<int32_t> fds(n, -1);
    if (n > 0) detail::check(vmm_arena_export_fds(handle_, fds.data(), fds.size(), &n));
    return fds;
  }
  /* Sends layout and descriptors over a connected Unix socket, in one call
   * (the peer calls Arena::import_recv). */
  void send(int sock) const { detail::check(vmm_arena_export_send(handle_, sock)); }

 private:
  vmm_arena_export *handle_ = nullptr;
};

inline Export Export::open(Arena &arena, Id id) {
  vmm_arena_export *h = nullptr;
  detail::check(vmm_arena_export_open(arena.get(), id, &h));
  return Export(h);
}
inline Result<Export> Export::try_open(Arena &arena, Id id) noexcept {
  vmm_arena_export *h = nullptr;
  vmm_arena_status s = vmm_arena_export_open(arena.get(), id, &h);
  if (s != VMM_ARENA_OK) return detail::failure<Export>(s);
  return Export(h);
}

/* An open DMA-BUF of an allocation (vmm_arena_dmabuf_open): move-only,
 * closes the handle and its descriptor when destroyed. While one is open the
 * allocation's chunks are never reused; destroy it only after every
 * registration made from fd() is gone. GPU only (Unsupported on the host). */
class DmaBuf {
 public:
  DmaBuf() noexcept = default;
  explicit DmaBuf(vmm_arena_dmabuf *h) noexcept : handle_(h) {}
  static DmaBuf open(Arena &arena, Id id) {
    vmm_arena_dmabuf *h = nullptr;
    detail::check(vmm_arena_dmabuf_open(arena.get(), id, &h));
    return DmaBuf(h);
  }
  static Result<DmaBuf> try_open(Arena &arena, Id id) noexcept {
    vmm_arena_dmabuf *h = nullptr;
    vmm_arena_status s = vmm_arena_dmabuf_open(arena.get(), id, &h);
    if (s != VMM_ARENA_OK) return detail::failure<DmaBuf>(s);
    return DmaBuf(h);
  }
  DmaBuf(const DmaBuf &) = delete;
  DmaBuf &operator=(const DmaBuf &) = delete;
  DmaBuf(DmaBuf &&o) noexcept : handle_(std::exchange(o.handle_, nullptr)) {}
  DmaBuf &operator=(DmaBuf &&o) noexcept {
    if (this != &o) {
      vmm_arena_dmabuf_close(handle_);
      handle_ = std::exchange(o.handle_, nullptr);
    }
    return *this;
  }
  ~DmaBuf() { vmm_arena_dmabuf_close(handle_); }

  vmm_arena_dmabuf *get() const noexcept { return handle_; }
  explicit operator bool() const noexcept { return handle_ != nullptr; }
  /* The descriptor (still owned by this handle) and the bytes it spans. */
  int32_t fd() const {
    int32_t fd = -1;
    detail::check(vmm_arena_dmabuf_fd(handle_, &fd, nullptr));
    return fd;
  }
  uint64_t bytes() const {
    int32_t fd = -1;
    uint64_t n = 0;
    detail::check(vmm_arena_dmabuf_fd(handle_, &fd, &n));
    return n;
  }

 private:
  vmm_arena_dmabuf *handle_ = nullptr;
};

/* A prepared two-phase operation (vmm_arena_prepare_*): move-only; commit()
 * or abort() consumes it, and one destroyed untouched is aborted. Every
 * rank prepares, the engine's collective agrees, every rank commits (or
 * aborts). It must not outlive its Arena. */
class Prepared {
 public:
  Prepared() noexcept = default;
  Prepared(vmm_arena *arena, vmm_arena_prepared *p, Id id, uint64_t ptr) noexcept
      : arena_(arena), handle_(p), id_(id), ptr_(ptr) {}
  Prepared(const Prepared &) = delete;
  Prepared &operator=(const Prepared &) = delete;
  Prepared(Prepared &&o) noexcept
      : arena_(o.arena_), handle_(std::exchange(o.handle_, nullptr)), id_(o.id_), ptr_(o.ptr_) {}
  Prepared &operator=(Prepared &&o) noexcept {
    if (this != &o) {
      try_abort();
      arena_ = o.arena_;
      handle_ = std::exchange(o.handle_, nullptr);
      id_ = o.id_;
      ptr_ = o.ptr_;
    }
    return *this;
  }
  ~Prepared() { try_abort(); }

  explicit operator bool() const noexcept { return handle_ != nullptr; }
  /* The allocation it acts on, and its address when prepared. */
  Id id() const noexcept { return id_; }
  uint64_t ptr() const noexcept { return ptr_; }

  static Prepared alloc(Arena &arena, uint64_t size, uint64_t max_size, bool growable) {
    vmm_arena_prepared *p = nullptr;
    Id id = 0;
    uint64_t ptr = 0;
    detail::check(vmm_arena_prepare_alloc(arena.get(), size, max_size, growable ? VMM_ARENA_PREPARE_GROWABLE : 0, &p,
                                          &id, &ptr));
    return Prepared(arena.get(), p, id, ptr);
  }
  static Prepared resize(Arena &arena, Id id, uint64_t new_size) {
    vmm_arena_prepared *p = nullptr;
    uint64_t ptr = 0;
    detail::check(vmm_arena_prepare_resize(arena.get(), id, new_size, &p, &ptr));
    return Prepared(arena.get(), p, id, ptr);
  }
  static Prepared free(Arena &arena, Id id) {
    vmm_arena_prepared *p = nullptr;
    detail::check(vmm_arena_prepare_free(arena.get(), id, &p));
    return Prepared(arena.get(), p, id, 0);
  }
  void commit() { detail::check(vmm_arena_commit(arena_, std::exchange(handle_, nullptr))); }
  void abort() { detail::check(vmm_arena_abort(arena_, std::exchange(handle_, nullptr))); }

 private:
  void try_abort() noexcept {
    if (handle_) (void)vmm_arena_abort(arena_, std::exchange(handle_, nullptr));
  }
  vmm_arena *arena_ = nullptr;
  vmm_arena_prepared *handle_ = nullptr;
  Id id_ = 0;
  uint64_t ptr_ = 0;
};

/* A device group (vmm_arena_group_create): move-only, destroys the group
 * (every member) when destroyed. Safe to use from many threads at once, as
 * the C group. */
class Group {
 public:
  Group() noexcept = default;
  /* One member per device, each configured by `config`. */
  Group(const Config &config, const std::vector<int32_t> &devices, uint32_t flags = 0) {
    detail::check(vmm_arena_group_create(&config.raw(), devices.data(), static_cast<uint32_t>(devices.size()),
                                         flags, &handle_));
  }
  /* A configuration per member (its device field names the member's device). */
  static Group with_configs(const std::vector<Config> &configs, uint32_t flags = 0) {
    std::vector<vmm_arena_config> raw;
    for (const Config &c : configs) raw.push_back(c.raw());
    Group g;
    detail::check(vmm_arena_group_create_with_configs(raw.data(), static_cast<uint32_t>(raw.size()), flags,
                                                      &g.handle_));
    return g;
  }
  Group(const Group &) = delete;
  Group &operator=(const Group &) = delete;
  Group(Group &&o) noexcept : handle_(std::exchange(o.handle_, nullptr)) {}
  Group &operator=(Group &&o) noexcept {
    if (this != &o) {
      vmm_arena_group_destroy(handle_);
      handle_ = std::exchange(o.handle_, nullptr);
    }
    return *this;
  }
  ~Group() { vmm_arena_group_destroy(handle_); }

  vmm_arena_group *get() const noexcept { return handle_; }
  uint32_t size() const {
    uint32_t n = 0;
    detail::check(vmm_arena_group_member_count(handle_, &n));
    return n;
  }
  /* Member k's own arena (vmm_arena_group_member): an Arena whose
   * destruction releases the handle only; it may outlive the Group. */
  Arena member(uint32_t k) const {
    vmm_arena *h = nullptr;
    detail::check(vmm_arena_group_member(handle_, k, &h));
    return Arena(h);
  }
  /* Allocates on every member, all or nothing; returns the group id and
   * each member's address. The caller frees it with free(). */
  vmm_arena_group_id alloc(uint64_t size, std::vector<uint64_t> *ptrs = nullptr) {
    std::vector<uint64_t> p(size_());
    vmm_arena_group_id id = 0;
    detail::check(vmm_arena_group_alloc(handle_, size, &id, p.data(), static_cast<uint32_t>(p.size())));
    if (ptrs) *ptrs = std::move(p);
    return id;
  }
  vmm_arena_group_id alloc_growable(uint64_t size, uint64_t max_size, std::vector<uint64_t> *ptrs = nullptr) {
    std::vector<uint64_t> p(size_());
    vmm_arena_group_id id = 0;
    detail::check(
        vmm_arena_group_alloc_growable(handle_, size, max_size, &id, p.data(), static_cast<uint32_t>(p.size())));
    if (ptrs) *ptrs = std::move(p);
    return id;
  }
  std::vector<uint64_t> resize(vmm_arena_group_id id, uint64_t new_size) {
    std::vector<uint64_t> p(size_());
    detail::check(vmm_arena_group_resize(handle_, id, new_size, p.data(), static_cast<uint32_t>(p.size())));
    return p;
  }
  void free(vmm_arena_group_id id) { detail::check(vmm_arena_group_free(handle_, id)); }
  /* Member k's own id of a group allocation. */
  Id member_id(vmm_arena_group_id id, uint32_t k) const {
    Id m = 0;
    detail::check(vmm_arena_group_query(handle_, id, k, nullptr, nullptr, &m));
    return m;
  }

 private:
  size_t size_() const { return size(); }
  vmm_arena_group *handle_ = nullptr;
};

}  // namespace vmm

#endif /* VMM_ARENA_HANDLES_HPP */
