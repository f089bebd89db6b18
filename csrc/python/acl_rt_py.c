/*
 * acl_rt_py.c - the pyACL face: `acl.rt.*` functions with pyACL's conventions.
 *
 * Outputs come first and `ret` last: `(dev_ptr, ret) = acl.rt.malloc(size, policy)`.
 * Arguments are positional.  A wrong type raises TypeError naming the function and the
 * argument, after pyACL's "acl.rt.NAME args parse failed: "; a value of the right type that is
 * out of range returns an ACL error code.
 * Every call that may block or make system calls releases the GIL.
 */
#include <pthread.h>
#include <string.h>
#include <time.h>

#include "acl_rt.h"
#include "binding.h"
#include "npualloc.h"
#include "pyarg.h"
#include "rt_binding.h"
#include "stream.h"

/* The functions of one pointer or handle argument that return only `ret`.  A value out of range
 * becomes BAD_HANDLE, which the C function rejects with its own code; the call releases the GIL
 * (it may wait for a stream or make system calls). */
static PyObject *call_on_handle(const char *fn, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                                const char *argname, aclError (*call)(void *))
{
    if (!check_no_kwargs(fn, kwnames) || !check_nargs(fn, nargs, 1))
        return NULL;
    void *handle = NULL;
    int conv_rc = arg_ptr(args[0], fn, argname, &handle);
    if (conv_rc == ARG_TYPE_ERROR)
        return NULL;
    if (conv_rc == ARG_OUT_OF_RANGE)
        handle = BAD_HANDLE;
    aclError rc;
    WAITING_CALL(rc = call(handle));
    return ret_or_init_error(rc);
}

