/*
 * context.c - explicit contexts (aclrtCreateContext and friends) and aclrtGetRunMode.
 *
 * A context is a device and a default stream of its own: what a NULL stream means while a thread is bound
 * to it.  aclrtSetDevice binds a thread to the device's default context instead, whose default stream is the
 * device's.  The binding itself lives with the current device (device.c); this file owns the contexts.
 *
 * Contexts are slots of a static table, never freed: a thread bound to a context that another thread
 * destroys reads the slot's changed generation (device.c), not freed memory.  A stream names its context by
 * slot and generation, so a destroy's sweep never takes a stream of the slot's next context.
 *
 * Handles: an explicit context's is its slot and generation, a default context's its device and the
 * device's epoch (the default context ends with the device's last aclrtResetDevice), each with its own tag
 * in the top byte so neither is taken for the other or for another object's handle.
 *
 * Locking: context_lock guards the slots' `live` flags; the device, default stream and generation are
 * atomics, which device.c reads without it.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "acl_rt.h"
#include "context.h"
#include "device.h"
#include "handle_table.h"
#include "stream.h"

enum { CONTEXT_SLOTS = 1024 };
#define EXPLICIT_TAG 'C'
#define DEFAULT_TAG 'D'

typedef struct context_slot {
    device_context ctx; /* first: device.c's pointer to it is the slot's */
    bool live;
} context_slot;

static pthread_mutex_t context_lock = PTHREAD_MUTEX_INITIALIZER;
static context_slot slots[CONTEXT_SLOTS];

/* The slot index (a device for DEFAULT_TAG) a handle of `tag` names, or -1. */
static int64_t handle_index(uint64_t h, uint8_t tag, uint32_t limit)
{
    uint32_t index1 = handle_index1(h);
    return handle_tag(h) == tag && index1 >= 1 && index1 <= limit ? (int64_t)index1 - 1 : -1;
}

/* The live slot an explicit context's handle names (context_lock held), or NULL. */
static context_slot *live_slot_locked(aclrtContext context)
{
    uint64_t h = (uint64_t)(uintptr_t)context;
    int64_t i = handle_index(h, EXPLICIT_TAG, CONTEXT_SLOTS);
    if (i < 0 || !slots[i].live || atomic_load(&slots[i].ctx.generation) != handle_generation(h))
        return NULL;
    return &slots[i];
}

/* Ends a slot's context for every thread bound to it and frees the slot (context_lock held). */
static void end_locked(context_slot *c)
{
    atomic_fetch_add_explicit(&c->ctx.generation, 1, memory_order_release);
    c->live = false;
}

aclError aclrtCreateContext(aclrtContext *context, int32_t deviceId)
{
    if (!context)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    if (!device_valid(deviceId))
        return ACL_ERROR_RT_INVALID_DEVICEID;
    pthread_mutex_lock(&context_lock);
    uint32_t index = 0;
    while (index < CONTEXT_SLOTS && slots[index].live)
        index++;
    if (index == CONTEXT_SLOTS) {
        pthread_mutex_unlock(&context_lock);
        return ACL_ERROR_RT_RESOURCE_ALLOC_FAIL;
    }
    context_slot *c = &slots[index];
    c->live = true;
    /* release: a reader still bound to the slot's last context that reads these also sees its end (the
     * generation it then reads again, device.c) */
    atomic_store_explicit(&c->ctx.device, deviceId, memory_order_release);
    atomic_store_explicit(&c->ctx.default_stream, 0, memory_order_release);
    uint32_t generation = atomic_load(&c->ctx.generation);
    pthread_mutex_unlock(&context_lock);

    aclrtStream stream;
    rc = stream_create_owned(&c->ctx, generation, &stream);
    if (rc != ACL_SUCCESS) {
        pthread_mutex_lock(&context_lock);
        end_locked(c);
        pthread_mutex_unlock(&context_lock);
        return rc;
    }
    atomic_store_explicit(&c->ctx.default_stream, (uint64_t)(uintptr_t)stream, memory_order_release);
    device_bind_context(&c->ctx, generation); /* CANN binds a new context to the thread that made it */
    *context = (aclrtContext)(uintptr_t)handle_make(EXPLICIT_TAG, generation, index);
    return ACL_SUCCESS;
}

