/*
 * memory_py.c - the torch_npu-like memory face (`npualloc._C.memory`), used by
 * npualloc/memory.py and npualloc/streams.py.
 *
 *   caching_allocator_alloc(size, device=None, stream=None) -> int   (the hot path, all in C)
 *   caching_allocator_delete(ptr)
 *   empty(nbytes, device=None, stream=None) -> Buffer                (npualloc_allocate)
 *   Buffer, OutOfMemoryError
 *   _xxx helpers: stats, snapshots, settings, fraction, streams, events, current devices and
 *   the calling thread's current stream per device (a C thread-local table).
 *
 * Every call that may wait (allocation, empty_cache, synchronisation, settings changes, stream
 * destruction) releases the GIL: a stream task may be a Python callback that needs it.
 *
 * Restarts: npualloc._C.shutdown() releases every stream, event and block, and the next
 * runtime hands out the same handle and pointer values again.  Streams, events, buffers and
 * current stream entries remember the runtime's generation (npualloc_runtime_generation) they
 * were made in and are not touched once it is over (a stale Buffer is never freed, so it cannot
 * free a block of the new runtime).  The runtime is not shut down while a view of a Buffer's
 * memory is exported (memory_py_buffer_views).
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "acl_rt.h"
#include "memory_py.h" /* Python.h first */
#include "binding.h"
#include <structmember.h>
#include "npualloc.h"
#include "pyarg.h"

#ifndef unlikely
#define unlikely(x) __builtin_expect(!!(x), 0)
#endif

#define MAX_DEVICES 64

/* ---- generations ---- */

static inline uint64_t gen_now(void) { return npualloc_runtime_generation(); }

/* ---- the GIL around allocator calls ----
 *
 * An allocation or empty_cache may wait for a stream while it holds a device's allocator lock
 * (torch's synchronize_and_free_events), and the stream may be running a Python callback that
 * needs the GIL.  So those calls release the GIL, and while one of them is in flight every other
 * call that takes an allocator lock releases it too (a thread holding the GIL must never wait
 * for that lock).  With none in flight (the single-threaded hot path) frees keep the GIL.
 * The count (binding.h) changes only with the GIL held, so a call that saw 0 finishes before it can grow. */
atomic_int binding_gil_waiters;

#define LOCKING_CALL(stmt)                                                                                         \
    do {                                                                                                           \
        if (atomic_load(&binding_gil_waiters) != 0) {                                                              \
            Py_BEGIN_ALLOW_THREADS stmt;                                                                           \
            Py_END_ALLOW_THREADS                                                                                   \
        } else {                                                                                                   \
            stmt;                                                                                                  \
        }                                                                                                          \
    } while (0)

/* ---- the calling thread's current stream, per device ---- */

static _Thread_local uint64_t tl_gen;
static _Thread_local uint64_t tl_streams[MAX_DEVICES];

static inline void tl_refresh(void)
{
    uint64_t g = gen_now();
    if (tl_gen != g) {
        memset(tl_streams, 0, sizeof tl_streams);
        tl_gen = g;
    }
}

static inline uint64_t current_stream_of(int32_t dev)
{
    if (dev < 0 || dev >= MAX_DEVICES)
        return 0;
    tl_refresh();
    return tl_streams[dev];
}

/* ---- module state ---- */

static PyObject *OutOfMemoryError; /* npualloc.OutOfMemoryError (a RuntimeError) */
static PyObject *stream_type;      /* npualloc.Stream, registered by streams.py */
static PyObject *oom_observers;    /* list of callables */
static PyObject *str_npu_stream;   /* interned "npu_stream" */

/* Calls npualloc.memory.<name>(*args); new reference or NULL. */
static PyObject *call_helper(const char *name, PyObject *args)
{
    PyObject *mod = PyImport_ImportModule("npualloc.memory");
    if (!mod)
        return NULL;
    PyObject *fn = PyObject_GetAttrString(mod, name);
    Py_DECREF(mod);
    if (!fn)
        return NULL;
    PyObject *r = PyObject_CallObject(fn, args);
    Py_DECREF(fn);
    return r;
}

/* torch_npu's pta_error(ErrCode.<code>) suffix as a new str ("" when it cannot be built). */
static PyObject *pta_suffix(const char *code)
{
    PyObject *args = Py_BuildValue("(s)", code);
    PyObject *r = args ? call_helper("_pta_error", args) : NULL;
    Py_XDECREF(args);
    if (!r || !PyUnicode_Check(r)) {
        Py_XDECREF(r);
        PyErr_Clear();
        return PyUnicode_FromString("");
    }
    return r;
}

/* Raises `exc` with a printf message followed by pta_error(code). */
static PyObject *raise_pta(PyObject *exc, const char *code, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    PyObject *suffix = pta_suffix(code);
    if (suffix) {
        PyErr_Format(exc, "%s%U", msg, suffix);
        Py_DECREF(suffix);
    }
    return NULL;
}

/* A failed runtime call: ValueError for a runtime that cannot start, else RuntimeError. */
static PyObject *raise_acl(const char *what, aclError rc)
{
    if (raise_init_error(rc))
        return NULL;
    return raise_pta(PyExc_RuntimeError, "ACL", "NPU function error: %s, error code is %d", what, (int)rc);
}

PyObject *raise_cache_error(aclError rc)
{
    npualloc_error_kind kind;
    const char *msg = npualloc_last_error(&kind);
    PyObject *exc;
    switch (kind) {
    case NPUALLOC_ERR_VALUE:
        exc = PyExc_ValueError;
        break;
    case NPUALLOC_ERR_TYPE:
        exc = PyExc_TypeError;
        break;
    case NPUALLOC_ERR_OOM:
        exc = OutOfMemoryError;
        break;
    default:
        exc = PyExc_RuntimeError;
        break;
    }
    int submodule, code;
    npualloc_last_error_suffix(&submodule, &code);
    if (kind == NPUALLOC_ERR_NONE || !msg || !msg[0]) {
        PyErr_Format(PyExc_RuntimeError, "npualloc: the allocator failed with ACL error %d", (int)rc);
    } else if (submodule >= 0) {
        /* torch_npu's C++ PTA_ERROR / OPS_ERROR suffix; built in Python, so msg is copied first. */
        char text[1024];
        snprintf(text, sizeof text, "%s", msg);
        PyObject *args = Py_BuildValue("(ii)", submodule, code);
        PyObject *suffix = args ? call_helper("_cpp_error_suffix", args) : NULL;
        Py_XDECREF(args);
        if (suffix && PyUnicode_Check(suffix)) {
            PyErr_Format(exc, "%s%U", text, suffix);
        } else { /* no suffix then, as pta_suffix does: the settings error is the one to raise */
            PyErr_Clear();
            PyErr_SetString(exc, text);
        }
        Py_XDECREF(suffix);
    } else {
        PyErr_SetString(exc, msg);
    }
    return NULL;
}

/* A failed call of the pluggable allocator's layer: torch_npu raises its RuntimeErrors ("Trying to
 * free a pointer not allocated here", "Can't swap an already initialized allocator") with the PTR
 * suffix. */
static PyObject *raise_pluggable_error(aclError rc)
{
    npualloc_error_kind kind;
    const char *msg = npualloc_last_error(&kind);
    if (kind != NPUALLOC_ERR_RUNTIME)
        return raise_cache_error(rc);
    return raise_pta(PyExc_RuntimeError, "PTR", "%s", msg);
}

/* A failed free: the caching allocator's "invalid device pointer" has no suffix. */
static PyObject *raise_free_error(aclError rc)
{
    return npualloc_allocator_is_pluggable() ? raise_pluggable_error(rc) : raise_cache_error(rc);
}

static int drain_warnings(void);

/* An allocation failed: out of memory calls the OOM observers, then raises OutOfMemoryError.
 * Warnings the failed call gave come first, as torch's TORCH_WARN does before its exception.  A
 * warning may run any Python (a showwarning hook that calls the allocator overwrites the thread's
 * last error and last OOM), so the failure is read in full before any warning is given. */
static PyObject *raise_alloc_failure(aclError rc)
{
    npualloc_error_kind kind;
    const char *m = npualloc_last_error(&kind);
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", m ? m : "");
    npualloc_oom_info info;
    npualloc_cache_last_oom(&info);
    if (rc != ACL_ERROR_RT_MEMORY_ALLOCATION || kind != NPUALLOC_ERR_OOM) {
        PyObject *type, *value, *tb;
        raise_cache_error(rc);
        PyErr_Fetch(&type, &value, &tb);
        if (drain_warnings() < 0) {
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            return NULL;
        }
        PyErr_Restore(type, value, tb);
        return NULL;
    }
    if (drain_warnings() < 0)
        return NULL;
    if (!info.over_1eb && !info.preemptive && oom_observers && PyList_GET_SIZE(oom_observers) > 0) {
        /* Observers may allocate (and so overwrite the thread's last error): msg is a copy. */
        PyObject *observers = PyList_GetSlice(oom_observers, 0, PY_SSIZE_T_MAX);
        if (!observers)
            return NULL;
        PyObject *args = Py_BuildValue("(iKKK)", (int)info.device, (unsigned long long)info.alloc_size,
                                       (unsigned long long)(info.fraction_set ? info.allowed : info.device_total),
                                       (unsigned long long)info.device_free);
        for (Py_ssize_t i = 0; args && i < PyList_GET_SIZE(observers); i++) {
            PyObject *r = PyObject_CallObject(PyList_GET_ITEM(observers, i), args);
            if (!r) {
                Py_DECREF(args);
                Py_DECREF(observers);
                return NULL; /* torch lets an observer's exception propagate */
            }
            Py_DECREF(r);
        }
        Py_XDECREF(args);
        Py_DECREF(observers);
        if (!args)
            return NULL;
    }
    PyErr_SetString(OutOfMemoryError, msg);
    return NULL;
}

/* Emits the allocator's pending warnings as UserWarnings; -1 if a warning became an error. */
static int drain_warnings(void)
{
    if (!npualloc_has_warnings())
        return 0;
    char buf[512];
    while (npualloc_pop_warning(buf, sizeof buf))
        if (PyErr_WarnEx(PyExc_UserWarning, buf, 1) < 0)
            return -1;
    return 0;
}

/* ---- arguments ---- */

/* Fills out[0..n) from positional and keyword arguments (NULL = not given); the first
 * `required` are mandatory. */
static int parse_args(const char *fn, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                      const char *const *names, Py_ssize_t n, Py_ssize_t required, PyObject **out)
{
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = NULL;
    if (nargs > n) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %zd positional arguments (%zd given)", fn, n, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++)
        out[i] = args[i];
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        Py_ssize_t j = 0;
        while (j < n && PyUnicode_CompareWithASCIIString(key, names[j]) != 0)
            j++;
        if (j == n) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", fn, key);
            return -1;
        }
        if (out[j]) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fn, names[j]);
            return -1;
        }
        out[j] = args[nargs + k];
    }
    for (Py_ssize_t i = 0; i < required; i++) {
        if (!out[i]) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s' (pos %zd)", fn, names[i], i + 1);
            return -1;
        }
    }
    return 0;
}

/* An int as a 64-bit pointer or handle; negative values wrap like PyLong_AsVoidPtr. */
static int as_u64(PyObject *o, const char *fn, const char *arg, uint64_t *out)
{
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s(): argument '%s' must be int, not %.80s", fn, arg, Py_TYPE(o)->tp_name);
        return -1;
    }
    /* PyLong_AsUnsignedLong: a digit loop, where 3.11's ...LongLong goes through a byte array */
    _Static_assert(sizeof(unsigned long) == sizeof(uint64_t), "an LP64 platform");
    unsigned long v = PyLong_AsUnsignedLong(o);
    if (v == (unsigned long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return -1;
        PyErr_Clear();
        int overflow = 0;
        long s = PyLong_AsLongAndOverflow(o, &overflow);
        if (s == -1 && PyErr_Occurred())
            return -1;
        if (overflow) {
            PyErr_Format(PyExc_OverflowError, "%s(): argument '%s' is out of range", fn, arg);
            return -1;
        }
        v = (unsigned long)s;
    }
    *out = v;
    return 0;
}