#define RT_ON_HANDLE(name, argname, call)                                                                          \
    static PyObject *rt_##name(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)         \
    {                                                                                                              \
        (void)self;                                                                                                \
        return call_on_handle("acl.rt." #name, args, nargs, kwnames, argname, call);                               \
    }

/* name(first, second) -> ret for a call on two handles that only queues work (it keeps the GIL). */
#define RT_ON_TWO_HANDLES(name, first, second, call)                                                               \
    static PyObject *rt_##name(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)         \
    {                                                                                                              \
        RT_BEGIN(#name, 2);                                                                                        \
        void *a = NULL, *b = NULL;                                                                                 \
        RT_ARG_OR(arg_ptr, 0, first, a, BAD_HANDLE);                                                               \
        RT_ARG_OR(arg_ptr, 1, second, b, BAD_HANDLE);                                                              \
        return ret_or_init_error(call(a, b));                                                                      \
    }

/* ---- devices ---- */

RT_DOC(set_device, "device_id", "ret",
       "aclrtSetDevice: makes device_id the calling thread's current device and holds a\n"
       "reference to it (reset_device drops it).");
static PyObject *rt_set_device(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("set_device", 1);
    int32_t dev = 0;
    RT_ARG_OR(arg_i32, 0, "device_id", dev, BAD_DEVICE);
    return ret_or_init_error(aclrtSetDevice(dev));
}

static PyObject *do_reset(const char *fn, aclError (*reset)(int32_t), PyObject *const *args)
{
    int32_t dev = 0;
    RT_ARG_OR(arg_i32, 0, "device_id", dev, BAD_DEVICE);
    aclError rc;
    WAITING_CALL(rc = reset(dev));
    return ret_or_init_error(rc);
}

RT_DOC(reset_device, "device_id", "ret",
       "aclrtResetDevice: drops a reference set_device took; the last one waits for the\n"
       "device's streams and ends its default context for every thread bound to it.");
static PyObject *rt_reset_device(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("reset_device", 1);
    return do_reset(fn, aclrtResetDevice, args);
}

RT_DOC(reset_device_force, "device_id", "ret",
       "aclrtResetDeviceForce: as the last reset_device, whatever references remain.");
static PyObject *rt_reset_device_force(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("reset_device_force", 1);
    return do_reset(fn, aclrtResetDeviceForce, args);
}

RT_DOC0(get_device, "(device_id, ret)",
        "aclrtGetDevice: the calling thread's current device (0 and an error code without one).");
RT_OUTPUT(get_device, int32_t, aclrtGetDevice, ret_i64)

RT_DOC0(get_device_count, "(count, ret)", "aclrtGetDeviceCount: the number of devices.");
RT_OUTPUT(get_device_count, uint32_t, aclrtGetDeviceCount, ret_u64)

/* ---- contexts ---- */

RT_DOC(create_context, "device_id", "(context, ret)",
       "aclrtCreateContext: a new context on device_id, with a default stream of its own (what stream 0\n"
       "means while it is current), bound to the calling thread.");
static PyObject *rt_create_context(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("create_context", 1);
    int32_t dev = 0;
    RT_ARG_OR(arg_i32, 0, "device_id", dev, BAD_DEVICE);
    aclrtContext context = NULL;
    aclError rc = aclrtCreateContext(&context, dev);
    return ret_handle(context, rc);
}

RT_DOC(destroy_context, "context", "ret",
       "aclrtDestroyContext: destroys a context from create_context and the streams made in it (after their\n"
       "queued work); a thread bound to it has no context afterwards.");
RT_ON_HANDLE(destroy_context, "context", aclrtDestroyContext)

RT_DOC(set_context, "context", "ret",
       "aclrtSetCurrentContext: binds the calling thread to context (from create_context or get_context);\n"
       "its device becomes the current device.");
RT_ON_HANDLE(set_context, "context", aclrtSetCurrentContext)

RT_DOC0(get_context, "(context, ret)",
        "aclrtGetCurrentContext: the calling thread's context (set_device's default context of the device,\n"
        "or the one create_context or set_context bound).");
RT_OUTPUT(get_context, aclrtContext, aclrtGetCurrentContext, ret_handle)

RT_DOC0(ctx_get_current_default_stream, "(stream, ret)",
        "aclrtCtxGetCurrentDefaultStream: the default stream of the calling thread's context: an explicit\n"
        "context's own stream, or 0 for a device's default context (0 names the current device's default stream).");
RT_OUTPUT(ctx_get_current_default_stream, aclrtStream, aclrtCtxGetCurrentDefaultStream, ret_handle)

RT_DOC0(get_run_mode, "(run_mode, ret)", "aclrtGetRunMode: ACL_HOST (1): the program runs on the host.");
RT_OUTPUT(get_run_mode, aclrtRunMode, aclrtGetRunMode, ret_i64)

RT_DOC0(synchronize_device, "ret",
        "aclrtSynchronizeDevice: waits for every stream of the current device; returns a\n"
        "failed task's sticky error once.");
static PyObject *rt_synchronize_device(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("synchronize_device", 0);
    (void)args;
    aclError rc;
    WAITING_CALL(rc = aclrtSynchronizeDevice());
    return ret_or_init_error(rc);
}

RT_DOC(synchronize_device_with_timeout, "timeout", "ret",
       "aclrtSynchronizeDeviceWithTimeout: synchronize_device waiting at most timeout ms (-1 or 0: no limit);\n"
       "ACL_ERROR_RT_STREAM_SYNC_TIMEOUT when the time runs out.");
/* synchronize_device_with_timeout(timeout) -> ret: a timeout out of int32 range is invalid like one below -1. */
static PyObject *rt_synchronize_device_with_timeout(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                                    PyObject *kwnames)
{
    RT_BEGIN("synchronize_device_with_timeout", 1);
    int32_t timeout = 0;
    RT_ARG_OR(arg_i32, 0, "timeout", timeout, INT32_MIN);
    aclError rc;
    WAITING_CALL(rc = aclrtSynchronizeDeviceWithTimeout(timeout));
    return ret_or_init_error(rc);
}

RT_DOC(device_can_access_peer, "device_id, peer_device_id", "(can_access, ret)",
       "aclrtDeviceCanAccessPeer: can_access is 1 when device_id can reach peer_device_id's memory, else 0.");
static PyObject *rt_device_can_access_peer(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("device_can_access_peer", 2);
    int32_t dev = 0, peer = 0, can = 0;
    RT_ARG_OR(arg_i32, 0, "device_id", dev, BAD_DEVICE);
    RT_ARG_OR(arg_i32, 1, "peer_device_id", peer, BAD_DEVICE);
    aclError rc = aclrtDeviceCanAccessPeer(&can, dev, peer);
    return ret_i64(can, rc);
}

/* A uint32 argument: out of range when it does not fit. */
static int arg_u32(PyObject *o, const char *fn, const char *arg, uint32_t *out)
{
    uint64_t v = 0;
    int rc = arg_u64(o, fn, arg, &v);
    if (rc == ARG_OK) {
        if (v > UINT32_MAX)
            return ARG_OUT_OF_RANGE;
        *out = (uint32_t)v;
    }
    return rc;
}

RT_DOC(device_enable_peer_access, "peer_device_id, flags", "ret",
       "aclrtDeviceEnablePeerAccess: lets the current device reach peer_device_id's memory; flags must be 0.");
static PyObject *rt_device_enable_peer_access(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                              PyObject *kwnames)
{
    RT_BEGIN("device_enable_peer_access", 2);
    int32_t peer = 0;
    uint32_t flags = 0;
    RT_ARG_OR(arg_i32, 0, "peer_device_id", peer, BAD_DEVICE);
    RT_ARG_OR(arg_u32, 1, "flags", flags, 1u); /* any non-zero flags: ACL_ERROR_FEATURE_UNSUPPORTED */
    return ret_or_init_error(aclrtDeviceEnablePeerAccess(peer, flags));
}

RT_DOC(device_disable_peer_access, "peer_device_id", "ret",
       "aclrtDeviceDisablePeerAccess: undoes device_enable_peer_access(peer_device_id, 0).");
static PyObject *rt_device_disable_peer_access(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                               PyObject *kwnames)
{
    RT_BEGIN("device_disable_peer_access", 1);
    int32_t peer = 0;
    RT_ARG_OR(arg_i32, 0, "peer_device_id", peer, BAD_DEVICE);
    return ret_or_init_error(aclrtDeviceDisablePeerAccess(peer));
}

/* ---- plain memory ---- */

typedef aclError (*malloc_fn)(void **, size_t, aclrtMemMallocPolicy);

static PyObject *do_malloc(const char *fn, malloc_fn alloc, PyObject *const *args)
{
    bool bad = false;
    uint64_t size = 0;
    int32_t policy = 0;
    RT_ARG(arg_u64, 0, "size", size);
    RT_ARG(arg_i32, 1, "policy", policy);
    if (bad)
        return ret_u64(0, ACL_ERROR_INVALID_PARAM);
    void *p = NULL;
    aclError rc;
    WAITING_CALL(rc = alloc(&p, (size_t)size, (aclrtMemMallocPolicy)policy));
    return ret_handle(p, rc);
}

RT_DOC(malloc, "size, policy", "(dev_ptr, ret)",
       "aclrtMalloc: size bytes of device memory on the current device. policy: an ACL_MEM_MALLOC_* page\n"
       "policy, optionally | ACL_MEM_TYPE_* (bandwidth) or ACL_MEM_ACCESS_USER_SPACE_READONLY. Free with free.");
static PyObject *rt_malloc(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("malloc", 2);
    return do_malloc(fn, aclrtMalloc, args);
}

RT_DOC(malloc_align32, "size, policy", "(dev_ptr, ret)",
       "aclrtMallocAlign32: as malloc, size rounded up to 32 bytes without malloc's 32-byte pad.");
static PyObject *rt_malloc_align32(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("malloc_align32", 2);
    return do_malloc(fn, aclrtMallocAlign32, args);
}

RT_DOC(malloc_cached, "size, policy", "(dev_ptr, ret)", "aclrtMallocCached: as malloc (the same policies).");
static PyObject *rt_malloc_cached(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("malloc_cached", 2);
    return do_malloc(fn, aclrtMallocCached, args);
}

RT_DOC(free, "dev_ptr", "ret", "aclrtFree: frees memory from malloc, malloc_align32 or malloc_cached.");
static PyObject *rt_free(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("free", 1);
    bool bad = false;
    void *p = NULL;
    RT_ARG(arg_ptr, 0, "dev_ptr", p);
    if (bad)
        return ret_or_init_error(ACL_ERROR_RT_MEMORY_FREE);
    aclError rc;
    WAITING_CALL(rc = aclrtFree(p));
    return ret_or_init_error(rc);
}

RT_DOC(malloc_host, "size", "(host_ptr, ret)",
       "aclrtMallocHost: size bytes of pinned host memory. Free with free_host.");
static PyObject *rt_malloc_host(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("malloc_host", 1);
    bool bad = false;
    uint64_t size = 0;
    RT_ARG(arg_u64, 0, "size", size);
    if (bad)
        return ret_u64(0, ACL_ERROR_INVALID_PARAM);
    void *p = NULL;
    aclError rc;
    WAITING_CALL(rc = aclrtMallocHost(&p, (size_t)size));
    return ret_handle(p, rc);
}

RT_DOC(free_host, "host_ptr", "ret", "aclrtFreeHost: frees memory from malloc_host.");
RT_ON_HANDLE(free_host, "host_ptr", aclrtFreeHost) /* BAD_HANDLE is no pinned block: ACL_ERROR_RT_MEMORY_FREE */

RT_DOC(memset, "dev_ptr, max_count, value, count", "ret",
       "aclrtMemset: sets count bytes at dev_ptr to value (its low byte); max_count is the size of the memory\n"
       "at dev_ptr (count may not exceed it).");
static PyObject *rt_memset(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("memset", 4);
    bool bad = false;
    void *p = NULL;
    uint64_t max_count = 0, count = 0;
    int32_t value = 0;
    RT_ARG(arg_ptr, 0, "dev_ptr", p);
    RT_ARG(arg_u64, 1, "max_count", max_count);
    RT_ARG(arg_i32, 2, "value", value);
    RT_ARG(arg_u64, 3, "count", count);
    if (bad)
        return ret_or_init_error(ACL_ERROR_INVALID_PARAM);
    aclError rc;
    WAITING_CALL(rc = aclrtMemset(p, (size_t)max_count, value, (size_t)count));
    return ret_or_init_error(rc);
}

RT_DOC(memcpy, "dst, dest_max, src, count, kind", "ret",
       "aclrtMemcpy: copies count bytes from src to dst; dest_max is the size of the memory at dst;\n"
       "kind: an ACL_MEMCPY_* direction, HOST_TO_HOST .. HOST_TO_BUF_TO_DEVICE (0..5).");
static PyObject *rt_memcpy(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("memcpy", 5);
    bool bad = false;
    void *dst = NULL, *src = NULL;
    uint64_t dest_max = 0, count = 0;
    int32_t kind = 0;
    RT_ARG(arg_ptr, 0, "dst", dst);
    RT_ARG(arg_u64, 1, "dest_max", dest_max);
    RT_ARG(arg_ptr, 2, "src", src);
    RT_ARG(arg_u64, 3, "count", count);
    RT_ARG(arg_i32, 4, "kind", kind);
    if (bad)
        return ret_or_init_error(ACL_ERROR_INVALID_PARAM);
    aclError rc;
    WAITING_CALL(rc = aclrtMemcpy(dst, (size_t)dest_max, src, (size_t)count, (aclrtMemcpyKind)kind));
    return ret_or_init_error(rc);
}

/* memcpy2d and memcpy2d_async: pyACL's argument order, stream last for the asynchronous one (fn is
 * "acl.rt.memcpy2d" or "acl.rt.memcpy2d_async"). */
static PyObject *memcpy2d(const char *fn, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, bool async)
{
    if (!check_no_kwargs(fn, kwnames) || !check_nargs(fn, nargs, async ? 8 : 7))
        return NULL;
    bool bad = false;
    void *dst = NULL, *src = NULL, *stream = NULL;
    uint64_t dpitch = 0, spitch = 0, width = 0, height = 0;
    int32_t kind = 0;
    RT_ARG(arg_ptr, 0, "dst", dst);
    RT_ARG(arg_u64, 1, "dpitch", dpitch);
    RT_ARG(arg_ptr, 2, "src", src);
    RT_ARG(arg_u64, 3, "spitch", spitch);
    RT_ARG(arg_u64, 4, "width", width);
    RT_ARG(arg_u64, 5, "height", height);
    RT_ARG(arg_i32, 6, "kind", kind);
    if (async)
        RT_ARG_OR(arg_ptr, 7, "stream", stream, BAD_HANDLE);
    if (bad)
        return ret_or_init_error(ACL_ERROR_INVALID_PARAM);
    aclError rc;
    if (async)
        WAITING_CALL(rc = aclrtMemcpy2dAsync(dst, (size_t)dpitch, src, (size_t)spitch, (size_t)width, (size_t)height,
                                           (aclrtMemcpyKind)kind, stream));
    else
        WAITING_CALL(rc = aclrtMemcpy2d(dst, (size_t)dpitch, src, (size_t)spitch, (size_t)width, (size_t)height,
                                      (aclrtMemcpyKind)kind));
    return ret_or_init_error(rc);
}

RT_DOC(memcpy2d, "dst, dpitch, src, spitch, width, height, kind", "ret",
       "aclrtMemcpy2d: copies height rows of width bytes, spitch bytes apart at src, to rows dpitch bytes\n"
       "apart at dst; kind: ACL_MEMCPY_HOST_TO_DEVICE, _DEVICE_TO_HOST or _DEFAULT.");
static PyObject *rt_memcpy2d(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    (void)self;
    return memcpy2d("acl.rt.memcpy2d", args, nargs, kwnames, false);
}

RT_DOC(memcpy2d_async, "dst, dpitch, src, spitch, width, height, kind, stream", "ret",
       "aclrtMemcpy2dAsync: memcpy2d as a task of stream (done before it returns for pageable host memory).");
static PyObject *rt_memcpy2d_async(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    (void)self;
    return memcpy2d("acl.rt.memcpy2d_async", args, nargs, kwnames, true);
}

RT_DOC(get_mem_info, "attr", "(free, total, ret)",
       "aclrtGetMemInfo: free and total bytes of the current device's memory of kind attr, an ACL_*_MEM*\n"
       "value (ACL_DDR_MEM, ACL_HBM_MEM, ...).");
static PyObject *rt_get_mem_info(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("get_mem_info", 1);
    int32_t attr = 0;
    RT_ARG_OR(arg_i32, 0, "attr", attr, -1); /* an attribute the device does not have */
    size_t free_bytes = 0, total_bytes = 0;
    aclError rc = aclrtGetMemInfo((aclrtMemAttr)attr, &free_bytes, &total_bytes);
    if (raise_init_error(rc))
        return NULL;
    if (rc != ACL_SUCCESS)
        free_bytes = total_bytes = 0;
    return Py_BuildValue("(KKi)", (unsigned long long)free_bytes, (unsigned long long)total_bytes, rc);
}

/* ---- virtual memory management ---- */

/* prop[key] as a new reference: converting a value may run Python code (__index__) that changes
 * the dicts, so no value is borrowed across a conversion.  TypeError naming the argument and the
 * key when it is missing; an error a key's comparison raised passes through. */
static PyObject *prop_item(PyObject *dict, const char *fn, const char *key, const char *shown)
{
    PyObject *k = PyUnicode_FromString(key);
    if (!k)
        return NULL;
    PyObject *v = PyDict_GetItemWithError(dict, k);
    Py_DECREF(k);
    if (v)
        return Py_NewRef(v);
    if (!PyErr_Occurred())
        arg_type_error(fn, "argument 'prop' has no key '%s'", shown);
    return NULL;
}

/* Converts dict[key] (dict is prop or prop["location"]) with arg_i32 / arg_u64: `shown` names
 * the key when it is missing, `value` the value when it is not an int. */
static int prop_i32(PyObject *dict, const char *fn, const char *key, const char *shown, const char *value,
                    int32_t *out)
{
    PyObject *v = prop_item(dict, fn, key, shown);
    if (!v)
        return ARG_TYPE_ERROR;
    int rc = arg_i32(v, fn, value, out);
    Py_DECREF(v);
    return rc;
}

static int prop_u64(PyObject *dict, const char *fn, const char *key, const char *shown, const char *value,
                    uint64_t *out)
{
    PyObject *v = prop_item(dict, fn, key, shown);
    if (!v)
        return ARG_TYPE_ERROR;
    int rc = arg_u64(v, fn, value, out);
    Py_DECREF(v);
    return rc;
}

/* Converts the pyACL property dict {"handleType", "allocationType", "memAttr",
 * "location": {"id", "type"}, "reserve"}.  Not a dict, a missing key or a value that is not
 * an int raise TypeError.  A value out of its C type's range becomes a value the C function
 * rejects (an enum -1, a location id 2**32 - 1); an out-of-range reserve sets *bad.  Keys are
 * looked up in this order, each when its turn comes (a value's __index__ may remove later ones). */
static int prop_from_dict(PyObject *o, const char *fn, aclrtPhysicalMemProp *prop, bool *bad)
{
    static const char arg[] = "prop";
    if (!PyDict_Check(o)) {
        return arg_type_error(fn, "argument '%s' must be dict, not %.80s", arg, Py_TYPE(o)->tp_name);
    }
    static const struct {
        const char *key, *shown;
    } enums[] = {{"handleType", "prop.handleType"}, {"allocationType", "prop.allocationType"},
                 {"memAttr", "prop.memAttr"}};
    int32_t values[3];
    for (size_t i = 0; i < 3; i++) {
        int rc = prop_i32(o, fn, enums[i].key, enums[i].key, enums[i].shown, &values[i]);
        if (rc == ARG_TYPE_ERROR)
            return rc;
        if (rc == ARG_OUT_OF_RANGE)
            values[i] = -1;
    }
    PyObject *loc = prop_item(o, fn, "location", "location");
    if (!loc)
        return ARG_TYPE_ERROR;
    if (!PyDict_Check(loc)) {
        arg_type_error(fn, "argument '%s' key 'location' must be dict, not %.80s", arg, Py_TYPE(loc)->tp_name);
        Py_DECREF(loc);
        return ARG_TYPE_ERROR;
    }
    uint64_t id = 0;
    int32_t type = 0;
    int id_rc = prop_u64(loc, fn, "id", "location.id", "prop.location.id", &id);
    int type_rc = ARG_TYPE_ERROR;
    if (id_rc != ARG_TYPE_ERROR)
        type_rc = prop_i32(loc, fn, "type", "location.type", "prop.location.type", &type);
    Py_DECREF(loc);
    if (type_rc == ARG_TYPE_ERROR)
        return ARG_TYPE_ERROR;
    if (id_rc == ARG_OUT_OF_RANGE || id > UINT32_MAX)
        id = UINT32_MAX; /* no such device */
    if (type_rc == ARG_OUT_OF_RANGE)
        type = -1;
    uint64_t reserve = 0;
    int rc = prop_u64(o, fn, "reserve", "reserve", "prop.reserve", &reserve);
    if (rc == ARG_TYPE_ERROR)
        return rc;
    if (rc == ARG_OUT_OF_RANGE)
        *bad = true;
    memset(prop, 0, sizeof *prop);
    prop->handleType = (aclrtMemHandleType)values[0];
    prop->allocationType = (aclrtMemAllocationType)values[1];
    prop->memAttr = (aclrtMemAttr)values[2];
    prop->location.id = (uint32_t)id;
    prop->location.type = (aclrtMemLocationType)type;
    prop->reserve = reserve;
    return ARG_OK;
}

RT_DOC(mem_get_allocation_granularity, "prop, option", "(granularity, ret)",
       "aclrtMemGetAllocationGranularity: the size unit of physical memory with property prop, a dict\n"
       "{'handleType', 'allocationType', 'memAttr', 'location': {'id', 'type'}, 'reserve'} of ints;\n"
       "option: ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM or _RECOMMENDED.");
static PyObject *rt_mem_get_allocation_granularity(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                                   PyObject *kwnames)
{
    RT_BEGIN("mem_get_allocation_granularity", 2);
    bool bad = false;
    aclrtPhysicalMemProp prop;
    if (prop_from_dict(args[0], fn, &prop, &bad) == ARG_TYPE_ERROR)
        return NULL;
    int32_t option = 0;
    RT_ARG_OR(arg_i32, 1, "option", option, -1);
    if (bad)
        return ret_u64(0, ACL_ERROR_INVALID_PARAM);
    size_t granularity = 0;
    aclError rc = aclrtMemGetAllocationGranularity(&prop, (aclrtMemGranularityOptions)option, &granularity);
    return ret_u64(granularity, rc);
}

RT_DOC(malloc_physical, "size, prop, flags", "(handle, ret)",
       "aclrtMallocPhysical: a handle of size bytes of physical memory (a multiple of the granularity);\n"
       "prop as for mem_get_allocation_granularity; flags must be 0. Free with free_physical.");
static PyObject *rt_malloc_physical(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("malloc_physical", 3);
    bool bad = false;
    uint64_t size = 0, flags = 0;
    RT_ARG(arg_u64, 0, "size", size);
    aclrtPhysicalMemProp prop;
    if (prop_from_dict(args[1], fn, &prop, &bad) == ARG_TYPE_ERROR)
        return NULL;
    RT_ARG(arg_u64, 2, "flags", flags);
    if (bad)
        return ret_u64(0, ACL_ERROR_INVALID_PARAM);
    aclrtDrvMemHandle handle = NULL;
    aclError rc;
    WAITING_CALL(rc = aclrtMallocPhysical(&handle, (size_t)size, &prop, flags));
    return ret_handle(handle, rc);
}

RT_DOC(free_physical, "handle", "ret",
       "aclrtFreePhysical: frees a handle from malloc_physical or mem_import_from_shareable_handle\n"
       "(its memory stays while it is mapped).");
RT_ON_HANDLE(free_physical, "handle", aclrtFreePhysical)

RT_DOC(reserve_mem_address, "size, alignment, expect_ptr, flags", "(vir_ptr, ret)",
       "aclrtReserveMemAddress: reserves size bytes of device addresses, at expect_ptr unless it is 0;\n"
       "alignment must be 0; flags 0 or 1. Release with release_mem_address.");
static PyObject *rt_reserve_mem_address(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("reserve_mem_address", 4);
    bool bad = false;
    uint64_t size = 0, alignment = 0, flags = 0;
    void *expect = NULL;
    RT_ARG(arg_u64, 0, "size", size);
    RT_ARG(arg_u64, 1, "alignment", alignment);
    RT_ARG(arg_ptr, 2, "expect_ptr", expect);
    RT_ARG(arg_u64, 3, "flags", flags);
    if (bad)
        return ret_u64(0, ACL_ERROR_INVALID_PARAM);
    void *p = NULL;
    aclError rc;
    WAITING_CALL(rc = aclrtReserveMemAddress(&p, (size_t)size, (size_t)alignment, expect, flags));
    return ret_handle(p, rc);
}

RT_DOC(release_mem_address, "vir_ptr", "ret",
       "aclrtReleaseMemAddress: releases a range from reserve_mem_address that has nothing mapped.");
RT_ON_HANDLE(release_mem_address, "vir_ptr", aclrtReleaseMemAddress)

RT_DOC(map_mem, "vir_ptr, size, offset, handle, flags", "ret",
       "aclrtMapMem: maps the physical memory of handle, size bytes, at vir_ptr in a reserved range;\n"
       "offset and flags must be 0.");
static PyObject *rt_map_mem(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("map_mem", 5);
    void *p = NULL, *handle = NULL;
    uint64_t size = 0, offset = 0, flags = 0;
    RT_ARG_OR(arg_ptr, 0, "vir_ptr", p, BAD_HANDLE);
    RT_ARG_OR(arg_u64, 1, "size", size, 0);       /* size 0, offset and flags non-zero: */
    RT_ARG_OR(arg_u64, 2, "offset", offset, 1);   /* ACL_ERROR_INVALID_PARAM */
    RT_ARG_OR(arg_ptr, 3, "handle", handle, BAD_HANDLE);
    RT_ARG_OR(arg_u64, 4, "flags", flags, 1);
    aclError rc;
    WAITING_CALL(rc = aclrtMapMem(p, (size_t)size, (size_t)offset, handle, flags));
    return ret_or_init_error(rc);
}

RT_DOC(unmap_mem, "vir_ptr", "ret", "aclrtUnmapMem: unmaps what map_mem mapped at vir_ptr.");
RT_ON_HANDLE(unmap_mem, "vir_ptr", aclrtUnmapMem)

/* ---- streams ---- */

RT_DOC0(create_stream, "(stream, ret)", "aclrtCreateStream: a new stream on the current device.");
RT_OUTPUT(create_stream, aclrtStream, aclrtCreateStream, ret_handle)

RT_DOC(create_stream_with_config, "priority, flag", "(stream, ret)",
       "aclrtCreateStreamWithConfig: a new stream; priority is accepted and has no effect;\n"
       "flag: ACL_STREAM_* bits.");
/* create_stream_with_config(priority, flag) -> (stream, ret).  A flag out of uint32 range has every
 * bit of one set: refused as CANN refuses its combination of flags. */
static PyObject *rt_create_stream_with_config(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                              PyObject *kwnames)
{
    RT_BEGIN("create_stream_with_config", 2);
    bool bad = false;
    uint32_t priority = 0, flag = 0;
    RT_ARG(arg_u32, 0, "priority", priority);
    RT_ARG_OR(arg_u32, 1, "flag", flag, UINT32_MAX);
    if (bad)
        return ret_u64(0, ACL_ERROR_INVALID_PARAM);
    aclrtStream stream = NULL;
    aclError rc = aclrtCreateStreamWithConfig(&stream, priority, flag);
    return ret_handle(stream, rc);
}

RT_DOC(destroy_stream, "stream", "ret", "aclrtDestroyStream: waits for the stream's queued work, then destroys it.");
RT_ON_HANDLE(destroy_stream, "stream", aclrtDestroyStream) /* waits for the stream's queued work */

RT_DOC(synchronize_stream, "stream", "ret",
       "aclrtSynchronizeStream: waits for the work queued on stream (0: the default stream); returns a\n"
       "failed task's sticky error once.");
RT_ON_HANDLE(synchronize_stream, "stream", aclrtSynchronizeStream)

/* name(handle, timeout) -> ret: a timeout out of int32 range is invalid like one below -1. */
static PyObject *call_with_timeout(const char *fn, PyObject *const *args, const char *argname,
                                   aclError (*call)(void *, int32_t))
{
    void *handle = NULL;
    int32_t timeout = 0;
    RT_ARG_OR(arg_ptr, 0, argname, handle, BAD_HANDLE);
    RT_ARG_OR(arg_i32, 1, "timeout", timeout, INT32_MIN);
    aclError rc;
    WAITING_CALL(rc = call(handle, timeout));
    return ret_or_init_error(rc);
}

RT_DOC(synchronize_stream_with_timeout, "stream, timeout", "ret",
       "aclrtSynchronizeStreamWithTimeout: synchronize_stream waiting at most timeout ms (-1 or 0: no\n"
       "limit); ACL_ERROR_RT_STREAM_SYNC_TIMEOUT when the time runs out.");
static PyObject *rt_synchronize_stream_with_timeout(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                                    PyObject *kwnames)
{
    RT_BEGIN("synchronize_stream_with_timeout", 2);
    return call_with_timeout(fn, args, "stream", aclrtSynchronizeStreamWithTimeout);
}

RT_DOC(stream_query, "stream", "(status, ret)",
       "aclrtStreamQuery: ACL_STREAM_STATUS_COMPLETE once all queued work has run, else _NOT_READY;\n"
       "ACL_STREAM_STATUS_RESERVED when ret is an error.");
static PyObject *rt_stream_query(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("stream_query", 1);
    void *stream = NULL;
    RT_ARG_OR(arg_ptr, 0, "stream", stream, BAD_HANDLE);
    aclrtStreamStatus status = ACL_STREAM_STATUS_RESERVED;
    aclError rc = aclrtStreamQuery(stream, &status);
    if (raise_init_error(rc))
        return NULL;
    /* pyACL returns its status variable as a failed call left it: RESERVED, which no caller reads as
     * COMPLETE (0).  The query_event* calls keep the usual 0, as pyACL's own initial values are 0 too. */
    return Py_BuildValue("(Ii)", (unsigned)(rc == ACL_SUCCESS ? status : ACL_STREAM_STATUS_RESERVED), rc);
}

RT_DOC(memcpy_async, "dst, dest_max, src, count, kind, stream", "ret",
       "aclrtMemcpyAsync: memcpy as a task of stream (a copy with pageable host memory is done before\n"
       "it returns).");
static PyObject *rt_memcpy_async(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("memcpy_async", 6);
    bool bad = false;
    void *dst = NULL, *src = NULL, *stream = NULL;
    uint64_t dest_max = 0, count = 0;
    int32_t kind = 0;
    RT_ARG(arg_ptr, 0, "dst", dst);
    RT_ARG(arg_u64, 1, "dest_max", dest_max);
    RT_ARG(arg_ptr, 2, "src", src);
    RT_ARG(arg_u64, 3, "count", count);
    RT_ARG(arg_i32, 4, "kind", kind);
    RT_ARG_OR(arg_ptr, 5, "stream", stream, BAD_HANDLE);
    if (bad)
        return ret_or_init_error(ACL_ERROR_INVALID_PARAM);
    aclError rc;
    WAITING_CALL(rc = aclrtMemcpyAsync(dst, (size_t)dest_max, src, (size_t)count, (aclrtMemcpyKind)kind, stream));
    return ret_or_init_error(rc);
}

RT_DOC(memset_async, "dev_ptr, max_count, value, count, stream", "ret",
       "aclrtMemsetAsync: memset as a task of stream.");
static PyObject *rt_memset_async(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("memset_async", 5);
    bool bad = false;
    void *p = NULL, *stream = NULL;
    uint64_t max_count = 0, count = 0;
    int32_t value = 0;
    RT_ARG(arg_ptr, 0, "dev_ptr", p);
    RT_ARG(arg_u64, 1, "max_count", max_count);
    RT_ARG(arg_i32, 2, "value", value);
    RT_ARG(arg_u64, 3, "count", count);
    RT_ARG_OR(arg_ptr, 4, "stream", stream, BAD_HANDLE);
    if (bad)
        return ret_or_init_error(ACL_ERROR_INVALID_PARAM);
    aclError rc;
    WAITING_CALL(rc = aclrtMemsetAsync(p, (size_t)max_count, value, (size_t)count, stream));
    return ret_or_init_error(rc);
}

/* A Python callback in flight: both references are held until it has run. */
typedef struct py_callback {
    PyObject *fn;
    PyObject *user_data;
} py_callback;

static bool interpreter_finalizing(void)
{
#if PY_VERSION_HEX >= 0x030D0000
    return !Py_IsInitialized() || Py_IsFinalizing();
#else
    return !Py_IsInitialized() || _Py_IsFinalizing();
#endif
}

/* Python callbacks run on npualloc's own threads (a stream's worker) and on threads in process_report.
 * Once the interpreter finalizes, CPython ends a thread other than the main one where it takes the GIL: a
 * worker ended inside a callback never passes that task, and whatever waits for the stream then (a
 * finalizer's synchronize) waits for ever.  So callbacks end before that: an atexit hook, which runs
 * before finalizing, closes this gate and waits, without the GIL, for the callbacks inside; those that
 * come later are dropped, their objects leaked (Python can no longer release them). */
static pthread_mutex_t gate_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_emptied = PTHREAD_COND_INITIALIZER;
static size_t gate_inside;                 /* callbacks running, all threads */
static bool gate_closed;
static _Thread_local size_t gate_own_depth; /* of them, this thread's (a callback inside a callback) */

static bool gate_enter(void)
{
    pthread_mutex_lock(&gate_lock);
    bool open = !gate_closed && !interpreter_finalizing();
    if (open) {
        gate_inside++;
        gate_own_depth++;
    }
    pthread_mutex_unlock(&gate_lock);
    return open;
}

static void gate_leave(void)
{
    pthread_mutex_lock(&gate_lock);
    gate_own_depth--;
    gate_inside--;
    if (gate_closed) /* only then is anybody waiting */
        pthread_cond_broadcast(&gate_emptied);
    pthread_mutex_unlock(&gate_lock);
}

/* How long exit waits for the callbacks still running before it leaves them to CPython, which ends them
 * where they stand: one may wait for what the exiting main thread would have done. */
#define EXIT_WAIT_SLICES 50 /* of 100 ms */

/* Whether callbacks other than the calling thread's own are inside after waiting up to 100 ms for them
 * (gate_lock held). */
static bool gate_still_busy_after_a_slice(void)
{
    if (gate_inside > gate_own_depth) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until); /* the condition variable's clock */
        until.tv_nsec += 100 * 1000 * 1000;
        if (until.tv_nsec >= 1000 * 1000 * 1000) {
            until.tv_sec++;
            until.tv_nsec -= 1000 * 1000 * 1000;
        }
        (void)pthread_cond_timedwait(&gate_emptied, &gate_lock, &until);
    }
    return gate_inside > gate_own_depth;
}

