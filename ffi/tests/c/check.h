/* Tiny check macros shared by the C test programs (C11 and C++17). */
#ifndef VMM_ARENA_TEST_CHECK_H
#define VMM_ARENA_TEST_CHECK_H

#include <stdio.h>
#include <stdlib.h>

#include "vmm_arena.h"

#ifdef __cplusplus
#include <atomic>
static std::atomic<unsigned long> checks_passed{0};
#define CHECKS_INC() (checks_passed.fetch_add(1))
#define CHECKS_LOAD() (checks_passed.load())
#else
#include <stdatomic.h>
/* One count per program, also for a program of several translation units
 * (test_api): each defines it weak, the linker keeps one. */
__attribute__((weak)) atomic_ulong checks_passed;
#define CHECKS_INC() (atomic_fetch_add(&checks_passed, 1))
#define CHECKS_LOAD() (atomic_load(&checks_passed))
#endif

/* Every failure ends the program at once, with where and why. */
#define CHECK(cond)                                                                      \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      fprintf(stderr, "%s:%d: CHECK failed: %s (last error: \"%s\")\n", __FILE__,        \
              __LINE__, #cond, vmm_arena_last_error());                                  \
      fprintf(stdout, "%lu passed, 1 failed\n", (unsigned long)CHECKS_LOAD());           \
      exit(1);                                                                           \
    }                                                                                    \
    CHECKS_INC();                                                                        \
  } while (0)

#define EXPECT(call, want)                                                               \
  do {                                                                                   \
    vmm_arena_status got_ = (call);                                                      \
    vmm_arena_status want_ = (want);                                                     \
    if (got_ != want_) {                                                                 \
      fprintf(stderr, "%s:%d: %s returned %s, expected %s (last error: \"%s\")\n",       \
              __FILE__, __LINE__, #call, vmm_arena_status_name(got_),                    \
              vmm_arena_status_name(want_), vmm_arena_last_error());                     \
      fprintf(stdout, "%lu passed, 1 failed\n", (unsigned long)CHECKS_LOAD());           \
      exit(1);                                                                           \
    }                                                                                    \
    CHECKS_INC();                                                                        \
  } while (0)

#define OK(call) EXPECT(call, VMM_ARENA_OK)

#define FINISH(name)                                                                     \
  do {                                                                                   \
    printf("%s: %lu passed, 0 failed\n", name, (unsigned long)CHECKS_LOAD());            \
    return 0;                                                                            \
  } while (0)

#endif