static int as_i32(PyObject *o, const char *fn, const char *arg, int32_t *out)
{
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s(): argument '%s' must be int, not %.80s", fn, arg, Py_TYPE(o)->tp_name);
        return -1;
    }
    int overflow = 0;
    long v = PyLong_AsLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow || v < INT32_MIN || v > INT32_MAX) { /* one message beyond 32 bits and beyond 64 */
        PyErr_Format(PyExc_OverflowError, "%s(): argument '%s' is out of range", fn, arg);
        return -1;
    }
    *out = (int32_t)v;
    return 0;
}

/* torch_npu's current_device(): the thread's device, lazily device 0 (its _lazy_init). */
static int lazy_current_device(int32_t *dev)
{
    aclError rc = aclrtGetDevice(dev);
    if (rc == ACL_ERROR_RT_CONTEXT_NULL) {
        rc = aclrtSetDevice(0);
        if (rc == ACL_SUCCESS)
            *dev = 0;
    }
    if (rc != ACL_SUCCESS) {
        raise_acl("c10_npu::GetDevice", rc);
        return -1;
    }
    return 0;
}

/* None: the current device; int: itself; anything else: npualloc.memory._get_device_index. */
static int resolve_device(PyObject *obj, int32_t *dev)
{
    if (!obj || obj == Py_None)
        return lazy_current_device(dev);
    if (PyLong_Check(obj))
        return as_i32(obj, "device", "device", dev);
    PyObject *args = PyTuple_Pack(1, obj);
    PyObject *r = args ? call_helper("_get_device_index", args) : NULL;
    Py_XDECREF(args);
    if (!r)
        return -1;
    int rc = as_i32(r, "_get_device_index", "device", dev);
    Py_DECREF(r);
    return rc;
}

/* torch_npu's stream argument: None = the current stream of `dev`, an npualloc.Stream, an int. */
static int resolve_stream(PyObject *obj, int32_t dev, uint64_t *out)
{
    if (!obj || obj == Py_None) {
        *out = current_stream_of(dev);
        return 0;
    }
    if (stream_type && !PyLong_Check(obj)) {
        int is = (PyObject *)Py_TYPE(obj) == stream_type ? 1 : PyObject_IsInstance(obj, stream_type);
        if (is < 0)
            return -1;
        if (is) {
            PyObject *h = PyObject_GetAttr(obj, str_npu_stream);
            if (!h)
                return -1;
            int rc = as_u64(h, "Stream", "npu_stream", out);
            Py_DECREF(h);
            return rc;
        }
    }
    if (!PyLong_Check(obj)) {
        raise_pta(PyExc_TypeError, "TYPE",
                  "Invalid type for stream argument, must be `torch_npu.npu.Stream` or `int` representing a pointer "
                  "to a exisiting stream");
        return -1;
    }
    return as_u64(obj, "caching_allocator_alloc", "stream", out);
}

static aclError record_stream_on(void *ptr, int32_t device, uint64_t stream)
{
    return device < 0 ? npualloc_cache_record_stream(ptr, stream) : npualloc_cache_record_stream_on(ptr, device, stream);
}

/* record_stream's and erase_stream's stream: *handle as resolve_stream gives it, and *device the
 * device of an npualloc.Stream (-1 for an int, whose 0 is the block's device's default stream):
 * each device's default stream has the handle 0. */
static int resolve_stream_use(PyObject *obj, uint64_t *handle, int32_t *device)
{
    if (resolve_stream(obj, 0, handle) < 0)
        return -1;
    *device = -1;
    if (PyLong_Check(obj))
        return 0;
    PyObject *d = PyObject_GetAttrString(obj, "device_index");
    if (!d)
        return -1;
    int rc = as_i32(d, "Stream", "device_index", device);
    Py_DECREF(d);
    return rc;
}

/* Switches the thread to `dev` (lazily starting the current device first); *prev gets the
 * device to switch back to with restore_device. */
static int enter_device(int32_t dev, int32_t *prev)
{
    if (lazy_current_device(prev) < 0)
        return -1;
    if (*prev != dev) {
        aclError rc = aclrtSetDevice(dev);
        if (rc != ACL_SUCCESS) {
            raise_acl("c10_npu::SetDevice(device_id_)", rc);
            return -1;
        }
    }
    return 0;
}

static void restore_device(int32_t dev, int32_t prev)
{
    if (prev != dev)
        (void)aclrtSetDevice(prev);
}

/* ---- memory history: the Python stack as an allocator context ----
 *
 * torch's _record_memory_history gathers the Python stack on every allocation when its record
 * level (RecordContext) is STATE or more, and on every free at ALL; the allocator keeps the
 * context for blocks and segments (>= STATE) and trace entries (>= ALLOC).  Here the stack is
 * gathered in the binding, with the GIL held, before the allocator is entered.
 *
 * Encoding (opaque to the allocator): a header {magic, count} and `count` frames
 * {code id, position}, innermost first (as torch's Python frames): 8 bytes a frame.  The code id
 * indexes a process-wide, append-only table of the code objects seen (references held, so an id
 * never names another object; only touched with the GIL held).  The position is the frame's last
 * instruction offset (Python >= 3.11; the line is worked out only when a snapshot is decoded, as
 * torch does, since computing it dominates the cost of gathering) or the line itself (3.9, 3.10).
 * Identical stacks share one context through a small cache.  Snapshots decode contexts into
 * torch's frame dicts {"name", "filename", "line"}: one list per context and one dict per distinct
 * frame, shared as torch's py_symbolize shares them.
 *
 * The hot path with history off costs one integer load: `hist_level` mirrors the level set
 * through _record_history (0 = off); it is only read and written with the GIL held. */

#if PY_VERSION_HEX >= 0x030B0000
#define CTX_MAGIC 0x3146504eu /* "NPF1": positions are instruction offsets */
#else
#define CTX_MAGIC 0x314c504eu /* "NPL1": positions are line numbers */
#endif

typedef struct {
    uint32_t magic, count;
} ctx_header;

typedef struct {
    uint32_t code;
    int32_t pos;
} ctx_frame;

static int hist_level;    /* npualloc_record_context of the history started here; 0 = off */
static uint64_t hist_gen; /* the runtime generation it was started in */

/* The code table: id -> code object (a list holding references) and code pointer -> id (open
 * addressing, linear probing). */
typedef struct {
    PyObject *code;
    uint32_t id;
} code_slot;

static PyObject *hist_codes;
static code_slot *code_map;
static size_t code_map_cap, code_map_count;

static ctx_frame *hist_buf; /* header + frames being gathered */
static size_t hist_buf_cap; /* in ctx_frame units */

#define CTX_CACHE_SLOTS 64
static npualloc_context *ctx_cache[CTX_CACHE_SLOTS]; /* recent stacks, by hash (references held) */

static void ctx_cache_clear(void)
{
    for (int i = 0; i < CTX_CACHE_SLOTS; i++) {
        npualloc_context_release(ctx_cache[i]);
        ctx_cache[i] = NULL;
    }
}

static inline size_t code_hash(const void *p) { return (size_t)(((uintptr_t)p >> 4) * 0x9E3779B97F4A7C15ull); }

static bool code_map_grow(void)
{
    size_t cap = code_map_cap ? code_map_cap * 2 : 256;
    code_slot *slots = PyMem_Calloc(cap, sizeof *slots);
    if (!slots)
        return false;
    for (size_t i = 0; i < code_map_cap; i++) {
        if (!code_map[i].code)
            continue;
        size_t j = code_hash(code_map[i].code) & (cap - 1);
        while (slots[j].code)
            j = (j + 1) & (cap - 1);
        slots[j] = code_map[i];
    }
    PyMem_Free(code_map);
    code_map = slots;
    code_map_cap = cap;
    return true;
}

/* The id of a code object in the table (adding it), or -1 when the table cannot grow. */
static inline long code_id(PyObject *code)
{
    if (code_map_cap) {
        for (size_t i = code_hash(code) & (code_map_cap - 1);; i = (i + 1) & (code_map_cap - 1)) {
            if (code_map[i].code == code)
                return code_map[i].id;
            if (!code_map[i].code)
                break;
        }
    }
    if ((code_map_count + 1) * 2 > code_map_cap && !code_map_grow())
        return -1;
    if (!hist_codes && !(hist_codes = PyList_New(0)))
        return -1;
    Py_ssize_t id = PyList_GET_SIZE(hist_codes);
    if (id >= INT32_MAX || PyList_Append(hist_codes, code) < 0)
        return -1;
    size_t i = code_hash(code) & (code_map_cap - 1);
    while (code_map[i].code)
        i = (i + 1) & (code_map_cap - 1);
    code_map[i].code = code; /* the list holds the reference */
    code_map[i].id = (uint32_t)id;
    code_map_count++;
    return (long)id;
}

static bool hist_reserve(size_t n)
{
    if (n <= hist_buf_cap)
        return true;
    size_t cap = hist_buf_cap ? hist_buf_cap * 2 : 128;
    while (cap < n)
        cap *= 2;
    ctx_frame *grown = PyMem_Realloc(hist_buf, cap * sizeof *grown);
    if (!grown)
        return false;
    hist_buf = grown;
    hist_buf_cap = cap;
    return true;
}

/* The calling thread's Python stack as a new context (a reference the caller releases), or NULL
 * when it cannot be gathered (never raises: losing a stack must not fail an allocation). */
static npualloc_context *gather_stack(void)
{
    _Static_assert(sizeof(ctx_header) == sizeof(ctx_frame), "the header takes one frame slot");
    static bool gathering;
    if (gathering)
        return NULL; /* a Buffer collected by a GC that a frame allocation started: no stack for it */
    gathering = true;
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb); /* a dealloc may run with an exception set */
    size_t n = 0;
    bool ok = hist_reserve(1);
    PyFrameObject *f = PyEval_GetFrame(); /* borrowed */
    Py_XINCREF(f);
    while (f && ok) {
        PyCodeObject *code = PyFrame_GetCode(f);
        long id = code_id((PyObject *)code);
        Py_DECREF(code);
        if (id < 0 || !hist_reserve(n + 2)) {
            ok = false;
            break;
        }
        ctx_frame *fr = &hist_buf[1 + n++];
        fr->code = (uint32_t)id;
#if PY_VERSION_HEX >= 0x030B0000
        fr->pos = PyFrame_GetLasti(f);
#else
        fr->pos = PyFrame_GetLineNumber(f);
#endif
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
    Py_XDECREF(f);
    npualloc_context *ctx = NULL;
    if (ok) {
        ctx_header h = {CTX_MAGIC, (uint32_t)n};
        memcpy(hist_buf, &h, sizeof h);
        size_t len = (n + 1) * sizeof(ctx_frame);
        /* The same stack again shares the cached context. */
        uint64_t hash = 0x9E3779B97F4A7C15ull;
        for (size_t i = 1; i <= n; i++) {
            uint64_t w = ((uint64_t)hist_buf[i].code << 32) | (uint32_t)hist_buf[i].pos;
            hash = (hash ^ w) * 0x100000001B3ull;
            hash ^= hash >> 29;
        }
        npualloc_context **slot = &ctx_cache[(hash ^ (hash >> 32)) % CTX_CACHE_SLOTS];
        size_t have = 0;
        const void *data = *slot ? npualloc_context_data(*slot, &have) : NULL;
        if (data && have == len && memcmp(data, hist_buf, len) == 0) {
            ctx = *slot;
        } else if ((ctx = npualloc_context_create(hist_buf, len))) {
            npualloc_context_release(*slot);
            *slot = ctx;
        }
        npualloc_context_retain(ctx); /* the caller's reference; the cache keeps its own */
    }
    PyErr_Clear();
    PyErr_Restore(et, ev, tb);
    gathering = false;
    return ctx;
}