/* The atexit hook: closes the gate, then waits (without the GIL, Ctrl-C ending the wait) for the callbacks
 * inside but the calling thread's own, up to EXIT_WAIT_SLICES; says so on stderr if some are left. */
static PyObject *close_python_callbacks(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    pthread_mutex_lock(&gate_lock);
    gate_closed = true;
    pthread_mutex_unlock(&gate_lock);
    size_t left = 0;
    for (int slice = 0; slice < EXIT_WAIT_SLICES; slice++) {
        bool busy;
        WAITING_CALL(pthread_mutex_lock(&gate_lock); busy = gate_still_busy_after_a_slice();
                     left = gate_inside - gate_own_depth; pthread_mutex_unlock(&gate_lock));
        if (!busy)
            Py_RETURN_NONE;
        if (PyErr_CheckSignals() < 0)
            return NULL; /* (atexit reports it and goes on) */
    }
    PySys_WriteStderr("npualloc: %zu Python stream callback(s) still running %d s into exit are left to the "
                      "interpreter, which ends them where they stand\n",
                      left, EXIT_WAIT_SLICES / 10);
    Py_RETURN_NONE;
}

/* fork(): in the child only the forking thread's callbacks are inside. */
static void gate_before_fork(void) { pthread_mutex_lock(&gate_lock); }
static void gate_after_fork_parent(void) { pthread_mutex_unlock(&gate_lock); }
static void gate_after_fork_child(void)
{
    gate_inside = gate_own_depth;
    pthread_mutex_unlock(&gate_lock);
}

