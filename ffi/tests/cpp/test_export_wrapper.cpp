// The C++ wrapper's RAII owners of exports and DMA-BUFs, on the host
// backend: an Export closes itself (the allocation is unpinned after), its
// descriptors are the caller's duplicates, it crosses a socket in one call;
// a DMA-BUF is Unsupported on the host and leaves the allocation as it was.
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "check.h"
#include "vmm_arena.hpp"

int main() {
  const uint64_t K = 64 << 10;
  vmm::Config cfg = vmm::Config::host().capacity(64 * K).chunk(K);
  vmm::Config exportable = cfg;
  exportable.raw().flags |= VMM_ARENA_FLAG_EXPORTABLE;
  vmm::Arena ex(exportable);
  vmm::Arena im(cfg);
  vmm::Allocation x = ex.alloc(3 * K);
  std::memcpy(reinterpret_cast<void *>(x.ptr()), "raii", 4);
  {
    vmm::Export e = vmm::Export::open(ex, x.id());
    CHECK(static_cast<bool>(e));
    vmm_arena_export_layout l = e.layout();
    CHECK(l.chunk_count == 3 && l.version == VMM_ARENA_EXPORT_FORMAT_VERSION);
    std::vector<int32_t> fds = e.dup_fds();
    CHECK(fds.size() == 3);
    for (int32_t fd : fds) close(fd);
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    e.send(sv[0]);
    vmm::Allocation y = im.import_recv(sv[1], VMM_ARENA_IMPORT_READ_ONLY);
    CHECK(std::memcmp(reinterpret_cast<const void *>(y.ptr()), "raii", 4) == 0);
    close(sv[0]);
    close(sv[1]);
    vmm::Export moved = std::move(e);
    CHECK(!e && static_cast<bool>(moved));
  }
  // Every export closed: the allocation can be unpinned and moved again.
  CHECK(vmm_arena_unpin(ex.get(), x.id()) == VMM_ARENA_OK);
  // Exported once, it keeps its chunks until freed.
  CHECK(!x.try_resize(K).ok());
  vmm::Allocation z = ex.alloc(2 * K);
  vmm::Result<vmm::DmaBuf> d = vmm::DmaBuf::try_open(ex, z.id());
  CHECK(!d.ok() && d.status() == vmm::Status::Unsupported);
  z.resize(K);  // not marked by the failed DMA-BUF

  // Groups: RAII, per-member configs, a member's own arena, and a
  // two-phase allocation aborted by its destructor, then one committed.
  vmm::Config c0 = vmm::Config::host().capacity(16 * K).chunk(K).device(3);
  vmm::Config c1 = vmm::Config::host().capacity(8 * K).chunk(K).device(4);
  vmm::Group g = vmm::Group::with_configs({c0, c1});
  CHECK(g.size() == 2);
  std::vector<uint64_t> ptrs;
  vmm_arena_group_id gid = g.alloc(1000, &ptrs);
  CHECK(ptrs.size() == 2 && ptrs[0] != 0);
  vmm::Arena m1 = g.member(1);
  CHECK(vmm_arena_pin(m1.get(), g.member_id(gid, 1)) == VMM_ARENA_OK);
  {
    vmm::Prepared p = vmm::Prepared::alloc(m1, 2 * K, 4 * K, true);
    CHECK(static_cast<bool>(p) && p.ptr() != 0);
  }  // aborted
  vmm::Prepared q = vmm::Prepared::alloc(m1, 2 * K, 4 * K, true);
  q.commit();
  CHECK(!q);
  vmm::Prepared grow = vmm::Prepared::resize(m1, q.id(), 4 * K);
  grow.commit();
  uint64_t size = 0;
  CHECK(vmm_arena_query(m1.get(), q.id(), nullptr, &size) == VMM_ARENA_OK && size == 4 * K);
  CHECK(vmm_arena_unpin(m1.get(), g.member_id(gid, 1)) == VMM_ARENA_OK);
  g.free(gid);
  FINISH("test_export_wrapper");
}