aclError aclrtDestroyContext(aclrtContext context)
{
    if (!context)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    pthread_mutex_lock(&context_lock);
    context_slot *c = live_slot_locked(context); /* a default context's handle is not one: CANN refuses it too */
    if (c)
        end_locked(c);
    pthread_mutex_unlock(&context_lock);
    if (!c)
        return ACL_ERROR_RT_CONTEXT_NULL;
    /* Threads bound to it (the caller too) now have no context, and no new stream is made in it. */
    stream_destroy_owned(&c->ctx, handle_generation((uint64_t)(uintptr_t)context));
    return ACL_SUCCESS;
}

aclError aclrtSetCurrentContext(aclrtContext context)
{
    if (!context)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    uint64_t h = (uint64_t)(uintptr_t)context;
    int64_t dev = handle_index(h, DEFAULT_TAG, (uint32_t)device_count());
    if (dev >= 0) /* a default context, while its device is set */
        return device_bind_default_context((int32_t)dev, handle_generation(h)) ? ACL_SUCCESS
                                                                                : ACL_ERROR_RT_PARAM_INVALID;
    pthread_mutex_lock(&context_lock);
    context_slot *c = live_slot_locked(context);
    if (c)
        device_bind_context(&c->ctx, handle_generation(h));
    pthread_mutex_unlock(&context_lock);
    return c ? ACL_SUCCESS : ACL_ERROR_RT_PARAM_INVALID;
}

aclError aclrtGetCurrentContext(aclrtContext *context)
{
    if (!context)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    uint32_t generation;
    device_context *bound = device_bound_context(&generation);
    if (bound) {
        if (atomic_load(&bound->generation) != generation)
            return ACL_ERROR_RT_CONTEXT_NULL;
        uint32_t index = (uint32_t)((context_slot *)(void *)bound - slots);
        *context = (aclrtContext)(uintptr_t)handle_make(EXPLICIT_TAG, generation, index);
        return ACL_SUCCESS;
    }
    int32_t dev;
    uint32_t epoch;
    if (!device_current_default_context(&dev, &epoch))
        return ACL_ERROR_RT_CONTEXT_NULL;
    *context = (aclrtContext)(uintptr_t)handle_make(DEFAULT_TAG, epoch, (uint32_t)dev);
    return ACL_SUCCESS;
}

aclError aclrtCtxGetCurrentDefaultStream(aclrtStream *stream)
{
    if (!stream)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    int32_t dev;
    uint64_t handle;
    if ((rc = device_current_stream(&dev, &handle)) != ACL_SUCCESS)
        return rc;
    *stream = (aclrtStream)(uintptr_t)handle;
    return ACL_SUCCESS;
}

aclError aclrtGetRunMode(aclrtRunMode *runMode)
{
    if (!runMode)
        return ACL_ERROR_INVALID_PARAM;
    *runMode = ACL_HOST; /* a program on the host, driving the (virtual) device, as CANN reports it there */
    return ACL_SUCCESS;
}

/* Ends every context (their streams are the stream module's to release). */
static void end_all(void)
{
    for (uint32_t i = 0; i < CONTEXT_SLOTS; i++)
        if (slots[i].live)
            end_locked(&slots[i]);
}

void context_atfork_prepare(void) { pthread_mutex_lock(&context_lock); }

void context_atfork_parent(void) { pthread_mutex_unlock(&context_lock); }

void context_atfork_child(void)
{
    end_all(); /* the child has no contexts, as it has no streams */
    pthread_mutex_unlock(&context_lock);
}

void context_shutdown(void)
{
    pthread_mutex_lock(&context_lock);
    end_all();
    pthread_mutex_unlock(&context_lock);
}