/* Through the gate and with the GIL: calls fn(user_data) when `call` (an exception is reported as
 * unraisable), and drops the callback when `drop`.  Behind a closed gate nothing runs, and a dropped
 * callback's objects are leaked: Python can no longer release them. */
static void py_callback_run(py_callback *c, bool call, bool drop)
{
    if (!gate_enter())
        return;
    PyGILState_STATE g = PyGILState_Ensure();
    if (call) {
        PyObject *r = PyObject_CallOneArg(c->fn, c->user_data);
        if (r)
            Py_DECREF(r);
        else
            PyErr_WriteUnraisable(c->fn);
    }
    if (drop) {
        Py_DECREF(c->fn);
        Py_DECREF(c->user_data);
    }
    PyGILState_Release(g);
    gate_leave();
    if (drop)
        PyMem_RawFree(c);
}

/* Run on whichever thread runs the stream's callbacks (its worker, or the thread in process_report).
 * On a capturing stream a callback becomes a host node that runs at every launch of the graph, so
 * running it must not free it: py_callback_free runs when the graph goes.  Otherwise the trampoline
 * runs and frees it in one pass of the gate: a callback whose objects were kept past the exit's wait
 * (hold the module's globals) would keep the objects of __main__ from being finalized. */
static void py_callback_trampoline(void *arg) { py_callback_run(arg, true, true); }
static void py_callback_call(void *arg) { py_callback_run(arg, true, false); }
static void py_callback_free(void *arg) { py_callback_run(arg, false, true); }

