/*
 * Every function and every status of the vmm_arena C ABI, on the host
 * backend, with every bad input we could think of.
 *
 * Written against the contract's names only (plus the library's testing
 * hooks, declared in api.h), so it compiles against the contract header
 * abi/vmm_arena.h as well as against ffi/include/vmm_arena.h; the test
 * suite builds it both ways, with -fsanitize=address,undefined.
 *
 * The tests are in api_*.c, one file per area; api.h holds what they share.
 * This file runs them in order.
 */
#include "api.h"

int main(void) {
  setvbuf(stdout, NULL, _IONBF, 0);
  struct {
    const char *name;
    void (*run)(void);
  } tests[] = {
      {"meta", test_meta},
      {"config_and_create", test_config_and_create},
      {"bad_arguments", test_bad_arguments},
      {"resize_keeps_contents", test_resize_keeps_contents},
      {"compaction_keeps_contents", test_compaction_keeps_contents},
      {"implicit_moves_and_address_space", test_implicit_moves_and_address_space},
      {"small_allocations", test_small_allocations},
      {"pin", test_pin},
      {"stats_and_trim", test_stats_and_trim},
      {"snapshot", test_snapshot},
      {"callbacks", test_callbacks},
      {"poison", test_poison},
      {"driver_failures", test_driver_failures},
#ifdef VMM_ARENA_SLEEP_BACKUP
      {"sleep_wake", test_sleep_wake},
      {"alloc_shared", test_alloc_shared},
#endif
#ifdef VMM_ARENA_FLAG_BACKGROUND
      {"stream_free_and_prefetch", test_stream_free_and_prefetch},
      {"resize_on_stream", test_resize_on_stream},
      {"quiesce_on_stream", test_quiesce_on_stream},
#endif
  };
  for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++) {
    printf("test_api: %s\n", tests[i].name);
    tests[i].run();
  }
  FINISH("test_api");
}
