/*
 * runtime.c - process-wide lifetime of the virtual NPU: fork handling, shutdown, counters.
 *
 * fork(): a child starts with fresh devices.  Device memory is not inherited (MADV_DONTFORK),
 * worker threads do not exist in the child, and every module's state is reset; pinned host
 * memory is kept.  The prepare handler takes every module lock in the order the code nests them
 * (graph.h, caching.h): the graph's outer locks, then the layers top first, then the leaf locks
 * that are held over no other lock.  So the child never inherits a lock held by another thread
 * mid-update.  The child's handlers unlock the mutexes (the forking thread owns them, and
 * initialising a locked mutex is undefined); rwlocks are initialised again, as glibc cannot unlock
 * them in a child (common.h, rwlock_reset_in_child).
 */
#include <pthread.h>
#include <stdatomic.h>

#include "caching.h"
#include "context.h"
#include "device.h"
#include "graph.h"
#include "host.h"
#include "ipc.h"
#include "mem.h"
#include "npualloc.h"
#include "pluggable.h"
#include "stream.h"
#include "va_space.h"
#include "vmm.h"

static void atfork_prepare(void)
{
    graph_atfork_prepare_outer();
    caching_atfork_prepare();
    ipc_atfork_prepare(); /* sharing: after the caches (its server takes a cache lock first) */
    stream_atfork_prepare();
    vmm_atfork_prepare();
    mem_atfork_prepare(); /* after the registry: copies take its read lock, then the pinned-host lock */
    va_atfork_prepare();
    graph_atfork_prepare_leaves(); /* the range registry, then its violation log */
    caching_atfork_prepare_leaves();
    pluggable_atfork_prepare();
    context_atfork_prepare();
    device_atfork_prepare();
}

static void atfork_parent(void)
{
    device_atfork_parent();
    context_atfork_parent();
    pluggable_atfork_parent();
    va_atfork_parent();
    mem_atfork_parent();
    vmm_atfork_parent();
    stream_atfork_parent();
    ipc_atfork_parent();
    caching_atfork_parent(); /* also its leaves */
    graph_atfork_parent();
}

/* Bumped when the runtime's objects go away (shutdown, fork child): handles and pointers of an
 * older generation may be handed out again and must not be used. */
bool runtime_check_env(char *err, size_t errlen)
{
    return host_check_env(err, errlen) && va_space_check_env(err, errlen) && ipc_check_env(err, errlen);
}

static _Atomic uint64_t generation = 1;

uint64_t npualloc_runtime_generation(void) { return atomic_load(&generation); }

static void atfork_child(void)
{
    atomic_fetch_add(&generation, 1);
    ipc_atfork_child(); /* sharing: no server, exports or imports in the child */
    context_atfork_child(); /* before streams: a bound thread's NULL stream must not name a stream of the parent */
    stream_atfork_child();
    vmm_atfork_child();
    va_atfork_child();
    mem_atfork_child();
    device_atfork_child();
    caching_atfork_child(); /* after streams: it releases streams, which the stream module reset */
    pluggable_atfork_child();
    graph_atfork_child();
}

__attribute__((constructor)) static void register_fork_handlers(void)
{
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

/* aclInit was called and aclFinalize not since.  The runtime does not need aclInit (it starts on
 * first use); the flag only gives aclInit/aclFinalize CANN's repeat codes. */
static atomic_bool acl_session;

aclError aclInit(const char *configPath)
{
    (void)configPath; /* CANN's JSON configuration (dump, profiling) has nothing to set here */
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    /* A repeated aclInit reports the repeat, and the runtime keeps working. */
    return atomic_exchange(&acl_session, true) ? ACL_ERROR_REPEAT_INITIALIZE : ACL_SUCCESS;
}

aclError aclFinalize(void)
{
    /* Ends the session only: memory, streams and events stay valid (npualloc_shutdown releases them). */
    return atomic_exchange(&acl_session, false) ? ACL_SUCCESS : ACL_ERROR_REPEAT_FINALIZE;
}

void npualloc_vmm_counts_get(npualloc_vmm_counts *out)
{
    if (!out)
        return;
    vmm_counts(&out->physical_handles, &out->reservations, &out->mappings);
    out->fds_kept = (size_t)host_fds_kept();
}

aclError npualloc_shutdown(void)
{
    if (npualloc_in_stream_task())
        return ACL_ERROR_RT_FEATURE_NOT_SUPPORT; /* it would have to wait for the task's own stream */
    atomic_fetch_add(&generation, 1); /* nothing of the old runtime is used while it shuts down */
    ipc_shutdown(); /* sharing: first, it drops the pins other processes hold on cached blocks */
    pluggable_shutdown(); /* the caching allocator is current again; the library is not told */
    caching_shutdown();
    context_shutdown();
    stream_shutdown();
    vmm_shutdown();
    va_shutdown();
    mem_shutdown();
    device_shutdown();
    atomic_store(&acl_session, false);
    atomic_fetch_add(&generation, 1); /* nor anything made while it did */
    return ACL_SUCCESS;
}