RT_DOC(launch_callback, "fn, user_data, block_type, stream", "ret",
       "aclrtLaunchCallback: fn(user_data) runs when stream reaches it (user_data: any object, pyACL's\n"
       "user_data_list), in process_report of the thread subscribed to stream (subscribe_report), else on\n"
       "the stream's worker; block_type: ACL_CALLBACK_BLOCK or ACL_CALLBACK_NO_BLOCK.");
static PyObject *rt_launch_callback(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("launch_callback", 4);
    if (!PyCallable_Check(args[0])) {
        arg_type_error(fn, "argument 'fn' must be callable, not %.80s", Py_TYPE(args[0])->tp_name);
        return NULL;
    }
    int32_t block_type = 0;
    void *stream = NULL;
    RT_ARG_OR(arg_i32, 2, "block_type", block_type, -1);
    RT_ARG_OR(arg_ptr, 3, "stream", stream, BAD_HANDLE);
    py_callback *c = PyMem_RawMalloc(sizeof *c);
    if (!c)
        return PyErr_NoMemory();
    c->fn = Py_NewRef(args[0]);
    c->user_data = Py_NewRef(args[1]);
    aclError rc = stream_launch_callback(stream, py_callback_call, py_callback_trampoline, c, py_callback_free,
                                         (aclrtCallbackBlockType)block_type);
    if (rc != ACL_SUCCESS) { /* nothing was queued: the references are still ours */
        Py_DECREF(c->fn);
        Py_DECREF(c->user_data);
        PyMem_RawFree(c);
    }
    return ret_or_init_error(rc);
}

