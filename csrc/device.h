/*
 * device.h - the virtual NPU devices: configuration, capacity accounting per page kind,
 * the calling thread's current device, and peer access.
 *
 * Capacity model (per device):
 *   HBM of `device_memory` bytes holds normal (4 KiB) pages, 2 MiB huge pages and the 1 GiB
 *   page pool.  The 1 GiB pool (`huge1g_memory`) is set aside when the device starts, so
 *   normal + huge usage never exceeds device_memory - huge1g_memory, and huge usage alone
 *   never exceeds `huge_memory`.  DDR (low-bandwidth memory, `ddr_memory`) is separate.
 *   The host has no huge pages reserved: page kinds are accounting, every page is backed by
 *   ordinary host memory.
 *
 * Locking: each device owns one mutex that guards its counters; nothing else is taken while
 * it is held.
 */
#ifndef NPUALLOC_DEVICE_H
#define NPUALLOC_DEVICE_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "acl_rt.h"
#include "npualloc.h"

#define NPU_MAX_DEVICES 64

/* Page kinds a device charges.  HBM: normal and huge pages share the HBM outside the 1 GiB pool.
 * DDR (low bandwidth): normal and huge pages share the DDR pool, which has no 1 GiB pages. */
typedef enum mem_kind { MEM_NORMAL, MEM_HUGE, MEM_HUGE1G, MEM_DDR, MEM_DDR_HUGE, MEM_KIND_COUNT } mem_kind;

/* Page size of each kind: what a charge is rounded to. */
size_t mem_kind_page_size(mem_kind kind);

/* Starts the runtime from the configured values (or the environment) on first use.
 * Returns ACL_SUCCESS, or ACL_ERROR_UNINITIALIZE when the environment is malformed
 * (npualloc_init_error() says why). Cheap after the first success. */
aclError runtime_ensure_init(void);
/* Checks the NPUALLOC_* variables that modules above this one read on their own (runtime.c sees
 * them all); false with a message naming the first malformed one. */
bool runtime_check_env(char *err, size_t errlen);

int device_count(void);
bool device_valid(int32_t dev);
const npualloc_config *device_config(void);

/* What the current-device logic reads of an explicit context (aclrtCreateContext; context.c owns them in a
 * static table and never frees one, so a thread still bound to a context another thread destroyed reads a
 * changed generation, not freed memory). */
typedef struct device_context {
    _Atomic int32_t device;          /* atomics: a thread bound to a destroyed context may read them while */
    _Atomic uint64_t default_stream; /* the slot is made a new context (its handle; 0 until made) */
    _Atomic uint32_t generation;     /* changes when the context is destroyed (and at shutdown, fork) */
} device_context;

/* The calling thread's current device: its explicit context's, else the one aclrtSetDevice made current
 * (CANN's default context of that device); ACL_ERROR_RT_CONTEXT_NULL if none, or if its explicit context was
 * destroyed. */
aclError device_current(int32_t *dev);
/* device_current, with the handle of the stream a NULL stream means: the explicit context's default stream,
 * or 0 for the device's own default stream. */
aclError device_current_stream(int32_t *dev, uint64_t *default_stream);
/* The explicit context the calling thread is bound to (NULL: none; it may have been destroyed since: check
 * its generation against *generation). */
device_context *device_bound_context(uint32_t *generation);
/* Binds the calling thread to an explicit context at its current generation; its device becomes current. */
void device_bind_context(device_context *ctx, uint32_t generation);
/* The calling thread's default context: its device and the epoch it was bound in; false when the thread is
 * bound to an explicit context, or to none, or its default context has ended. */
bool device_current_default_context(int32_t *dev, uint32_t *epoch);
/* Binds the calling thread to `dev`'s default context of `epoch`; false if that context has ended. */
bool device_bind_default_context(int32_t dev, uint32_t epoch);
/* runtime_ensure_init, then device_current: what an aclrt* call on "the current device" checks first. */
aclError runtime_current_device(int32_t *dev);

/* Charges `bytes` (already rounded to the kind's page size) to a device;
 * ACL_ERROR_RT_MEMORY_ALLOCATION when the kind's capacity is short. */
aclError device_charge(int32_t dev, mem_kind kind, size_t bytes);
void device_uncharge(int32_t dev, mem_kind kind, size_t bytes);
/* aclrtGetMemInfo semantics for one device. */
void device_mem_info(int32_t dev, aclrtMemAttr attr, size_t *free_bytes, size_t *total_bytes);

/* True when copies between the two devices were enabled (in either direction). */
bool device_peer_enabled(int32_t a, int32_t b);

/* fork(): the child starts with fresh devices and no current device. */
void device_atfork_prepare(void);
void device_atfork_parent(void);
void device_atfork_child(void);
/* Releases everything (tests use it before leak checks); devices restart on next use. */
void device_shutdown(void);

#endif
