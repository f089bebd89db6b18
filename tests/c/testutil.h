/* testutil.h - shared cmocka helpers for npualloc's C tests. */
#ifndef NPUALLOC_TESTUTIL_H
#define NPUALLOC_TESTUTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "acl_rt.h"
#include "npualloc.h"
#include "sanitizer.h"

#define KiB_ ((size_t)1 << 10)
#define MiB_ ((size_t)1 << 20)
#define GiB_ ((size_t)1 << 30)

/* Steps for a randomized test: full in the release build, fewer under a sanitizer (ASan or
 * ThreadSanitizer, 5-20x slower; a random sequence on one thread gains nothing from TSan beyond its
 * first steps) and far fewer under valgrind memcheck (tools/run-valgrind.sh sets NPUALLOC_VALGRIND=1),
 * which runs ~50x slower. */
static inline int random_steps(int release, int sanitized, int valgrind)
{
    if (getenv("NPUALLOC_VALGRIND"))
        return valgrind;
#if defined(__SANITIZE_ADDRESS__) || defined(NPUALLOC_TSAN)
    (void)release;
    return sanitized;
#else
    (void)sanitized;
    return release;
#endif
}

/* A BLOCK stream callback that holds its stream until *gate (an atomic_int) is set, at most 60 s: a
 * test that fails before setting it then fails instead of hanging its teardown. */
static inline void cb_wait_gate(void *gate)
{
    const struct timespec ms = {0, 1000000};
    for (int waited = 0; waited < 60000 && !atomic_load((atomic_int *)gate); waited++)
        nanosleep(&ms, NULL);
}

/* Holds `stream` behind cb_wait_gate until *gate is set: what is queued after it waits, however
 * slowly the test's own thread goes. */
static inline void hold_stream(aclrtStream stream, atomic_int *gate)
{
    atomic_store(gate, 0);
    assert_int_equal(aclrtLaunchCallback(cb_wait_gate, gate, ACL_CALLBACK_BLOCK, stream), ACL_SUCCESS);
}

/* A new stream of the current context. */
static inline aclrtStream new_stream(void)
{
    aclrtStream s = NULL;
    assert_int_equal(aclrtCreateStream(&s), ACL_SUCCESS);
    assert_non_null(s);
    return s;
}

/* Starts a fresh runtime with the given configuration and device 0 current. */
static inline void start_runtime(int count, uint64_t hbm, uint64_t huge, uint64_t huge1g, uint64_t ddr)
{
    npualloc_shutdown();
    npualloc_config c = {count, hbm, huge, huge1g, ddr};
    char err[256];
    assert_int_equal(npualloc_configure(&c, err, sizeof err), ACL_SUCCESS);
    assert_int_equal(aclrtSetDevice(0), ACL_SUCCESS);
}

/* Teardown: everything released, nothing live. */
static inline int stop_runtime(void **state)
{
    (void)state;
    npualloc_shutdown();
    return 0;
}

static inline uint64_t free_of(aclrtMemAttr attr)
{
    size_t f = 0, t = 0;
    assert_int_equal(aclrtGetMemInfo(attr, &f, &t), ACL_SUCCESS);
    return f;
}

static inline aclrtPhysicalMemProp hbm_prop(aclrtMemAttr attr, uint32_t device)
{
    aclrtPhysicalMemProp p;
    memset(&p, 0, sizeof p);
    p.handleType = ACL_MEM_HANDLE_TYPE_NONE;
    p.allocationType = ACL_MEM_ALLOCATION_TYPE_PINNED;
    p.memAttr = attr;
    p.location.id = device;
    p.location.type = ACL_MEM_LOCATION_TYPE_DEVICE;
    return p;
}

#endif