/* CANN runs launched callbacks on a thread subscribed to the stream, inside
 * aclrtProcessReport; without a subscription npualloc runs them on the stream's worker. */
static PyObject *subscription(PyObject *const *args, const char *fn, bool subscribe)
{
    uint64_t thread_id = 0;
    void *stream = NULL;
    RT_ARG_OR(arg_u64, 0, "thread_id", thread_id, UINT64_MAX);
    RT_ARG_OR(arg_ptr, 1, "stream", stream, BAD_HANDLE);
    aclError rc;
    WAITING_CALL(rc = subscribe ? aclrtSubscribeReport(thread_id, stream) : aclrtUnSubscribeReport(thread_id, stream));
    return ret_or_init_error(rc);
}

RT_DOC(subscribe_report, "thread_id, stream", "ret",
       "aclrtSubscribeReport: the callbacks of stream run in process_report of thread thread_id\n"
       "(threading.get_ident() of that thread).");
static PyObject *rt_subscribe_report(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("subscribe_report", 2);
    return subscription(args, fn, true);
}

RT_DOC(unsubscribe_report, "thread_id, stream", "ret",
       "aclrtUnSubscribeReport: undoes subscribe_report(thread_id, stream).");
static PyObject *rt_unsubscribe_report(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("unsubscribe_report", 2);
    return subscription(args, fn, false);
}