/* A context for a call that needs record level `want` (STATE: allocations, ALL: frees and
 * empty_cache), or NULL.  Callers test `hist_level` first, so history off costs one load. */
static npualloc_context *gather_context(int want)
{
    if (hist_level < want)
        return NULL;
    if (hist_gen != gen_now()) { /* the runtime restarted: its history is gone */
        hist_level = 0;
        ctx_cache_clear();
        return NULL;
    }
    return gather_stack();
}

#define GATHER(want) (unlikely(hist_level >= (want)) ? gather_context(want) : NULL)

/* Decodes contexts into torch's frame lists while one snapshot is built. */
typedef struct {
    PyObject *lists;  /* context address -> list of frame dicts */
    PyObject *frames; /* (code id, position) -> frame dict */
    PyObject *s_name, *s_filename, *s_line, *s_unknown;
} frame_decoder;

static int decoder_init(frame_decoder *d)
{
    memset(d, 0, sizeof *d);
    d->lists = PyDict_New();
    d->frames = PyDict_New();
    d->s_name = PyUnicode_InternFromString("name");
    d->s_filename = PyUnicode_InternFromString("filename");
    d->s_line = PyUnicode_InternFromString("line");
    d->s_unknown = PyUnicode_InternFromString("??");
    return d->lists && d->frames && d->s_name && d->s_filename && d->s_line && d->s_unknown ? 0 : -1;
}

static void decoder_free(frame_decoder *d)
{
    Py_XDECREF(d->lists);
    Py_XDECREF(d->frames);
    Py_XDECREF(d->s_name);
    Py_XDECREF(d->s_filename);
    Py_XDECREF(d->s_line);
    Py_XDECREF(d->s_unknown);
}

/* torch's frame dict, key order as its py_symbolize: name, filename, line. */
static PyObject *frame_dict(frame_decoder *d, PyObject *name, PyObject *filename, long line)
{
    PyObject *f = PyDict_New();
    PyObject *l = PyLong_FromLong(line);
    if (!f || !l || PyDict_SetItem(f, d->s_name, name) < 0 || PyDict_SetItem(f, d->s_filename, filename) < 0 ||
        PyDict_SetItem(f, d->s_line, l) < 0) {
        Py_XDECREF(f);
        Py_XDECREF(l);
        return NULL;
    }
    Py_DECREF(l);
    return f;
}

/* The dict of one encoded frame (a new reference), shared by every list that has it. */
static PyObject *decode_frame(frame_decoder *d, ctx_frame fr)
{
    PyObject *key = PyLong_FromUnsignedLongLong(((unsigned long long)fr.code << 32) | (uint32_t)fr.pos);
    if (!key)
        return NULL;
    PyObject *f = PyDict_GetItemWithError(d->frames, key);
    if (f || PyErr_Occurred()) {
        Py_XINCREF(f);
        Py_DECREF(key);
        return f;
    }
    if (hist_codes && fr.code < (uint64_t)PyList_GET_SIZE(hist_codes)) {
        PyCodeObject *code = (PyCodeObject *)PyList_GET_ITEM(hist_codes, fr.code);
#if PY_VERSION_HEX >= 0x030B0000
        long line = PyCode_Addr2Line(code, fr.pos);
#else
        long line = fr.pos;
#endif
        f = frame_dict(d, code->co_name, code->co_filename, line);
    } else {
        f = frame_dict(d, d->s_unknown, d->s_unknown, 0);
    }
    if (f && PyDict_SetItem(d->frames, key, f) < 0)
        Py_CLEAR(f);
    Py_DECREF(key);
    return f;
}

/* The frames of a context as a new reference to its (shared) list; [] for NULL.  A context that
 * was not made here (a C caller's) shows as one frame named by its bytes. */
static PyObject *decode_frames(frame_decoder *d, npualloc_context *ctx)
{
    if (!ctx)
        return PyList_New(0);
    PyObject *key = PyLong_FromVoidPtr(ctx);
    if (!key)
        return NULL;
    PyObject *list = PyDict_GetItemWithError(d->lists, key);
    if (list || PyErr_Occurred()) {
        Py_DECREF(key);
        Py_XINCREF(list);
        return list;
    }
    size_t len = 0;
    const unsigned char *data = npualloc_context_data(ctx, &len);
    ctx_header h = {0, 0};
    if (len >= sizeof h)
        memcpy(&h, data, sizeof h);
    if (h.magic == CTX_MAGIC && len == ((size_t)h.count + 1) * sizeof(ctx_frame)) {
        list = PyList_New((Py_ssize_t)h.count);
        for (uint32_t i = 0; list && i < h.count; i++) {
            ctx_frame fr;
            memcpy(&fr, data + (size_t)(i + 1) * sizeof fr, sizeof fr);
            PyObject *f = decode_frame(d, fr);
            if (!f) {
                Py_CLEAR(list);
                break;
            }
            PyList_SET_ITEM(list, i, f);
        }
    } else {
        PyObject *text = PyUnicode_DecodeUTF8((const char *)data, (Py_ssize_t)len, "replace");
        PyObject *f = text ? frame_dict(d, text, d->s_unknown, 0) : NULL;
        Py_XDECREF(text);
        list = f ? PyList_New(1) : NULL;
        if (list)
            PyList_SET_ITEM(list, 0, f);
        else
            Py_XDECREF(f);
    }
    if (list && PyDict_SetItem(d->lists, key, list) < 0)
        Py_CLEAR(list);
    Py_DECREF(key);
    return list;
}

/* ---- caching_allocator_alloc / caching_allocator_delete ---- */

static PyObject *m_caching_allocator_alloc(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                           PyObject *kwnames)
{
    (void)self;
    static const char *const names[] = {"size", "device", "stream"};
    PyObject *a[3] = {NULL, NULL, NULL};
    if (!kwnames && nargs >= 1 && nargs <= 3) {
        for (Py_ssize_t i = 0; i < nargs; i++)
            a[i] = args[i];
    } else if (parse_args("caching_allocator_alloc", args, nargs, kwnames, names, 3, 1, a) < 0) {
        return NULL;
    }
    int32_t dev;
    if (resolve_device(a[1], &dev) < 0)
        return NULL;
    /* torch_npu passes -1 on: current_stream(-1) and the allocation then take the current device */
    if (dev == -1 && lazy_current_device(&dev) < 0)
        return NULL;
    uint64_t stream;
    if (resolve_stream(a[2], dev, &stream) < 0)
        return NULL;
    if (!PyLong_Check(a[0])) {
        PyErr_Format(PyExc_TypeError, "caching_allocator_alloc(): argument 'size' must be int, not %.80s",
                     Py_TYPE(a[0])->tp_name);
        return NULL;
    }
    Py_ssize_t size = PyLong_AsSsize_t(a[0]); /* as torch_npu: a negative size wraps to a huge one */
    if (size == -1 && PyErr_Occurred())
        return NULL;
    if (size == 0)
        return PyLong_FromLong(0);
    void *p = NULL;
    aclError rc;
    npualloc_context *ctx = GATHER(NPUALLOC_RECORD_STATE);
    /* A cache hit needs no wait: only a miss gives up the GIL (a device allocation may have to
     * wait for streams whose callbacks need it). */
    if (npualloc_cache_malloc_cached(dev, (size_t)size, stream, ctx, &p))
        rc = ACL_SUCCESS;
    else
        WAITING_CALL(rc = npualloc_cache_malloc_ctx(dev, (size_t)size, stream, ctx, &p));
    npualloc_context_release(ctx);
    if (rc != ACL_SUCCESS)
        return raise_alloc_failure(rc);
    if (drain_warnings() < 0) {
        LOCKING_CALL((void)npualloc_cache_free(p)); /* as every free: never wait for the lock holding the GIL */
        return NULL;
    }
    return PyLong_FromVoidPtr(p);
}

