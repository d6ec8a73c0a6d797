// A C++ program written only from the contract header (abi/vmm_arena.h):
// nothing here knows the library beyond the contract's names, types and
// documented behaviour. The test suite compiles it against the contract
// header and against ffi/include/vmm_arena.h, links libvmm_arena, runs it.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

#include "vmm_arena.h"

namespace {

int checks = 0;

#define REQUIRE(cond)                                                                           \
  do {                                                                                          \
    if (!(cond)) {                                                                              \
      std::fprintf(stderr, "%s:%d: REQUIRE failed: %s (last error: \"%s\")\n", __FILE__,        \
                   __LINE__, #cond, vmm_arena_last_error());                                    \
      std::printf("%d passed, 1 failed\n", checks);                                             \
      std::exit(1);                                                                             \
    }                                                                                           \
    checks++;                                                                                   \
  } while (0)

#define REQUIRE_STATUS(call, want)                                                              \
  do {                                                                                          \
    vmm_arena_status s_ = (call);                                                               \
    if (s_ != (want)) {                                                                         \
      std::fprintf(stderr, "%s:%d: %s gave %s, expected %s (last error: \"%s\")\n", __FILE__,   \
                   __LINE__, #call, vmm_arena_status_name(s_), vmm_arena_status_name(want),     \
                   vmm_arena_last_error());                                                     \
      std::printf("%d passed, 1 failed\n", checks);                                             \
      std::exit(1);                                                                             \
    }                                                                                           \
    checks++;                                                                                   \
  } while (0)

// A runtime's view of its buffers: id -> current address, kept fresh by the
// move callback.
struct Registry {
  std::unordered_map<vmm_arena_id, uint64_t> where;
  int moves = 0;
};

extern "C" void on_move(void *user, vmm_arena_id id, uint64_t old_ptr, uint64_t new_ptr, uint64_t size) {
  auto *r = static_cast<Registry *>(user);
  (void)size;
  if (r->where[id] == old_ptr) r->where[id] = new_ptr;
  r->moves++;
}

vmm_arena_stats stats(vmm_arena *a) {
  vmm_arena_stats s;
  std::memset(&s, 0, sizeof s);
  s.struct_size = sizeof s;
  REQUIRE_STATUS(vmm_arena_stats_get(a, &s), VMM_ARENA_OK);
  return s;
}

}  // namespace

int main() {
  REQUIRE(vmm_arena_abi_version() == VMM_ARENA_ABI_VERSION);
  REQUIRE(std::string(vmm_arena_status_name(VMM_ARENA_ERR_OUT_OF_ADDRESS_SPACE)) ==
          "VMM_ARENA_ERR_OUT_OF_ADDRESS_SPACE");
  REQUIRE(std::string(vmm_arena_last_error()).empty());

  vmm_arena_config cfg;
  vmm_arena_config_default(&cfg);
  REQUIRE(cfg.backend == VMM_ARENA_BACKEND_CUDA && cfg.retain_bytes == UINT64_MAX);
  cfg.backend = VMM_ARENA_BACKEND_HOST;
  const uint64_t chunk = 1 << 16;
  cfg.chunk_bytes = chunk;
  cfg.capacity_bytes = 8 * chunk;
  cfg.reserve_bytes = 8 * chunk;
  vmm_arena *arena = nullptr;
  cfg.flags = 0x10;  // an unknown flag
  REQUIRE_STATUS(vmm_arena_create(&cfg, &arena), VMM_ARENA_ERR_INVALID_ARGUMENT);
  REQUIRE(arena == nullptr && !std::string(vmm_arena_last_error()).empty());
  cfg.flags = 0;
  REQUIRE_STATUS(vmm_arena_create(&cfg, &arena), VMM_ARENA_OK);

  Registry reg;
  REQUIRE_STATUS(vmm_arena_set_move_callback(arena, on_move, &reg), VMM_ARENA_OK);

  // Sequences that grow: two growable buffers side by side.
  vmm_arena_id a = 0, b = 0;
  uint64_t pa = 0, pb = 0;
  REQUIRE_STATUS(vmm_arena_alloc_growable(arena, 100, 2 * chunk, &a, &pa), VMM_ARENA_OK);
  REQUIRE_STATUS(vmm_arena_alloc_growable(arena, 100, 2 * chunk, &b, &pb), VMM_ARENA_OK);
  REQUIRE(pa % 256 == 0 && pb % 256 == 0 && a != b && a != 0 && b != 0);
  reg.where[a] = pa;
  reg.where[b] = pb;
  std::memcpy(reinterpret_cast<void *>(pa), "sequence a", 11);
  uint64_t p = 0, sz = 0;
  REQUIRE_STATUS(vmm_arena_resize(arena, a, 2 * chunk, &p), VMM_ARENA_OK);  // within max_size
  REQUIRE(p == pa);
  REQUIRE_STATUS(vmm_arena_query(arena, a, &p, &sz), VMM_ARENA_OK);
  REQUIRE(p == pa && sz == 2 * chunk);

  // Beyond the reservation: it moves (or the arena compacts) and the
  // callback keeps the registry right; the contents come along.
  REQUIRE_STATUS(vmm_arena_resize(arena, a, 3 * chunk, &p), VMM_ARENA_OK);
  REQUIRE(reg.moves >= 1 && reg.where[a] == p);
  REQUIRE(std::strcmp(reinterpret_cast<const char *>(p), "sequence a") == 0);
  REQUIRE_STATUS(vmm_arena_query(arena, b, &p, nullptr), VMM_ARENA_OK);
  REQUIRE(reg.where[b] == p);

  // Precedence and bad inputs.
  REQUIRE_STATUS(vmm_arena_resize(arena, 987654321, 0, &p), VMM_ARENA_ERR_INVALID_ARGUMENT);
  REQUIRE_STATUS(vmm_arena_resize(arena, 987654321, chunk, &p), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
  REQUIRE_STATUS(vmm_arena_alloc(arena, 0, &a, &p), VMM_ARENA_ERR_INVALID_ARGUMENT);
  REQUIRE_STATUS(vmm_arena_alloc(arena, 100 * chunk, &a, &p), VMM_ARENA_ERR_OUT_OF_MEMORY);
  REQUIRE_STATUS(vmm_arena_alloc_growable(arena, chunk, 9 * chunk, &a, &p), VMM_ARENA_ERR_OUT_OF_ADDRESS_SPACE);
  REQUIRE_STATUS(vmm_arena_pin(arena, b), VMM_ARENA_OK);
  REQUIRE_STATUS(vmm_arena_resize(arena, b, 100 * chunk, &p), VMM_ARENA_ERR_PINNED);
  REQUIRE_STATUS(vmm_arena_unpin(arena, b), VMM_ARENA_OK);
  REQUIRE_STATUS(vmm_arena_query(arena, 0, nullptr, nullptr), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
  REQUIRE_STATUS(vmm_arena_alloc(nullptr, chunk, &a, &p), VMM_ARENA_ERR_INVALID_ARGUMENT);

  // Free, compact, trim; the numbers.
  vmm_arena_stats s = stats(arena);
  REQUIRE(s.live_allocations == 2);
  REQUIRE_STATUS(vmm_arena_free(arena, a), VMM_ARENA_OK);
  REQUIRE_STATUS(vmm_arena_free(arena, a), VMM_ARENA_ERR_UNKNOWN_ALLOCATION);
  vmm_arena_compact_report rep;
  REQUIRE_STATUS(vmm_arena_compact(arena, &rep), VMM_ARENA_OK);
  REQUIRE(rep.largest_free_va_after >= rep.largest_free_va_before);
  REQUIRE_STATUS(vmm_arena_release_retired(arena), VMM_ARENA_OK);
  uint64_t released = 0;
  REQUIRE_STATUS(vmm_arena_trim(arena, 0, &released), VMM_ARENA_OK);
  s = stats(arena);
  REQUIRE(s.pooled_bytes == 0 && s.live_allocations == 1 && s.moves == static_cast<uint64_t>(reg.moves));
  REQUIRE(s.driver_releases * chunk >= released);

  // The snapshot: ask the size, then fetch.
  size_t need = 0;
  REQUIRE_STATUS(vmm_arena_snapshot_json(arena, nullptr, 0, &need), VMM_ARENA_OK);
  std::vector<char> json(need);
  size_t got = 0;
  REQUIRE_STATUS(vmm_arena_snapshot_json(arena, json.data(), json.size(), &got), VMM_ARENA_OK);
  REQUIRE(got == need && std::strlen(json.data()) + 1 == need && json[0] == '{');

  REQUIRE_STATUS(vmm_arena_set_move_callback(arena, nullptr, nullptr), VMM_ARENA_OK);
  vmm_arena_destroy(arena);
  vmm_arena_destroy(nullptr);
  std::printf("contract_program: %d passed, 0 failed\n", checks);
  return 0;
}