RT_DOC(process_report, "timeout", "ret",
       "aclrtProcessReport: runs callbacks of the streams the calling thread subscribed to, waiting at most\n"
       "timeout ms for one (-1: no limit; 0 is invalid); ACL_ERROR_RT_REPORT_TIMEOUT when none came.");
static PyObject *rt_process_report(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("process_report", 1);
    int32_t timeout = 0;
    RT_ARG_OR(arg_i32, 0, "timeout", timeout, 0); /* 0 is an invalid timeout: the C code says so */
    aclError rc;
    WAITING_CALL(rc = aclrtProcessReport(timeout)); /* callbacks take the GIL themselves */
    return ret_or_init_error(rc);
}

/* ---- events ---- */

RT_DOC0(create_event, "(event, ret)", "aclrtCreateEvent: a new event.");
RT_OUTPUT(create_event, aclrtEvent, aclrtCreateEvent, ret_handle)

/* name(flag) -> (event, ret): a flag out of uint32 range is one CANN refuses (UINT32_MAX). */
static PyObject *create_flagged_event(const char *fn, PyObject *const *args, aclError (*create)(aclrtEvent *, uint32_t))
{
    uint32_t flag = 0;
    RT_ARG_OR(arg_u32, 0, "flag", flag, UINT32_MAX);
    aclrtEvent event = NULL;
    aclError rc = create(&event, flag);
    return ret_handle(event, rc);
}

RT_DOC(create_event_with_flag, "flag", "(event, ret)",
       "aclrtCreateEventWithFlag: a new event; flag: ACL_EVENT_* bits.");
static PyObject *rt_create_event_with_flag(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("create_event_with_flag", 1);
    return create_flagged_event(fn, args, aclrtCreateEventWithFlag);
}

RT_DOC(create_event_ex_with_flag, "flag", "(event, ret)",
       "aclrtCreateEventExWithFlag: a new event of CANN's new mode (complete until first recorded);\n"
       "flag: ACL_EVENT_* bits.");
static PyObject *rt_create_event_ex_with_flag(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                              PyObject *kwnames)
{
    RT_BEGIN("create_event_ex_with_flag", 1);
    return create_flagged_event(fn, args, aclrtCreateEventExWithFlag);
}

RT_DOC(destroy_event, "event", "ret", "aclrtDestroyEvent: destroys event.");
RT_ON_HANDLE(destroy_event, "event", aclrtDestroyEvent)

RT_DOC(reset_event, "event, stream", "ret",
       "aclrtResetEvent: a task of stream that returns event to its never-recorded state.");
RT_ON_TWO_HANDLES(reset_event, "event", "stream", aclrtResetEvent)

RT_DOC(record_event, "event, stream", "ret", "aclrtRecordEvent: records event at stream's current position.");
RT_ON_TWO_HANDLES(record_event, "event", "stream", aclrtRecordEvent)

RT_DOC(query_event, "event", "(status, ret)",
       "aclrtQueryEvent: ACL_EVENT_STATUS_COMPLETE once the recorded position is reached, else _NOT_READY\n"
       "(0, i.e. COMPLETE, when ret is an error: check ret first).");
static PyObject *rt_query_event(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("query_event", 1);
    void *event = NULL;
    RT_ARG_OR(arg_ptr, 0, "event", event, BAD_HANDLE);
    aclrtEventStatus status = ACL_EVENT_STATUS_RESERVED;
    aclError rc = aclrtQueryEvent(event, &status);
    return ret_i64(status, rc);
}

RT_DOC(query_event_status, "event", "(status, ret)",
       "aclrtQueryEventStatus: ACL_EVENT_RECORDED_STATUS_COMPLETE once the recorded position is reached,\n"
       "else _NOT_READY.");