static PyObject *m_caching_allocator_delete(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                            PyObject *kwnames)
{
    (void)self;
    /* torch's caching_allocator_delete(mem_ptr) is a Python function: mem_ptr= works too */
    static const char *const names[] = {"mem_ptr"};
    PyObject *arg = NULL;
    if (!kwnames && nargs == 1)
        arg = args[0];
    else if (parse_args("caching_allocator_delete", args, nargs, kwnames, names, 1, 1, &arg) < 0)
        return NULL;
    uint64_t p;
    if (as_u64(arg, "caching_allocator_delete", "mem_ptr", &p) < 0)
        return NULL;
    if (p == 0)
        Py_RETURN_NONE;
    aclError rc;
    npualloc_context *ctx = GATHER(NPUALLOC_RECORD_ALL);
    if (unlikely(npualloc_allocator_is_pluggable())) /* the library's free_fn may take its time */
        WAITING_CALL(rc = npualloc_cache_free_ctx((void *)(uintptr_t)p, ctx));
    else
        LOCKING_CALL(rc = npualloc_cache_free_ctx((void *)(uintptr_t)p, ctx));
    npualloc_context_release(ctx);
    if (rc != ACL_SUCCESS)
        return raise_free_error(rc);
    if (drain_warnings() < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* ---- Buffer ---- */

/* The types PyMemberDef reads (Buffer_members): unsigned long long and int; ptr, nbytes and freed are read
 * through getters (Buffer_getset), which see a Buffer of an ended runtime as freed. */
typedef struct {
    PyObject_HEAD unsigned long long ptr;
    unsigned long long nbytes;
    int device;
    unsigned long long stream;
    uint64_t gen;
    Py_ssize_t exports;
    bool freed;
    PyObject *weakrefs;
} BufferObject;

static PyTypeObject Buffer_Type;

/* Views of Buffer memory exported and not released yet, all Buffers together (the GIL guards it): the
 * runtime is not shut down under one, which would unmap the memory a memoryview still reads. */
static Py_ssize_t buffer_views;

Py_ssize_t memory_py_buffer_views(void) { return buffer_views; }

/* Memory of a runtime that ended (a restart or shutdown since) is gone: the Buffer reads as freed, so that
 * its old pointer, which the new runtime may hand out again, is not taken for its memory. */
static void buffer_forget_if_stale(BufferObject *b)
{
    if (!b->freed && b->gen != gen_now()) {
        b->freed = true;
        b->ptr = 0;
        b->nbytes = 0;
    }
}

/* Gives the memory back (GIL released: an uncached free synchronizes the device). */
static int buffer_release(BufferObject *b)
{
    if (b->freed)
        return 0;
    b->freed = true;
    void *p = (void *)(uintptr_t)b->ptr;
    b->ptr = 0;
    b->nbytes = 0;
    if (!p || b->gen != gen_now())
        return 0; /* nothing, or memory of a runtime that was shut down */
    aclError rc;
    if (npualloc_caching_disabled() || npualloc_allocator_is_pluggable()) {
        WAITING_CALL(rc = npualloc_deallocate(p)); /* synchronizes the device, or calls the library's free_fn */
    } else {
        /* npualloc_deallocate of cached memory is npualloc_cache_free: with the free's context */
        npualloc_context *ctx = GATHER(NPUALLOC_RECORD_ALL);
        LOCKING_CALL(rc = npualloc_cache_free_ctx(p, ctx));
        npualloc_context_release(ctx);
    }
    if (rc != ACL_SUCCESS) {
        raise_free_error(rc);
        return -1;
    }
    return 0;
}

/* Gives the memory back when the Buffer is collected.  A finalizer (PEP 442), not the deallocator: a free that
 * fails is reported with the Buffer itself, which the unraisable hook takes a reference to, and an object in
 * tp_dealloc (no references left) would be deallocated again when that reference is dropped. */
static void Buffer_finalize(BufferObject *b)
{
    if (b->freed)
        return;
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    if (buffer_release(b) < 0)
        PyErr_WriteUnraisable((PyObject *)b);
    else
        (void)drain_warnings();
    PyErr_Clear();
    PyErr_Restore(et, ev, tb);
}

static void Buffer_dealloc(BufferObject *b)
{
    if (PyObject_CallFinalizerFromDealloc((PyObject *)b) < 0)
        return; /* the finalizer's report kept it alive */
    if (b->weakrefs)
        PyObject_ClearWeakRefs((PyObject *)b);
    Py_TYPE(b)->tp_free((PyObject *)b);
}

static int Buffer_getbuffer(BufferObject *b, Py_buffer *view, int flags)
{
    if (b->gen != gen_now()) { /* (freed or not: the runtime's end is the reason to give) */
        PyErr_SetString(PyExc_BufferError, "npualloc.Buffer: the runtime that owned the memory was shut down");
        return -1;
    }
    if (b->freed) {
        PyErr_SetString(PyExc_BufferError, "npualloc.Buffer: the memory was freed");
        return -1;
    }
    if (PyBuffer_FillInfo(view, (PyObject *)b, (void *)(uintptr_t)b->ptr, (Py_ssize_t)b->nbytes, 0, flags) < 0)
        return -1;
    b->exports++;
    buffer_views++;
    return 0;
}

static void Buffer_releasebuffer(BufferObject *b, Py_buffer *view)
{
    (void)view;
    b->exports--;
    buffer_views--;
}

static PyBufferProcs Buffer_as_buffer = {(getbufferproc)Buffer_getbuffer, (releasebufferproc)Buffer_releasebuffer};

static PyObject *Buffer_free(BufferObject *b, PyObject *unused)
{
    (void)unused;
    if (b->exports > 0) {
        PyErr_Format(PyExc_BufferError, "npualloc.Buffer.free(): %zd exported view(s) of the memory still exist",
                     b->exports);
        return NULL;
    }
    if (buffer_release(b) < 0 || drain_warnings() < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Buffer_record_stream(BufferObject *b, PyObject *stream)
{
    buffer_forget_if_stale(b); /* its old pointer may be another block of the new runtime's */
    if (b->freed) {
        PyErr_SetString(PyExc_RuntimeError, "npualloc.Buffer.record_stream(): the memory was freed");
        return NULL;
    }
    uint64_t h;
    int32_t dev;
    if (stream == Py_None) {
        PyErr_SetString(PyExc_TypeError, "record_stream(): argument 'stream' must be npualloc.Stream or int");
        return NULL;
    }
    if (resolve_stream_use(stream, &h, &dev) < 0)
        return NULL;
    void *ptr = (void *)(uintptr_t)b->ptr; /* read with the GIL held: the call may release it */
    if (!ptr || npualloc_caching_disabled())
        Py_RETURN_NONE; /* torch: memory not from the caching allocator is ignored */
    aclError rc;
    LOCKING_CALL(rc = record_stream_on(ptr, dev, h));
    if (rc != ACL_SUCCESS)
        return raise_cache_error(rc);
    Py_RETURN_NONE;
}

static PyObject *Buffer_enter(PyObject *b, PyObject *unused)
{
    (void)unused;
    Py_INCREF(b);
    return b;
}

static PyObject *Buffer_exit(BufferObject *b, PyObject *args)
{
    (void)args;
    return Buffer_free(b, NULL);
}

static Py_ssize_t Buffer_len(BufferObject *b)
{
    buffer_forget_if_stale(b);
    return (Py_ssize_t)b->nbytes;
}

static PyObject *Buffer_get_ptr(BufferObject *b, void *unused)
{
    (void)unused;
    buffer_forget_if_stale(b);
    return PyLong_FromUnsignedLongLong(b->ptr);
}

static PyObject *Buffer_get_nbytes(BufferObject *b, void *unused)
{
    (void)unused;
    buffer_forget_if_stale(b);
    return PyLong_FromUnsignedLongLong(b->nbytes);
}

static PyObject *Buffer_get_freed(BufferObject *b, void *unused)
{
    (void)unused;
    buffer_forget_if_stale(b);
    return PyBool_FromLong(b->freed);
}

static PyGetSetDef Buffer_getset[] = {
    {"ptr", (getter)Buffer_get_ptr, NULL, "The device pointer (0 once freed, or once its runtime ended).", NULL},
    {"nbytes", (getter)Buffer_get_nbytes, NULL, "The size asked for, in bytes (0 once freed, or once its runtime ended).",
     NULL},
    {"freed", (getter)Buffer_get_freed, NULL,
     "True once the memory was given back, or once the runtime it came from ended (a restart or shutdown).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyObject *Buffer_repr(BufferObject *b)
{
    buffer_forget_if_stale(b);
    if (b->freed)
        return PyUnicode_FromFormat("<npualloc.Buffer freed, device=npu:%d>", (int)b->device);
    char text[160];
    snprintf(text, sizeof text, "<npualloc.Buffer ptr=0x%llx nbytes=%llu device=npu:%d stream=0x%llx>",
             (unsigned long long)b->ptr, (unsigned long long)b->nbytes, (int)b->device,
             (unsigned long long)b->stream);
    return PyUnicode_FromString(text);
}

static PyMethodDef Buffer_methods[] = {
    /* text signatures ("name($self, ...)\n--\n\n") for help() and inspect.signature() */
    {"free", (PyCFunction)Buffer_free, METH_NOARGS,
     "free($self, /)\n--\n\nGives the memory back now (BufferError while views of it exist); later calls do nothing."},
    {"record_stream", (PyCFunction)Buffer_record_stream, METH_O,
     "record_stream($self, stream, /)\n--\n\n"
     "The memory is reused only after the work queued on `stream` when it is freed."},
    {"__enter__", Buffer_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Buffer_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Buffer_members[] = {
    {"device", T_INT, offsetof(BufferObject, device), READONLY, "The device index."},
    {"stream", T_ULONGLONG, offsetof(BufferObject, stream), READONLY, "The stream handle the memory was allocated on."},
    {NULL, 0, 0, 0, NULL},
};

static PySequenceMethods Buffer_as_sequence = {.sq_length = (lenfunc)Buffer_len};

static PyTypeObject Buffer_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "npualloc.Buffer",
    .tp_basicsize = sizeof(BufferObject),
    .tp_dealloc = (destructor)Buffer_dealloc,
    .tp_finalize = (destructor)Buffer_finalize,
    .tp_repr = (reprfunc)Buffer_repr,
    .tp_as_sequence = &Buffer_as_sequence,
    .tp_as_buffer = &Buffer_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Device memory from npualloc.empty(): .ptr, .nbytes, .device, .stream, a writable buffer "
              "(numpy.frombuffer, memoryview), record_stream(s), free(); freed when collected.",
    .tp_weaklistoffset = offsetof(BufferObject, weakrefs),
    .tp_methods = Buffer_methods,
    .tp_members = Buffer_members,
    .tp_getset = Buffer_getset,
};

static PyObject *m_empty(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    (void)self;
    static const char *const names[] = {"nbytes", "device", "stream"};
    PyObject *a[3];
    if (parse_args("empty", args, nargs, kwnames, names, 3, 1, a) < 0)
        return NULL;
    if (!PyLong_Check(a[0])) {
        PyErr_Format(PyExc_TypeError, "empty(): argument 'nbytes' must be int, not %.80s", Py_TYPE(a[0])->tp_name);
        return NULL;
    }
    long long n = PyLong_AsLongLong(a[0]);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 0) {
        PyErr_Format(PyExc_ValueError, "empty(): nbytes must not be negative, got %lld", n);
        return NULL;
    }
    int32_t dev;
    if (resolve_device(a[1], &dev) < 0)
        return NULL;
    uint64_t stream;
    if (resolve_stream(a[2], dev, &stream) < 0)
        return NULL;
    BufferObject *b = PyObject_New(BufferObject, &Buffer_Type);
    if (!b)
        return NULL;
    b->ptr = 0;
    b->nbytes = 0;
    b->device = dev;
    b->stream = stream;
    b->gen = gen_now();
    b->exports = 0;
    b->freed = false;
    b->weakrefs = NULL;
    void *p = NULL;
    aclError rc = ACL_SUCCESS;
    if (n > 0 && npualloc_caching_disabled()) {
        WAITING_CALL(rc = npualloc_allocate(dev, (size_t)n, stream, &p)); /* no cache, no history */
    } else if (n > 0) {
        /* cached memory, with the caller's stack; a miss (or 1 EB) goes the whole allocate() way */
        npualloc_context *ctx = GATHER(NPUALLOC_RECORD_STATE);
        if (!npualloc_cache_malloc_cached(dev, (size_t)n, stream, ctx, &p))
            WAITING_CALL(rc = npualloc_allocate_ctx(dev, (size_t)n, stream, ctx, &p));
        npualloc_context_release(ctx);
    }
    if (rc != ACL_SUCCESS) {
        b->freed = true;
        Py_DECREF(b);
        return raise_alloc_failure(rc);
    }
    b->ptr = (uintptr_t)p;
    b->nbytes = (uint64_t)n;
    if (drain_warnings() < 0) {
        Py_DECREF(b);
        return NULL;
    }
    return (PyObject *)b;
}

/* ---- the torch_npu memory functions behind npualloc.memory ---- */

static PyObject *m_empty_cache(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    aclError rc;
    /* torch's emptyCache gathers a context at ALL: its segment_free entries keep it */
    npualloc_context *ctx = GATHER(NPUALLOC_RECORD_ALL);
    WAITING_CALL(rc = npualloc_cache_empty_ctx(ctx));
    npualloc_context_release(ctx);
    if (rc != ACL_SUCCESS)
        return raise_cache_error(rc);
    if (drain_warnings() < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *m_empty_virt_addr_cache(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    aclError rc;
    WAITING_CALL(rc = npualloc_cache_empty_virt_addr_cache());
    if (rc != ACL_SUCCESS)
        return raise_cache_error(rc);
    if (drain_warnings() < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* torch_npu's statistics: the scalars, the arrays (an entry per pool) and the single Stats, each in the
 * order of its nested dict (memory_stats_as_nested_dict), with where its value lives in npualloc_stats. */
typedef struct stat_place {
    const char *name;
    size_t offset;
} stat_place;

enum { STAT_SCALARS = 7, STAT_ARRAYS = 9, STAT_SINGLES = 2, STAT_FIELDS = 4 };
static const stat_place stat_scalars[STAT_SCALARS] = {
    {"num_alloc_retries", offsetof(npualloc_stats, num_alloc_retries)},
    {"num_ooms", offsetof(npualloc_stats, num_ooms)},
    {"max_split_size", offsetof(npualloc_stats, max_split_size)},
    {"num_sync_all_streams", offsetof(npualloc_stats, num_sync_all_streams)},
    {"num_device_alloc", offsetof(npualloc_stats, num_device_alloc)},
    {"num_device_free", offsetof(npualloc_stats, num_device_free)},
    {"num_oom_rejections", offsetof(npualloc_stats, num_oom_rejections)},
};
static const stat_place stat_arrays[STAT_ARRAYS] = {
    {"allocation", offsetof(npualloc_stats, allocation)},
    {"segment", offsetof(npualloc_stats, segment)},
    {"active", offsetof(npualloc_stats, active)},
    {"inactive_split", offsetof(npualloc_stats, inactive_split)},
    {"allocated_bytes", offsetof(npualloc_stats, allocated_bytes)},
    {"reserved_bytes", offsetof(npualloc_stats, reserved_bytes)},
    {"active_bytes", offsetof(npualloc_stats, active_bytes)},
    {"inactive_split_bytes", offsetof(npualloc_stats, inactive_split_bytes)},
    {"requested_bytes", offsetof(npualloc_stats, requested_bytes)},
};
static const stat_place stat_singles[STAT_SINGLES] = {
    {"oversize_allocations", offsetof(npualloc_stats, oversize_allocations)},
    {"oversize_segments", offsetof(npualloc_stats, oversize_segments)},
};
static const stat_place stat_fields[STAT_FIELDS] = {
    {"current", offsetof(npualloc_stat, current)},
    {"peak", offsetof(npualloc_stat, peak)},
    {"allocated", offsetof(npualloc_stat, allocated)},
    {"freed", offsetof(npualloc_stat, freed)},
};
static const char *const stat_pools[NPUALLOC_STAT_TYPES] = {"all", "small_pool", "large_pool"};

static const void *stat_at(const npualloc_stats *s, size_t offset) { return (const char *)s + offset; }

static int64_t stat_value(const npualloc_stats *s, size_t offset)
{
    int64_t v;
    memcpy(&v, stat_at(s, offset), sizeof v);
    return v;
}

static int read_stats(int32_t dev, npualloc_stats *s)
{
    aclError rc;
    LOCKING_CALL(rc = npualloc_cache_get_stats(dev, s));
    if (rc != ACL_SUCCESS) {
        raise_cache_error(rc);
        return -1;
    }
    return 0;
}

static PyObject *stat_dict(const npualloc_stat *s)
{
    return Py_BuildValue("{s:L,s:L,s:L,s:L}", "current", (long long)s->current, "peak", (long long)s->peak,
                         "allocated", (long long)s->allocated, "freed", (long long)s->freed);
}

static int put_stat_array(PyObject *d, const char *key, const npualloc_stat *arr)
{
    PyObject *sub = PyDict_New();
    if (!sub)
        return -1;
    for (int i = 0; i < NPUALLOC_STAT_TYPES; i++) {
        PyObject *s = stat_dict(&arr[i]);
        if (!s || PyDict_SetItemString(sub, stat_pools[i], s) < 0) {
            Py_XDECREF(s);
            Py_DECREF(sub);
            return -1;
        }
        Py_DECREF(s);
    }
    int rc = PyDict_SetItemString(d, key, sub);
    Py_DECREF(sub);
    return rc;
}

static int put_i64(PyObject *d, const char *key, int64_t v)
{
    PyObject *o = PyLong_FromLongLong(v);
    if (!o)
        return -1;
    int rc = PyDict_SetItemString(d, key, o);
    Py_DECREF(o);
    return rc;
}

static int put_obj(PyObject *d, const char *key, PyObject *o)
{
    if (!o)
        return -1;
    int rc = PyDict_SetItemString(d, key, o);
    Py_DECREF(o);
    return rc;
}

/* _stats(device) -> the nested dict of torch_npu's _npu_memoryStats, in its key order. */
static PyObject *m_stats(PyObject *self, PyObject *arg)
{
    (void)self;
    int32_t dev;
    npualloc_stats s;
    if (as_i32(arg, "memory_stats", "device", &dev) < 0 || read_stats(dev, &s) < 0)
        return NULL;
    PyObject *d = PyDict_New();
    int rc = d ? 0 : -1;
    for (int i = 0; rc == 0 && i < STAT_SCALARS; i++)
        rc = put_i64(d, stat_scalars[i].name, stat_value(&s, stat_scalars[i].offset));
    for (int i = 0; rc == 0 && i < STAT_ARRAYS; i++)
        rc = put_stat_array(d, stat_arrays[i].name, stat_at(&s, stat_arrays[i].offset));
    for (int i = 0; rc == 0 && i < STAT_SINGLES; i++)
        rc = put_obj(d, stat_singles[i].name, stat_dict(stat_at(&s, stat_singles[i].offset)));
    if (rc < 0)
        Py_CLEAR(d);
    return d;
}

/* ---- memory_stats(): torch_npu's flat keys ---- */

/* Every key of memory_stats() ("allocated_bytes.all.current", ...) with where its value lives,
 * sorted as memory_stats() returns them.  Built once: memory_stats() then costs a list of pairs
 * (about 70 -> 16 us), and memory_allocated() and its kin read one value instead of flattening
 * all 123. */
typedef struct flat_stat {
    char name[48];
    size_t offset;
    PyObject *key; /* the interned name */
} flat_stat;

enum { FLAT_STAT_COUNT = STAT_SCALARS + (STAT_ARRAYS * NPUALLOC_STAT_TYPES + STAT_SINGLES) * STAT_FIELDS };
static flat_stat flat_stats[FLAT_STAT_COUNT];

/* A name against an entry (bsearch), and two entries (qsort). */
static int flat_stat_name_cmp(const void *name, const void *entry)
{
    return strcmp(name, ((const flat_stat *)entry)->name);
}

static int flat_stat_cmp(const void *a, const void *b) { return flat_stat_name_cmp(((const flat_stat *)a)->name, b); }

static void flat_stat_set(flat_stat *f, const char *prefix, const char *pool, const stat_place *field,
                          size_t offset)
{
    snprintf(f->name, sizeof f->name, "%s%s%s%s%s", prefix, pool ? "." : "", pool ? pool : "",
             field ? "." : "", field ? field->name : "");
    f->offset = offset + (field ? field->offset : 0);
}

static int build_flat_stats(void)
{
    flat_stat *f = flat_stats;
    for (int a = 0; a < STAT_SCALARS; a++)
        flat_stat_set(f++, stat_scalars[a].name, NULL, NULL, stat_scalars[a].offset);
    for (int a = 0; a < STAT_ARRAYS; a++)
        for (int p = 0; p < NPUALLOC_STAT_TYPES; p++)
            for (int i = 0; i < STAT_FIELDS; i++)
                flat_stat_set(f++, stat_arrays[a].name, stat_pools[p], &stat_fields[i],
                              stat_arrays[a].offset + (size_t)p * sizeof(npualloc_stat));
    for (int a = 0; a < STAT_SINGLES; a++)
        for (int i = 0; i < STAT_FIELDS; i++)
            flat_stat_set(f++, stat_singles[a].name, NULL, &stat_fields[i], stat_singles[a].offset);
    qsort(flat_stats, FLAT_STAT_COUNT, sizeof flat_stats[0], flat_stat_cmp); /* ASCII: Python's order too */
    for (int i = 0; i < FLAT_STAT_COUNT; i++)
        if (!(flat_stats[i].key = PyUnicode_InternFromString(flat_stats[i].name)))
            return -1;
    return 0;
}

/* _flat_stats(device) -> [(key, value), ...] in memory_stats()'s order. */
static PyObject *m_flat_stats(PyObject *self, PyObject *arg)
{
    (void)self;
    int32_t dev;
    npualloc_stats s;
    if (as_i32(arg, "memory_stats", "device", &dev) < 0 || read_stats(dev, &s) < 0)
        return NULL;
    PyObject *list = PyList_New(FLAT_STAT_COUNT);
    for (Py_ssize_t i = 0; list && i < FLAT_STAT_COUNT; i++) {
        PyObject *pair =
            Py_BuildValue("(OL)", flat_stats[i].key, (long long)stat_value(&s, flat_stats[i].offset));
        if (!pair)
            Py_CLEAR(list);
        else
            PyList_SET_ITEM(list, i, pair);
    }
    return list;
}

/* _stat(device, key) -> memory_stats()[key], without building the others. */
static PyObject *m_stat(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    int32_t dev;
    if (!check_nargs("_stat", nargs, 2) || as_i32(args[0], "memory_stats", "device", &dev) < 0)
        return NULL;
    if (!PyUnicode_Check(args[1])) {
        PyErr_Format(PyExc_TypeError, "_stat(): argument 'key' must be str, not %.80s", Py_TYPE(args[1])->tp_name);
        return NULL;
    }
    Py_ssize_t len;
    const char *name = PyUnicode_AsUTF8AndSize(args[1], &len);
    if (!name)
        return NULL;
    const flat_stat *f = bsearch(name, flat_stats, FLAT_STAT_COUNT, sizeof flat_stats[0], flat_stat_name_cmp);
    if (!f || strlen(f->name) != (size_t)len) { /* the length: a name with a NUL inside is no key */
        PyErr_SetObject(PyExc_KeyError, args[1]);
        return NULL;
    }
    npualloc_stats s;
    if (read_stats(dev, &s) < 0)
        return NULL;
    return PyLong_FromLongLong(stat_value(&s, f->offset));
}

static PyObject *m_reset_peak(PyObject *self, PyObject *arg)
{
    (void)self;
    int32_t dev;
    if (as_i32(arg, "reset_peak_memory_stats", "device", &dev) < 0)
        return NULL;
    aclError rc;
    LOCKING_CALL(rc = npualloc_cache_reset_peak(dev));
    if (rc != ACL_SUCCESS)
        return raise_cache_error(rc);
    Py_RETURN_NONE;
}

static PyObject *m_reset_accumulated(PyObject *self, PyObject *arg)
{
    (void)self;
    int32_t dev;
    if (as_i32(arg, "reset_accumulated_memory_stats", "device", &dev) < 0)
        return NULL;
    aclError rc;
    LOCKING_CALL(rc = npualloc_cache_reset_accumulated(dev));
    if (rc != ACL_SUCCESS)
        return raise_cache_error(rc);
    Py_RETURN_NONE;
}

/* _set_fraction(device, fraction) */
static PyObject *m_set_fraction(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (!check_nargs("_set_fraction", nargs, 2))
        return NULL;
    int32_t dev;
    if (as_i32(args[0], "_set_fraction", "device", &dev) < 0)
        return NULL;
    double f = PyFloat_AsDouble(args[1]);
    if (f == -1.0 && PyErr_Occurred())
        return NULL;
    aclError rc;
    LOCKING_CALL(rc = npualloc_cache_set_fraction(dev, f));
    if (rc != ACL_SUCCESS)
        return raise_cache_error(rc);
    Py_RETURN_NONE;
}

static PyObject *m_get_fraction(PyObject *self, PyObject *arg)
{
    (void)self;
    int32_t dev;
    if (as_i32(arg, "get_per_process_memory_fraction", "device", &dev) < 0)
        return NULL;
    double f = 1.0;
    aclError rc;
    LOCKING_CALL(rc = npualloc_cache_get_fraction(dev, &f));
    if (rc != ACL_SUCCESS)
        return raise_cache_error(rc);
    return PyFloat_FromDouble(f);
}

/* _record_stream(ptr, stream) with a Stream or an int. */
static PyObject *m_record_stream(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (!check_nargs("record_stream", nargs, 2))
        return NULL;
    uint64_t p, h;
    int32_t dev;
    if (as_u64(args[0], "record_stream", "ptr", &p) < 0 || resolve_stream_use(args[1], &h, &dev) < 0)
        return NULL;
    aclError rc;
    LOCKING_CALL(rc = record_stream_on((void *)(uintptr_t)p, dev, h));
    if (rc != ACL_SUCCESS)
        return raise_cache_error(rc);
    Py_RETURN_NONE;
}

/* _erase_stream(ptr, stream): torch_npu erases only when the block's own stream is the current
 * stream of its device; otherwise it silently does nothing. */
static PyObject *m_erase_stream(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (!check_nargs("erase_stream", nargs, 2))
        return NULL;
    uint64_t p, h;
    int32_t stream_dev;
    if (as_u64(args[0], "erase_stream", "ptr", &p) < 0 || resolve_stream_use(args[1], &h, &stream_dev) < 0)
        return NULL;
    int32_t dev;
    uint64_t own;
    aclError rc;
    LOCKING_CALL(rc = npualloc_cache_block_info((void *)(uintptr_t)p, &dev, &own, NULL));
    if (rc != ACL_SUCCESS)
        return raise_cache_error(rc);
    if (own != current_stream_of(dev))
        Py_RETURN_NONE;
    LOCKING_CALL(rc = stream_dev < 0 ? npualloc_cache_erase_stream((void *)(uintptr_t)p, h)
                                     : npualloc_cache_erase_stream_on((void *)(uintptr_t)p, stream_dev, h));
    if (rc != ACL_SUCCESS)
        return raise_cache_error(rc);
    Py_RETURN_NONE;
}

static const char *const block_states[] = {"inactive", "active_allocated", "active_pending_free"};
static const char *const trace_actions[] = {"alloc",       "free_requested", "free_completed",
                                            "segment_alloc", "segment_free", "segment_map",
                                            "segment_unmap", "snapshot",     "oom"};

static PyObject *block_dict(frame_decoder *d, const npualloc_block_info *b)
{
    unsigned st = (unsigned)b->state < 3 ? (unsigned)b->state : 0;
    PyObject *frames = decode_frames(d, b->frames);
    if (!frames)
        return NULL;
    return Py_BuildValue("{s:K,s:K,s:K,s:s,s:N}", "address", (unsigned long long)b->address, "size",
                         (unsigned long long)b->size, "requested_size", (unsigned long long)b->requested_size,
                         "state", block_states[st], "frames", frames);
}

static PyObject *segment_dict(frame_decoder *d, const npualloc_snapshot *s, const npualloc_segment_info *g)
{
    PyObject *frames = decode_frames(d, g->frames);
    PyObject *blocks = frames ? PyList_New((Py_ssize_t)g->block_count) : NULL;
    if (!blocks) {
        Py_XDECREF(frames);
        return NULL;
    }
    for (size_t i = 0; i < g->block_count; i++) {
        PyObject *b = block_dict(d, &s->blocks[g->first_block + i]);
        if (!b) {
            Py_DECREF(frames);
            Py_DECREF(blocks);
            return NULL;
        }
        PyList_SET_ITEM(blocks, (Py_ssize_t)i, b);
    }
    return Py_BuildValue("{s:i,s:K,s:K,s:K,s:K,s:K,s:K,s:(KK),s:s,s:O,s:N,s:N}", "device", (int)g->device,
                         "address", (unsigned long long)g->address, "total_size", (unsigned long long)g->total_size,
                         "allocated_size", (unsigned long long)g->allocated_size, "active_size",
                         (unsigned long long)g->active_size, "requested_size", (unsigned long long)g->requested_size,
                         "stream", (unsigned long long)g->stream, "segment_pool_id",
                         (unsigned long long)g->pool_id[0], (unsigned long long)g->pool_id[1], "segment_type",
                         g->is_small ? "small" : "large", "is_expandable", g->is_expandable ? Py_True : Py_False,
                         "frames", frames, "blocks", blocks);
}

/* A trace entry; "frames" only when a context was kept (torch's TraceEntry). */
static PyObject *trace_dict(frame_decoder *d, const npualloc_trace_info *t)
{
    unsigned a = (unsigned)t->action;
    const char *action = a < sizeof trace_actions / sizeof *trace_actions ? trace_actions[a] : "unknown";
    size_t md_len;
    const char *md = npualloc_context_data(t->user_metadata, &md_len);
    /* compile_context: torch's "N/A" outside a compiled region, which is everywhere here */
    PyObject *e = Py_BuildValue("{s:s,s:K,s:K,s:K,s:L,s:s,s:s#}", "action", action,
                                t->action == NPUALLOC_TRACE_OOM ? "device_free" : "addr", (unsigned long long)t->addr,
                                "size", (unsigned long long)t->size, "stream", (unsigned long long)t->stream,
                                "time_us", (long long)t->time_us, "compile_context", "N/A", "user_metadata",
                                md ? md : "", (Py_ssize_t)md_len);
    if (e && t->frames) {
        PyObject *frames = decode_frames(d, t->frames);
        if (!frames || PyDict_SetItemString(e, "frames", frames) < 0)
            Py_CLEAR(e);
        Py_XDECREF(frames);
    }
    return e;
}

PyObject *allocator_settings_dict(const npualloc_allocator_settings *s, const char *text)
{
    PyObject *divs = PyDict_New();
    if (!divs)
        return NULL;
    for (int i = 0; i < 16; i++) {
        char key[16];
        snprintf(key, sizeof key, "%d", 1 << i);
        if (put_i64(divs, key, (int64_t)s->roundup_power2_divisions[i]) < 0) {
            Py_DECREF(divs);
            return NULL;
        }
    }
    return Py_BuildValue(
        "{s:s,s:L,s:L,s:d,s:O,s:L,s:L,s:O,s:O,s:O,s:O,s:N}", "PYTORCH_NPU_ALLOC_CONF", text ? text : "",
        "max_split_size", s->max_split_size == SIZE_MAX ? -1LL : (long long)s->max_split_size,
        "max_non_split_rounding_size", (long long)s->max_non_split_rounding_size, "garbage_collection_threshold",
        s->garbage_collection_threshold, "expandable_segments", s->expandable_segments ? Py_True : Py_False,
        "large_segment_size", (long long)s->large_segment_size, "base_addr_aligned_size",
        (long long)s->base_addr_aligned_size, "page_size_1g", s->page_size_1g ? Py_True : Py_False,
        "release_lock_on_npumalloc", s->release_lock_on_npumalloc ? Py_True : Py_False, "throw_on_npumalloc_oom",
        s->throw_on_npumalloc_oom ? Py_True : Py_False, "multi_stream_lazy_reclaim",
        s->multi_stream_lazy_reclaim ? Py_True : Py_False, "roundup_power2_divisions", divs);
}

/* The settings text in effect, whole: another thread may change it between a sizing and a copy. */
static PyObject *settings_text_str(void)
{
    char small[256];
    size_t n = npualloc_cache_settings_text(small, sizeof small);
    if (n < sizeof small)
        return PyUnicode_FromStringAndSize(small, (Py_ssize_t)n);
    for (;;) {
        char *buf = PyMem_Malloc(n + 1);
        if (!buf)
            return PyErr_NoMemory();
        size_t got = npualloc_cache_settings_text(buf, n + 1);
        PyObject *text = got <= n ? PyUnicode_FromStringAndSize(buf, (Py_ssize_t)got) : NULL;
        PyMem_Free(buf);
        if (got <= n)
            return text;
        n = got;
    }
}

/* The settings in effect, read under a device lock (settings change with every device lock held). */
static PyObject *settings_dict(void)
{
    npualloc_allocator_settings s;
    aclError rc;
    LOCKING_CALL(rc = npualloc_cache_get_settings(&s));
    if (rc != ACL_SUCCESS)
        return raise_cache_error(rc);
    PyObject *text = settings_text_str();
    if (!text)
        return NULL;
    const char *utf8 = PyUnicode_AsUTF8(text);
    PyObject *dict = utf8 ? allocator_settings_dict(&s, utf8) : NULL;
    Py_DECREF(text);
    return dict;
}

/* _snapshot() -> {"segments", "device_traces", "allocator_settings", "external_annotations"}. */
static PyObject *m_snapshot(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    uint32_t count = 0;
    aclError rc = aclrtGetDeviceCount(&count);
    if (rc != ACL_SUCCESS)
        return raise_acl("aclrtGetDeviceCount", rc);
    PyObject *settings = settings_dict(); /* a malformed PYTORCH_NPU_ALLOC_CONF raises here, as torch_npu */
    if (!settings)
        return NULL;
    npualloc_snapshot *snap = NULL;
    LOCKING_CALL(rc = npualloc_cache_snapshot(&snap));
    if (rc != ACL_SUCCESS) {
        Py_DECREF(settings);
        return raise_cache_error(rc);
    }
    frame_decoder dec;
    int dec_rc = decoder_init(&dec);
    PyObject *segments = PyList_New((Py_ssize_t)snap->segment_count);
    PyObject *traces = PyList_New((Py_ssize_t)count);
    PyObject *result = NULL;
    if (dec_rc < 0 || !segments || !traces)
        goto done;
    for (uint32_t d = 0; d < count; d++) {
        PyObject *l = PyList_New(0);
        if (!l)
            goto done;
        PyList_SET_ITEM(traces, d, l);
    }
    for (size_t i = 0; i < snap->segment_count; i++) {
        PyObject *g = segment_dict(&dec, snap, &snap->segments[i]);
        if (!g)
            goto done;
        PyList_SET_ITEM(segments, (Py_ssize_t)i, g);
    }
    for (size_t i = 0; i < snap->trace_count; i++) {
        const npualloc_trace_info *t = &snap->traces[i];
        if (t->device < 0 || (uint32_t)t->device >= count)
            continue;
        PyObject *e = trace_dict(&dec, t);
        if (!e || PyList_Append(PyList_GET_ITEM(traces, t->device), e) < 0) {
            Py_XDECREF(e);
            goto done;
        }
        Py_DECREF(e);
    }
    /* torch >= 2.6 lists its record_function annotations here; npualloc records none, but readers of
     * the snapshot (the memory_viz page) expect the key. */
    result = Py_BuildValue("{s:O,s:O,s:O,s:[]}", "segments", segments, "device_traces", traces,
                           "allocator_settings", settings, "external_annotations");
done:
    decoder_free(&dec);
    Py_XDECREF(segments);
    Py_XDECREF(traces);
    Py_DECREF(settings);
    npualloc_snapshot_free(snap);
    return result;
}

/* _record_history(enabled, when, max_entries, clear_history, skip_actions): when is a
 * npualloc_record_context (0..3), skip_actions NPUALLOC_TRACE_SKIP bits. */
static PyObject *m_record_history(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (!check_nargs("_record_history", nargs, 5))
        return NULL;
    int enabled = PyObject_IsTrue(args[0]);
    if (enabled < 0)
        return NULL;
    int clear = PyObject_IsTrue(args[3]);
    if (clear < 0)
        return NULL;
    int32_t when;
    uint64_t n, skip;
    if (as_i32(args[1], "_record_history", "when", &when) < 0 ||
        as_u64(args[2], "_record_history", "max_entries", &n) < 0 ||
        as_u64(args[4], "_record_history", "skip_actions", &skip) < 0)
        return NULL;
    if (skip > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "_record_history(): invalid skip_actions mask");
        return NULL;
    }
    if (when < NPUALLOC_RECORD_NEVER || when > NPUALLOC_RECORD_ALL) {
        PyErr_Format(PyExc_ValueError, "_record_history(): invalid context level %d", (int)when);
        return NULL;
    }
    const npualloc_history_options opts = {.clear_history = clear != 0, .skip_actions = (uint32_t)skip};
    aclError rc;
    LOCKING_CALL(rc = npualloc_cache_record_history_opts(enabled, (npualloc_record_context)when, (size_t)n, &opts));
    /* Stacks cached for sharing start afresh (entries the history keeps hold their own references). */
    ctx_cache_clear();
    /* The level in effect, read back with the GIL held: another thread's call may have ended after this
     * one (the GIL was released around both), and the last thread to read sets the level the last call
     * left.  A failed call left the level as it was. */
    hist_level = (int)npualloc_cache_record_context();
    hist_gen = gen_now();
    if (rc != ACL_SUCCESS)
        return raise_cache_error(rc);
    Py_RETURN_NONE;
}

/* _set_user_metadata(device, text): torch's setUserMetadata for one device. */
static PyObject *m_set_user_metadata(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (!check_nargs("_set_user_metadata", nargs, 2))
        return NULL;
    int32_t dev;
    if (as_i32(args[0], "_set_user_metadata", "device", &dev) < 0)
        return NULL;
    if (!PyUnicode_Check(args[1])) {
        PyErr_Format(PyExc_TypeError, "_set_memory_metadata(): argument 'metadata' must be str, not %.80s",
                     Py_TYPE(args[1])->tp_name);
        return NULL;
    }
    Py_ssize_t len;
    const char *text = PyUnicode_AsUTF8AndSize(args[1], &len);
    if (!text)
        return NULL;
    aclError rc;
    LOCKING_CALL(rc = npualloc_cache_set_user_metadata(dev, text, (size_t)len));
    if (rc != ACL_SUCCESS)
        return raise_cache_error(rc);
    Py_RETURN_NONE;
}

static PyObject *m_get_user_metadata(PyObject *self, PyObject *arg)
{
    (void)self;
    int32_t dev;
    if (as_i32(arg, "_get_user_metadata", "device", &dev) < 0)
        return NULL;
    npualloc_context *md;
    aclError rc;
    LOCKING_CALL(rc = npualloc_cache_get_user_metadata(dev, &md));
    if (rc != ACL_SUCCESS)
        return raise_cache_error(rc);
    size_t len;
    const char *text = npualloc_context_data(md, &len);
    PyObject *r = PyUnicode_FromStringAndSize(text ? text : "", (Py_ssize_t)len);
    npualloc_context_release(md);
    return r;
}

static PyObject *m_set_settings(PyObject *self, PyObject *arg)
{
    (void)self;
    if (!PyUnicode_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "_set_allocator_settings(): argument must be str, not %.80s",
                     Py_TYPE(arg)->tp_name);
        return NULL;
    }
    const char *text = PyUnicode_AsUTF8(arg);
    if (!text)
        return NULL;
    aclError rc;
    WAITING_CALL(rc = npualloc_cache_set_settings(text));
    if (rc != ACL_SUCCESS) {
        PyObject *et, *ev, *tb;
        raise_cache_error(rc);
        PyErr_Fetch(&et, &ev, &tb);
        (void)drain_warnings();
        PyErr_Clear();
        PyErr_Restore(et, ev, tb);
        return NULL;
    }
    if (drain_warnings() < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *m_settings_text(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return settings_text_str();
}

static PyObject *m_check(PyObject *self, PyObject *arg)
{
    (void)self;
    int32_t dev;
    if (as_i32(arg, "_check", "device", &dev) < 0)
        return NULL;
    char why[1024] = "";
    aclError rc;
    WAITING_CALL(rc = npualloc_cache_check(dev, why, sizeof why));
    if (rc == ACL_ERROR_INVALID_PARAM)
        return raise_cache_error(rc);
    if (rc != ACL_SUCCESS) {
        PyErr_SetString(PyExc_AssertionError, why[0] ? why : "npualloc_cache_check failed");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *m_attach_oom_observer(PyObject *self, PyObject *fn)
{
    (void)self;
    if (!PyCallable_Check(fn)) {
        PyErr_Format(PyExc_TypeError, "_attach_out_of_memory_observer() expects a callable, not %.80s",
                     Py_TYPE(fn)->tp_name);
        return NULL;
    }
    if (PyList_Append(oom_observers, fn) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* _clear_oom_observers(): forgets every attached observer (for tests). */
static PyObject *m_clear_oom_observers(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (PyList_SetSlice(oom_observers, 0, PY_SSIZE_T_MAX, NULL) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *m_set_stream_type(PyObject *self, PyObject *cls)
{
    (void)self;
    if (!PyType_Check(cls)) {
        PyErr_SetString(PyExc_TypeError, "_set_stream_type() expects a class");
        return NULL;
    }
    Py_INCREF(cls);
    Py_XSETREF(stream_type, cls);
    Py_RETURN_NONE;
}

static PyObject *m_caching_disabled(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyBool_FromLong(npualloc_caching_disabled());
}

static PyObject *m_generation(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyLong_FromUnsignedLongLong(gen_now());
}

/* ---- devices ---- */

static PyObject *m_current_device(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    int32_t dev;
    if (lazy_current_device(&dev) < 0)
        return NULL;
    return PyLong_FromLong(dev);
}

/* _change_current_allocator(alloc_fn_address, free_fn_address) */
static PyObject *m_change_current_allocator(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (!check_nargs("_change_current_allocator", nargs, 2))
        return NULL;
    uint64_t alloc_addr, free_addr;
    if (as_u64(args[0], "_change_current_allocator", "alloc_fn", &alloc_addr) < 0 ||
        as_u64(args[1], "_change_current_allocator", "free_fn", &free_addr) < 0)
        return NULL;
    /* Addresses from dlsym (ctypes): POSIX guarantees they convert back to function pointers. */
    aclError rc = npualloc_allocator_change((npualloc_alloc_fn)(uintptr_t)alloc_addr,
                                            (npualloc_free_fn)(uintptr_t)free_addr);
    if (rc != ACL_SUCCESS)
        return raise_pluggable_error(rc);
    Py_RETURN_NONE;
}

static PyObject *m_allocator_is_pluggable(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyBool_FromLong(npualloc_allocator_is_pluggable());
}

/* _local_device() -> the thread's device, or -1 (never starts the runtime or a device). */
static PyObject *m_local_device(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    int32_t dev = -1;
    if (!npualloc_initialized() || aclrtGetDevice(&dev) != ACL_SUCCESS)
        dev = -1;
    return PyLong_FromLong(dev);
}

static PyObject *m_set_device(PyObject *self, PyObject *arg)
{
    (void)self;
    int32_t dev, cur;
    if (as_i32(arg, "set_device", "device", &dev) < 0)
        return NULL;
    if (aclrtGetDevice(&cur) == ACL_SUCCESS && cur == dev)
        Py_RETURN_NONE; /* torch_npu's SetDevice skips the current device */
    aclError rc = aclrtSetDevice(dev);
    if (rc != ACL_SUCCESS)
        return raise_acl("c10_npu::SetDevice(device_id_)", rc);
    Py_RETURN_NONE;
}

static PyObject *m_device_count(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    uint32_t n = 0;
    aclError rc = aclrtGetDeviceCount(&n);
    if (rc != ACL_SUCCESS)
        return raise_acl("aclrtGetDeviceCount", rc);
    return PyLong_FromUnsignedLong(n);
}

static PyObject *m_mem_get_info(PyObject *self, PyObject *arg)
{
    (void)self;
    int32_t dev, prev;
    if (as_i32(arg, "mem_get_info", "device", &dev) < 0 || enter_device(dev, &prev) < 0)
        return NULL;
    size_t free_b = 0, total = 0;
    aclError rc = aclrtGetMemInfo(ACL_HBM_MEM, &free_b, &total);
    restore_device(dev, prev);
    if (rc != ACL_SUCCESS)
        return raise_acl("aclrtGetMemInfo", rc);
    return Py_BuildValue("(KK)", (unsigned long long)free_b, (unsigned long long)total);
}

static PyObject *m_synchronize(PyObject *self, PyObject *arg)
{
    (void)self;
    int32_t dev, prev;
    if (as_i32(arg, "synchronize", "device", &dev) < 0 || enter_device(dev, &prev) < 0)
        return NULL;
    aclError rc;
    WAITING_CALL(rc = aclrtSynchronizeDevice());
    restore_device(dev, prev);
    if (rc != ACL_SUCCESS)
        return raise_acl("aclrtSynchronizeDevice", rc);
    Py_RETURN_NONE;
}

/* ---- current streams ---- */

static PyObject *m_get_current_stream(PyObject *self, PyObject *arg)
{
    (void)self;
    int32_t dev;
    if (as_i32(arg, "current_stream", "device", &dev) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(current_stream_of(dev));
}

/* _set_current_stream(device, handle) */
static PyObject *m_set_current_stream(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (!check_nargs("_set_current_stream", nargs, 2))
        return NULL;
    int32_t dev;
    uint64_t h;
    if (as_i32(args[0], "_set_current_stream", "device", &dev) < 0 ||
        as_u64(args[1], "_set_current_stream", "stream", &h) < 0)
        return NULL;
    if (dev < 0 || dev >= MAX_DEVICES) {
        PyErr_Format(PyExc_ValueError, "_set_current_stream(): invalid device %d", (int)dev);
        return NULL;
    }
    tl_refresh();
    tl_streams[dev] = h;
    Py_RETURN_NONE;
}

/* ---- streams and events ---- */

/* _stream_create(device) -> handle (a new stream of that device). */
static PyObject *m_stream_create(PyObject *self, PyObject *arg)
{
    (void)self;
    int32_t dev, prev;
    if (as_i32(arg, "Stream", "device", &dev) < 0 || enter_device(dev, &prev) < 0)
        return NULL;
    aclrtStream s = NULL;
    aclError rc = aclrtCreateStream(&s);
    restore_device(dev, prev);
    if (rc != ACL_SUCCESS)
        return raise_acl("aclrtCreateStream", rc);
    return PyLong_FromUnsignedLongLong((uintptr_t)s);
}

/* _stream_destroy(handle, generation): nothing if the runtime restarted since. */
static PyObject *m_stream_destroy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (!check_nargs("_stream_destroy", nargs, 2))
        return NULL;
    uint64_t h, g;
    if (as_u64(args[0], "_stream_destroy", "stream", &h) < 0 || as_u64(args[1], "_stream_destroy", "gen", &g) < 0)
        return NULL;
    if (h == 0 || g != gen_now())
        Py_RETURN_NONE;
    aclError rc;
    WAITING_CALL(rc = aclrtDestroyStream((aclrtStream)(uintptr_t)h)); /* waits for the stream's queued work */
    return PyLong_FromLong(rc);
}

/* _in_stream_task() -> True on a thread that runs a stream's task or callback (Stream.__del__ must
 * not wait for streams there). */
static PyObject *m_in_stream_task(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyBool_FromLong(npualloc_in_stream_task());
}

/* Runs `op` on stream `h` of device `dev` (args[0], args[1]): a default stream (0) needs its
 * device current.  `fn` (the ACL function's name) names it in errors.  Returns 0, or -1 with an
 * exception set. */
typedef aclError (*stream_op)(aclrtStream s, void *ctx);

static int on_stream(PyObject *const *args, Py_ssize_t nargs, const char *fn, stream_op op, void *ctx, bool nogil)
{
    if (nargs < 2) {
        PyErr_Format(PyExc_TypeError, "%s() takes at least 2 arguments", fn);
        return -1;
    }
    uint64_t h;
    int32_t dev, prev = -1;
    if (as_u64(args[0], fn, "stream", &h) < 0 || as_i32(args[1], fn, "device", &dev) < 0)
        return -1;
    if (h == 0 && enter_device(dev, &prev) < 0)
        return -1;
    aclError rc;
    if (nogil) {
        WAITING_CALL(rc = op((aclrtStream)(uintptr_t)h, ctx));
    } else {
        rc = op((aclrtStream)(uintptr_t)h, ctx);
    }
    if (h == 0)
        restore_device(dev, prev);
    if (rc != ACL_SUCCESS) {
        raise_acl(fn, rc);
        return -1;
    }
    return 0;
}

static aclError op_sync(aclrtStream s, void *ctx)
{
    (void)ctx;
    return aclrtSynchronizeStream(s);
}

static PyObject *m_stream_synchronize(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (on_stream(args, nargs, "aclrtSynchronizeStream", op_sync, NULL, true) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* _stream_query(stream, device) -> True once everything queued on the stream has run
 * (aclrtStreamQuery; the runtime's own bookkeeping, so an idle stream is complete at once). */
static PyObject *m_stream_query(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (!check_nargs("_stream_query", nargs, 2))
        return NULL;
    uint64_t h;
    int32_t dev;
    if (as_u64(args[0], "_stream_query", "stream", &h) < 0 || as_i32(args[1], "_stream_query", "device", &dev) < 0)
        return NULL;
    bool done = false;
    aclError rc = npualloc_stream_query((aclrtStream)(uintptr_t)h, dev, &done);
    if (rc != ACL_SUCCESS)
        return raise_acl("aclrtStreamQuery", rc);
    return PyBool_FromLong(done);
}

/* name(stream, device, event): op with the event on the stream. */
static PyObject *event_on_stream(PyObject *const *args, Py_ssize_t nargs, const char *name, const char *acl_name,
                                 stream_op op)
{
    if (!check_nargs(name, nargs, 3))
        return NULL;
    uint64_t e;
    if (as_u64(args[2], name, "event", &e) < 0)
        return NULL;
    if (on_stream(args, nargs, acl_name, op, (void *)(uintptr_t)e, false) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static aclError op_wait_event(aclrtStream s, void *ctx) { return aclrtStreamWaitEvent(s, ctx); }

static PyObject *m_stream_wait_event(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    return event_on_stream(args, nargs, "_stream_wait_event", "aclrtStreamWaitEvent", op_wait_event);
}

static aclError op_record(aclrtStream s, void *ctx) { return aclrtRecordEvent(ctx, s); }

static PyObject *m_event_record(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    return event_on_stream(args, nargs, "_event_record", "aclrtRecordEvent", op_record);
}

static PyObject *m_event_create(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    aclrtEvent e = NULL;
    aclError rc = aclrtCreateEvent(&e);
    if (rc != ACL_SUCCESS)
        return raise_acl("aclrtCreateEvent", rc);
    return PyLong_FromUnsignedLongLong((uintptr_t)e);
}

static PyObject *m_event_destroy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (!check_nargs("_event_destroy", nargs, 2))
        return NULL;
    uint64_t e, g;
    if (as_u64(args[0], "_event_destroy", "event", &e) < 0 || as_u64(args[1], "_event_destroy", "gen", &g) < 0)
        return NULL;
    if (e == 0 || g != gen_now())
        Py_RETURN_NONE;
    return PyLong_FromLong(aclrtDestroyEvent((aclrtEvent)(uintptr_t)e));
}

static PyObject *m_event_query(PyObject *self, PyObject *arg)
{
    (void)self;
    uint64_t e;
    if (as_u64(arg, "_event_query", "event", &e) < 0)
        return NULL;
    aclrtEventStatus st;
    aclError rc = aclrtQueryEvent((aclrtEvent)(uintptr_t)e, &st);
    if (rc != ACL_SUCCESS)
        return raise_acl("aclrtQueryEvent", rc);
    return PyBool_FromLong(st == ACL_EVENT_STATUS_COMPLETE);
}

static PyObject *m_event_synchronize(PyObject *self, PyObject *arg)
{
    (void)self;
    uint64_t e;
    if (as_u64(arg, "_event_synchronize", "event", &e) < 0)
        return NULL;
    aclError rc;
    WAITING_CALL(rc = aclrtSynchronizeEvent((aclrtEvent)(uintptr_t)e));
    if (rc != ACL_SUCCESS)
        return raise_acl("aclrtSynchronizeEvent", rc);
    Py_RETURN_NONE;
}

static PyObject *m_event_elapsed(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (!check_nargs("_event_elapsed", nargs, 2))
        return NULL;
    uint64_t a, b;
    if (as_u64(args[0], "_event_elapsed", "start", &a) < 0 || as_u64(args[1], "_event_elapsed", "end", &b) < 0)
        return NULL;
    float ms = 0.0f;
    aclError rc = aclrtEventElapsedTime(&ms, (aclrtEvent)(uintptr_t)a, (aclrtEvent)(uintptr_t)b);
    if (rc != ACL_SUCCESS)
        return raise_acl("aclrtEventElapsedTime", rc);
    return PyFloat_FromDouble(ms);
}

/* ---- the module ---- */

#define FAST(fn) (PyCFunction)(void (*)(void))(fn)

static PyMethodDef memory_methods[] = {
    /* "name(signature)\n--\n\n" first lines give inspect.signature() and help() the parameters */
    {"caching_allocator_alloc", FAST(m_caching_allocator_alloc), METH_FASTCALL | METH_KEYWORDS,
     "caching_allocator_alloc($module, /, size, device=None, stream=None)\n--\n\n"
     "Allocates size bytes with the caching allocator and returns the device pointer (an int), as\n"
     "torch_npu.npu.caching_allocator_alloc does.  device: an int, \"npu:N\" or a device object (None: the\n"
     "current device); stream: a Stream or stream handle (None: the device's current stream).  Raises\n"
     "OutOfMemoryError when the device cannot hold it.  Free with caching_allocator_delete."},
    {"caching_allocator_delete", FAST(m_caching_allocator_delete), METH_FASTCALL | METH_KEYWORDS,
     "caching_allocator_delete($module, /, mem_ptr)\n--\n\n"
     "Frees a pointer from caching_allocator_alloc back to the cache (0 does nothing); RuntimeError for a\n"
     "pointer the allocator did not hand out."},
    {"empty", FAST(m_empty), METH_FASTCALL | METH_KEYWORDS,
     "empty($module, /, nbytes, device=None, stream=None)\n--\n\n"
     "A Buffer of nbytes of device memory from the caching allocator (device and stream as for\n"
     "caching_allocator_alloc), given back by its free(), at the end of a with block, or when it is\n"
     "collected."},
    {"_empty_cache", m_empty_cache, METH_NOARGS, NULL},
    {"_empty_virt_addr_cache", m_empty_virt_addr_cache, METH_NOARGS, NULL},
    {"_stats", m_stats, METH_O, "_stats(device) -> nested dict"},
    {"_flat_stats", m_flat_stats, METH_O, "_flat_stats(device) -> [(key, value), ...] sorted by key"},
    {"_stat", FAST(m_stat), METH_FASTCALL, "_stat(device, key) -> one value of memory_stats()"},
    {"_reset_peak", m_reset_peak, METH_O, NULL},
    {"_reset_accumulated", m_reset_accumulated, METH_O, NULL},
    {"_set_fraction", FAST(m_set_fraction), METH_FASTCALL, NULL},
    {"_get_fraction", m_get_fraction, METH_O, NULL},
    {"_record_stream", FAST(m_record_stream), METH_FASTCALL, NULL},
    {"_erase_stream", FAST(m_erase_stream), METH_FASTCALL, NULL},
    {"_snapshot", m_snapshot, METH_NOARGS, NULL},
    {"_record_history", FAST(m_record_history), METH_FASTCALL, NULL},
    {"_set_user_metadata", FAST(m_set_user_metadata), METH_FASTCALL, NULL},
    {"_get_user_metadata", m_get_user_metadata, METH_O, NULL},
    {"_set_settings", m_set_settings, METH_O, NULL},
    {"_settings_text", m_settings_text, METH_NOARGS, NULL},
    {"_check", m_check, METH_O, "_check(device): None, or AssertionError with the first violated invariant"},
    {"_attach_oom_observer", m_attach_oom_observer, METH_O, NULL},
    {"_clear_oom_observers", m_clear_oom_observers, METH_NOARGS, NULL},
    {"_set_stream_type", m_set_stream_type, METH_O, NULL},
    {"_caching_disabled", m_caching_disabled, METH_NOARGS, NULL},
    {"_generation", m_generation, METH_NOARGS, NULL},
    {"_current_device", m_current_device, METH_NOARGS, NULL},
    {"_local_device", m_local_device, METH_NOARGS, NULL},
    {"_change_current_allocator", FAST(m_change_current_allocator), METH_FASTCALL, NULL},
    {"_allocator_is_pluggable", m_allocator_is_pluggable, METH_NOARGS, NULL},
    {"_set_device", m_set_device, METH_O, NULL},
    {"_device_count", m_device_count, METH_NOARGS, NULL},
    {"_mem_get_info", m_mem_get_info, METH_O, NULL},
    {"_synchronize", m_synchronize, METH_O, NULL},
    {"_get_current_stream", m_get_current_stream, METH_O, NULL},
    {"_set_current_stream", FAST(m_set_current_stream), METH_FASTCALL, NULL},
    {"_stream_create", m_stream_create, METH_O, NULL},
    {"_stream_destroy", FAST(m_stream_destroy), METH_FASTCALL, NULL},
    {"_in_stream_task", m_in_stream_task, METH_NOARGS, NULL},
    {"_stream_synchronize", FAST(m_stream_synchronize), METH_FASTCALL, NULL},
    {"_stream_query", FAST(m_stream_query), METH_FASTCALL, NULL},
    {"_stream_wait_event", FAST(m_stream_wait_event), METH_FASTCALL, NULL},
    {"_event_create", m_event_create, METH_NOARGS, NULL},
    {"_event_destroy", FAST(m_event_destroy), METH_FASTCALL, NULL},
    {"_event_record", FAST(m_event_record), METH_FASTCALL, NULL},
    {"_event_query", m_event_query, METH_O, NULL},
    {"_event_synchronize", m_event_synchronize, METH_O, NULL},
    {"_event_elapsed", FAST(m_event_elapsed), METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef memory_def = {
    PyModuleDef_HEAD_INIT, "npualloc._C.memory", "The torch_npu-like memory face of npualloc.", -1, memory_methods,
    NULL, NULL, NULL, NULL,
};

int memory_py_attach(PyObject *module)
{
    if (PyType_Ready(&Buffer_Type) < 0)
        return -1;
    PyObject *m = PyModule_Create(&memory_def);
    if (!m)
        return -1;
    if (!OutOfMemoryError) {
        OutOfMemoryError = PyErr_NewExceptionWithDoc(
            "npualloc.OutOfMemoryError", "The device (or the memory fraction) has no room for an allocation.",
            PyExc_RuntimeError, NULL);
        if (!OutOfMemoryError)
            goto fail;
    }
    if (!oom_observers && !(oom_observers = PyList_New(0)))
        goto fail;
    if (!flat_stats[FLAT_STAT_COUNT - 1].key && build_flat_stats() < 0) /* every key, or build again */
        goto fail;
    if (!str_npu_stream && !(str_npu_stream = PyUnicode_InternFromString("npu_stream")))
        goto fail;
    Py_INCREF(OutOfMemoryError);
    if (PyModule_AddObject(m, "OutOfMemoryError", OutOfMemoryError) < 0) {
        Py_DECREF(OutOfMemoryError);
        goto fail;
    }
    Py_INCREF(&Buffer_Type);
    if (PyModule_AddObject(m, "Buffer", (PyObject *)&Buffer_Type) < 0) {
        Py_DECREF(&Buffer_Type);
        goto fail;
    }
    if (PyModule_AddObject(module, "memory", m) < 0)
        goto fail;
    return 0;
fail:
    Py_DECREF(m);
    return -1;
}