static PyObject *rt_query_event_status(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("query_event_status", 1);
    void *event = NULL;
    RT_ARG_OR(arg_ptr, 0, "event", event, BAD_HANDLE);
    aclrtEventRecordedStatus status = ACL_EVENT_RECORDED_STATUS_NOT_READY;
    aclError rc = aclrtQueryEventStatus(event, &status);
    return ret_i64(status, rc);
}

RT_DOC(query_event_wait_status, "event", "(status, ret)",
       "aclrtQueryEventWaitStatus: ACL_EVENT_WAIT_STATUS_NOT_READY while a stream_wait_event for event is\n"
       "still waiting, else _COMPLETE.");
static PyObject *rt_query_event_wait_status(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                            PyObject *kwnames)
{
    RT_BEGIN("query_event_wait_status", 1);
    void *event = NULL;
    RT_ARG_OR(arg_ptr, 0, "event", event, BAD_HANDLE);
    aclrtEventWaitStatus status = ACL_EVENT_WAIT_STATUS_RESERVED;
    aclError rc = aclrtQueryEventWaitStatus(event, &status);
    return ret_i64(status, rc);
}

RT_DOC(synchronize_event, "event", "ret", "aclrtSynchronizeEvent: waits until event's recorded position is reached.");
RT_ON_HANDLE(synchronize_event, "event", aclrtSynchronizeEvent)

RT_DOC(synchronize_event_with_timeout, "event, timeout", "ret",
       "aclrtSynchronizeEventWithTimeout: synchronize_event waiting at most timeout ms (-1 or 0: no limit);\n"
       "ACL_ERROR_RT_EVENT_SYNC_TIMEOUT when the time runs out.");
static PyObject *rt_synchronize_event_with_timeout(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                                   PyObject *kwnames)
{
    RT_BEGIN("synchronize_event_with_timeout", 2);
    return call_with_timeout(fn, args, "event", aclrtSynchronizeEventWithTimeout);
}

RT_DOC(event_elapsed_time, "start, end", "(ms, ret)",
       "aclrtEventElapsedTime: the milliseconds (a float) between the records of events start and end.");
static PyObject *rt_event_elapsed_time(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("event_elapsed_time", 2);
    void *start = NULL, *end = NULL;
    RT_ARG_OR(arg_ptr, 0, "start", start, BAD_HANDLE);
    RT_ARG_OR(arg_ptr, 1, "end", end, BAD_HANDLE);
    float ms = 0.0f;
    aclError rc = aclrtEventElapsedTime(&ms, start, end);
    if (raise_init_error(rc))
        return NULL;
    return Py_BuildValue("(di)", rc == ACL_SUCCESS ? (double)ms : 0.0, rc);
}

RT_DOC(stream_wait_event, "stream, event", "ret",
       "aclrtStreamWaitEvent: the work queued on stream after this waits for event's recorded position.");
RT_ON_TWO_HANDLES(stream_wait_event, "stream", "event", aclrtStreamWaitEvent)

static PyMethodDef rt_methods[] = {
    RT_METHOD(set_device),
    RT_METHOD(reset_device),
    RT_METHOD(reset_device_force),
    RT_METHOD(get_device),
    RT_METHOD(get_device_count),
    RT_METHOD(create_context),
    RT_METHOD(destroy_context),
    RT_METHOD(set_context),
    RT_METHOD(get_context),
    RT_METHOD(ctx_get_current_default_stream),
    RT_METHOD(get_run_mode),
    RT_METHOD(synchronize_device),
    RT_METHOD(synchronize_device_with_timeout),
    RT_METHOD(device_can_access_peer),
    RT_METHOD(device_enable_peer_access),
    RT_METHOD(device_disable_peer_access),
    RT_METHOD(malloc),
    RT_METHOD(malloc_align32),
    RT_METHOD(malloc_cached),
    RT_METHOD(free),
    RT_METHOD(malloc_host),
    RT_METHOD(free_host),
    RT_METHOD(memset),
    RT_METHOD(memcpy),
    RT_METHOD(memcpy2d),
    RT_METHOD(get_mem_info),
    RT_METHOD(mem_get_allocation_granularity),
    RT_METHOD(malloc_physical),
    RT_METHOD(free_physical),
    RT_METHOD(reserve_mem_address),
    RT_METHOD(release_mem_address),
    RT_METHOD(map_mem),
    RT_METHOD(unmap_mem),
    RT_METHOD(create_stream),
    RT_METHOD(create_stream_with_config),
    RT_METHOD(destroy_stream),
    RT_METHOD(synchronize_stream),
    RT_METHOD(synchronize_stream_with_timeout),
    RT_METHOD(stream_query),
    RT_METHOD(memcpy_async),
    RT_METHOD(memcpy2d_async),
    RT_METHOD(memset_async),
    RT_METHOD(launch_callback),
    RT_METHOD(create_event),
    RT_METHOD(create_event_with_flag),
    RT_METHOD(create_event_ex_with_flag),
    RT_METHOD(destroy_event),
    RT_METHOD(reset_event),
    RT_METHOD(record_event),
    RT_METHOD(query_event),
    RT_METHOD(query_event_status),
    RT_METHOD(query_event_wait_status),
    RT_METHOD(synchronize_event),
    RT_METHOD(synchronize_event_with_timeout),
    RT_METHOD(event_elapsed_time),
    RT_METHOD(stream_wait_event),
    RT_METHOD(subscribe_report),
    RT_METHOD(unsubscribe_report),
    RT_METHOD(process_report),
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef rt_def = {
    PyModuleDef_HEAD_INIT, "npualloc.acl.rt", "pyACL runtime functions (acl.rt).", -1, rt_methods,
    NULL, NULL, NULL, NULL,
};

static PyMethodDef close_callbacks_def = {
    "_close_python_callbacks", close_python_callbacks, METH_NOARGS,
    "Registered with atexit: waits for the Python callbacks running and drops those to come."};

PyObject *acl_rt_module_create(void)
{
    static bool fork_handlers; /* the module is made once per process, under the GIL */
    if (!fork_handlers) {
        if (pthread_atfork(gate_before_fork, gate_after_fork_parent, gate_after_fork_child) != 0)
            return PyErr_NoMemory();
        fork_handlers = true;
    }
    PyObject *m = PyModule_Create(&rt_def);
    PyObject *atexit = m ? PyImport_ImportModule("atexit") : NULL;
    PyObject *hook = atexit ? PyCFunction_New(&close_callbacks_def, NULL) : NULL;
    PyObject *r = hook ? PyObject_CallMethod(atexit, "register", "O", hook) : NULL;
    Py_XDECREF(hook);
    Py_XDECREF(atexit);
    if (!r) {
        Py_XDECREF(m);
        return NULL;
    }
    Py_DECREF(r);
    return m;
}
