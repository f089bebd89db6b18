/*
 * graph_py.c - `npualloc._C.graph`: the C half of npualloc/graph.py (captured graphs with planned
 * memory, npualloc_graph.h) and npualloc/mempool.py (torch's private pools over the
 * npualloc_cache_pool_* API).
 *
 *   mempool_id_new(user_created) -> (first, second)
 *   pool_create / pool_release / pool_begin_thread / pool_end / pool_empty / pool_set_no_split /
 *       pool_mark_use_on_oom / pool_clear_use_on_oom (device, first, second)
 *   pool_use_count(device, first, second) -> int
 *   capture_status(stream, device) -> bool
 *   set_mem_access(device, mask), get_mem_access(device) -> mask
 *   Graph(checked=False): capture_begin(stream, device, access_mask|None, pool|None, mode), capture_end(),
 *       instantiate() -> GraphExec, plan(), nodes(), allocations(), streams(), violations()
 *   GraphExec: launch(stream, device), destroy(), graph
 *   GraphMemoryError (a RuntimeError): instantiating a checked graph whose capture recorded a
 *       violation.
 *
 * Calls that may wait (captures, pools: allocator locks; launches and destruction: streams)
 * release the GIL: a stream task may be a Python callback that needs it.  Objects of a runtime
 * that was shut down (npualloc._C.shutdown) are never touched again: their calls fail.
 *
 * graph_py_attach(module) is called once from PyInit__C (module.c).
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "binding.h"
#include "memory_py.h"
#include "npualloc.h"
#include "npualloc_graph.h"
#include "pyarg.h"

static PyObject *GraphMemoryError;

/* The allocator's own message alone, as torch raises it (use_mem_pool and MemPool surface these
 * errors), with torch_npu's suffix where it has one; the call and the code only when the allocator
 * left no message. */
static PyObject *cache_error(aclError rc, const char *what)
{
    npualloc_error_kind kind;
    const char *msg = npualloc_last_error(&kind);
    if (kind != NPUALLOC_ERR_NONE && msg && msg[0])
        return raise_cache_error(rc);
    PyErr_Format(PyExc_RuntimeError, "%s failed (ACL error %d)", what, (int)rc);
    return NULL;
}

/* A graph call's failure; one the caching allocator refused (the graph's message ends with the
 * allocator's) is raised as the allocator's own, as torch raises beginAllocateToPool's. */
static PyObject *graph_error(aclError rc, const char *what)
{
    const char *msg = npualloc_graph_last_error();
    npualloc_error_kind kind;
    const char *cache_msg = npualloc_last_error(&kind);
    size_t len = msg ? strlen(msg) : 0, cache_len = cache_msg ? strlen(cache_msg) : 0;
    if (kind != NPUALLOC_ERR_NONE && cache_len && len >= cache_len && strcmp(msg + len - cache_len, cache_msg) == 0)
        return raise_cache_error(rc);
    PyErr_Format(PyExc_RuntimeError, "%s failed (ACL error %d): %s", what, (int)rc, msg && msg[0] ? msg : "?");
    return NULL;
}

/* ValueError for an argument the converters found out of range (their TypeError stands). */
static int out_of_range(const char *fn)
{
    if (!PyErr_Occurred())
        PyErr_Format(PyExc_ValueError, "%s(): an argument is out of range", fn);
    return -1;
}

/* A pool id's two halves, each in [0, 2**64): larger or negative ints are refused, not wrapped
 * onto another pool's id. */
static int parse_pool_id(PyObject *first, PyObject *second, const char *fn, npualloc_mempool_id *id)
{
    uint64_t a, b;
    if (arg_u64(first, fn, "first", &a) != ARG_OK || arg_u64(second, fn, "second", &b) != ARG_OK)
        return out_of_range(fn);
    *id = (npualloc_mempool_id){a, b};
    return 0;
}

static int parse_id(PyObject *const *args, const char *fn, int32_t *dev, npualloc_mempool_id *id)
{
    if (arg_i32(args[0], fn, "device", dev) != ARG_OK)
        return out_of_range(fn);
    return parse_pool_id(args[1], args[2], fn, id);
}

/* ---- private pools ---- */

static PyObject *g_mempool_id_new(PyObject *self, PyObject *arg)
{
    (void)self;
    int user = PyObject_IsTrue(arg);
    if (user < 0)
        return NULL;
    npualloc_mempool_id id = npualloc_mempool_id_new(user);
    return Py_BuildValue("(KK)", (unsigned long long)id.first, (unsigned long long)id.second);
}

typedef enum {
    POOL_CREATE,
    POOL_RELEASE,
    POOL_BEGIN_THREAD,
    POOL_END,
    POOL_EMPTY,
    POOL_NO_SPLIT,
    POOL_MARK_USE_ON_OOM,
    POOL_CLEAR_USE_ON_OOM
} pool_op;

static PyObject *pool_call(PyObject *const *args, Py_ssize_t nargs, const char *fn, pool_op op)
{
    if (!check_nargs(fn, nargs, 3))
        return NULL;
    int32_t dev;
    npualloc_mempool_id id;
    if (parse_id(args, fn, &dev, &id) < 0)
        return NULL;
    uint64_t tid = (uint64_t)pthread_self(); /* the caller's thread, taken before the GIL goes */
    aclError rc = ACL_SUCCESS;
    WAITING_CALL(switch (op) {
        case POOL_CREATE: rc = npualloc_cache_pool_create(dev, id); break;
        case POOL_RELEASE: rc = npualloc_cache_pool_release(dev, id); break;
        case POOL_BEGIN_THREAD: rc = npualloc_cache_pool_begin(dev, id, NPUALLOC_POOL_FILTER_THREAD, tid); break;
        case POOL_END: rc = npualloc_cache_pool_end(dev, id); break;
        case POOL_EMPTY: rc = npualloc_cache_pool_empty(dev, id); break;
        case POOL_NO_SPLIT: rc = npualloc_cache_pool_set_no_split(dev, id); break;
        case POOL_MARK_USE_ON_OOM: rc = npualloc_cache_pool_set_use_on_oom(dev, id, true); break;
        case POOL_CLEAR_USE_ON_OOM: rc = npualloc_cache_pool_set_use_on_oom(dev, id, false); break;
    });
    if (rc != ACL_SUCCESS)
        return cache_error(rc, fn);
    Py_RETURN_NONE;
}

#define POOL_FN(name, op)                                                                                          \
    static PyObject *g_##name(PyObject *self, PyObject *const *args, Py_ssize_t nargs)                           \
    {                                                                                                              \
        (void)self;                                                                                                \
        return pool_call(args, nargs, #name, op);                                                                  \
    }
POOL_FN(pool_create, POOL_CREATE)
POOL_FN(pool_release, POOL_RELEASE)
POOL_FN(pool_begin_thread, POOL_BEGIN_THREAD)
POOL_FN(pool_end, POOL_END)
POOL_FN(pool_empty, POOL_EMPTY)
POOL_FN(pool_set_no_split, POOL_NO_SPLIT)
POOL_FN(pool_mark_use_on_oom, POOL_MARK_USE_ON_OOM)
POOL_FN(pool_clear_use_on_oom, POOL_CLEAR_USE_ON_OOM)

/* pool_create_with_allocator(device, first, second, alloc_fn_address, free_fn_address) */
static PyObject *g_pool_create_with_allocator(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    const char *fn = "pool_create_with_allocator";
    if (!check_nargs(fn, nargs, 5))
        return NULL;
    int32_t dev;
    npualloc_mempool_id id;
    uint64_t alloc_addr, free_addr;
    if (parse_id(args, fn, &dev, &id) < 0)
        return NULL;
    if (arg_u64(args[3], fn, "alloc_fn", &alloc_addr) != ARG_OK || arg_u64(args[4], fn, "free_fn", &free_addr) != ARG_OK) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "%s(): an argument is out of range", fn);
        return NULL;
    }
    /* Addresses from dlsym (ctypes): POSIX guarantees they convert back to function pointers. */
    npualloc_alloc_fn alloc_fn = (npualloc_alloc_fn)(uintptr_t)alloc_addr;
    npualloc_free_fn free_fn = (npualloc_free_fn)(uintptr_t)free_addr;
    aclError rc;
    WAITING_CALL(rc = npualloc_cache_pool_create_with_allocator(dev, id, alloc_fn, free_fn));
    if (rc != ACL_SUCCESS)
        return cache_error(rc, fn);
    Py_RETURN_NONE;
}

static PyObject *g_pool_use_count(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (!check_nargs("pool_use_count", nargs, 3))
        return NULL;
    int32_t dev;
    npualloc_mempool_id id;
    if (parse_id(args, "pool_use_count", &dev, &id) < 0)
        return NULL;
    int n;
    WAITING_CALL(n = npualloc_cache_pool_use_count(dev, id));
    return PyLong_FromLong(n);
}

/* ---- streams, settings ---- */

static int stream_args(PyObject *const *args, const char *fn, void **stream, int32_t *dev)
{
    if (arg_ptr(args[0], fn, "stream", stream) != ARG_OK || arg_i32(args[1], fn, "device", dev) != ARG_OK) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "%s(): stream or device out of range", fn);
        return -1;
    }
    return 0;
}

static PyObject *g_capture_status(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (!check_nargs("capture_status", nargs, 2))
        return NULL;
    void *stream;
    int32_t dev;
    if (stream_args(args, "capture_status", &stream, &dev) < 0)
        return NULL;
    bool cap = false;
    aclError rc = npualloc_stream_capture_status(stream, dev, &cap, NULL);
    if (rc != ACL_SUCCESS) {
        PyErr_Format(PyExc_RuntimeError, "capture_status: not a live stream (ACL error %d)", (int)rc);
        return NULL;
    }
    return PyBool_FromLong(cap);
}

static PyObject *g_set_mem_access(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (!check_nargs("set_mem_access", nargs, 2))
        return NULL;
    int32_t dev;
    uint64_t mask;
    if (arg_i32(args[0], "set_mem_access", "device", &dev) != ARG_OK ||
        arg_u64(args[1], "set_mem_access", "mask", &mask) != ARG_OK) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "set_mem_access(): device or mask out of range");
        return NULL;
    }
    aclError rc = npualloc_graph_set_mem_access(dev, mask);
    if (rc != ACL_SUCCESS) {
        PyErr_Format(PyExc_ValueError, "set_graph_mem_access: %s", npualloc_graph_last_error());
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *g_get_mem_access(PyObject *self, PyObject *arg)
{
    (void)self;
    int32_t dev;
    if (arg_i32(arg, "get_mem_access", "device", &dev) != ARG_OK) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "get_mem_access(): device out of range");
        return NULL;
    }
    uint64_t mask;
    aclError rc = npualloc_graph_get_mem_access(dev, &mask);
    if (rc != ACL_SUCCESS) {
        PyErr_Format(PyExc_ValueError, "get_graph_mem_access: invalid device %d", (int)dev);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(mask);
}

/* ---- Graph ---- */

typedef struct {
    PyObject_HEAD npualloc_graph *g;
    uint64_t gen;
} GraphObject;

typedef struct {
    PyObject_HEAD npualloc_graph_exec *e;
    PyObject *graph; /* the GraphObject */
    uint64_t gen;
    /* Launches in flight on other threads (they run without the GIL): a destroy meanwhile leaves the
     * executable to the last of them (doomed), as it must not be freed under a launch being queued. */
    int launching;
    npualloc_graph_exec *doomed;
} ExecObject;

static PyTypeObject Graph_Type, Exec_Type;

static int Graph_init(GraphObject *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"checked", NULL};
    int checked = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|p:Graph", names, &checked))
        return -1;
    if (self->g)
        return 0;
    npualloc_graph *g;
    aclError rc = npualloc_graph_create(checked ? NPUALLOC_GRAPH_CHECKED : 0, &g);
    if (rc != ACL_SUCCESS) {
        graph_error(rc, "Graph()");
        return -1;
    }
    self->g = g;
    self->gen = npualloc_runtime_generation();
    return 0;
}

static void Graph_dealloc(GraphObject *self)
{
    npualloc_graph *g = self->g;
    self->g = NULL;
    if (g)
        WAITING_CALL(npualloc_graph_destroy(g)); /* host-node data may take the GIL to go */
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static npualloc_graph *graph_of(GraphObject *self)
{
    if (!self->g) {
        PyErr_SetString(PyExc_RuntimeError, "npualloc.Graph: not initialised");
        return NULL;
    }
    return self->g;
}

/* capture_begin(stream, device, access_mask or None, (first, second) or None, mode): mode is an
 * aclmdlRICaptureMode value (graph.py maps torch's capture_error_mode strings to it). */
static PyObject *Graph_capture_begin(GraphObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (!check_nargs("capture_begin", nargs, 5))
        return NULL;
    npualloc_graph *g = graph_of(self);
    if (!g)
        return NULL;
    void *stream;
    int32_t dev;
    if (stream_args(args, "capture_begin", &stream, &dev) < 0)
        return NULL;
    npualloc_capture_params p = {0};
    if (args[2] != Py_None) {
        if (arg_u64(args[2], "capture_begin", "access_mask", &p.access_mask) != ARG_OK) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "capture_begin(): access mask out of range");
            return NULL;
        }
        p.has_access = true;
    }
    if (args[3] != Py_None) {
        if (!PyTuple_Check(args[3])) {
            arg_type_error("capture_begin", "argument 'pool' must be a (first, second) tuple or None, not %.80s",
                           Py_TYPE(args[3])->tp_name);
            return NULL;
        }
        if (PyTuple_GET_SIZE(args[3]) != 2) {
            arg_type_error("capture_begin", "argument 'pool' must be a (first, second) tuple, not a tuple of %zd",
                           PyTuple_GET_SIZE(args[3]));
            return NULL;
        }
        if (parse_pool_id(PyTuple_GET_ITEM(args[3], 0), PyTuple_GET_ITEM(args[3], 1), "capture_begin", &p.pool) < 0)
            return NULL;
        p.use_pool = true;
    }
    uint64_t mode;
    if (arg_u64(args[4], "capture_begin", "mode", &mode) != ARG_OK) {
        (void)out_of_range("capture_begin");
        return NULL;
    }
    /* a value past the enum's stays one (one past RELAXED), which the core refuses as CANN does */
    p.mode = (aclmdlRICaptureMode)(mode <= ACL_MODEL_RI_CAPTURE_MODE_RELAXED ? mode
                                                                            : ACL_MODEL_RI_CAPTURE_MODE_RELAXED + 1);
    aclError rc;
    WAITING_CALL(rc = npualloc_graph_capture_begin(g, stream, dev, &p));
    if (rc != ACL_SUCCESS)
        return graph_error(rc, "capture_begin");
    Py_RETURN_NONE;
}

static PyObject *Graph_capture_end(GraphObject *self, PyObject *unused)
{
    (void)unused;
    npualloc_graph *g = graph_of(self);
    if (!g)
        return NULL;
    aclError rc;
    WAITING_CALL(rc = npualloc_graph_capture_end(g));
    if (rc != ACL_SUCCESS)
        return graph_error(rc, "capture_end");
    Py_RETURN_NONE;
}

static PyObject *violations_list(npualloc_graph *g)
{
    size_t n = npualloc_graph_violation_count(g);
    PyObject *list = PyList_New(0);
    char buf[512];
    for (size_t i = 0; list && i < n; i++) {
        if (!npualloc_graph_violation(g, i, buf, sizeof buf))
            break;
        PyObject *s = PyUnicode_DecodeUTF8(buf, (Py_ssize_t)strlen(buf), "replace");
        if (!s || PyList_Append(list, s) < 0) {
            Py_XDECREF(s);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(s);
    }
    return list;
}

static PyObject *Graph_violations(GraphObject *self, PyObject *unused)
{
    (void)unused;
    npualloc_graph *g = graph_of(self);
    return g ? violations_list(g) : NULL;
}

static PyObject *Graph_instantiate(GraphObject *self, PyObject *unused)
{
    (void)unused;
    npualloc_graph *g = graph_of(self);
    if (!g)
        return NULL;
    npualloc_graph_exec *e;
    aclError rc;
    WAITING_CALL(rc = npualloc_graph_instantiate(g, &e));
    if (rc == ACL_ERROR_RT_PARAM_INVALID && npualloc_graph_violation_count(g) > 0) {
        PyObject *v = violations_list(g);
        if (!v)
            return NULL;
        PyObject *first = PyList_GET_SIZE(v) ? PyList_GET_ITEM(v, 0) : NULL;
        PyErr_Format(GraphMemoryError, "%s; first: %S", npualloc_graph_last_error(), first ? first : Py_None);
        Py_DECREF(v);
        return NULL;
    }
    if (rc != ACL_SUCCESS)
        return graph_error(rc, "instantiate");
    ExecObject *x = PyObject_New(ExecObject, &Exec_Type);
    if (!x) {
        WAITING_CALL(npualloc_graph_exec_destroy(e));
        return NULL;
    }
    x->e = e;
    x->graph = Py_NewRef((PyObject *)self);
    x->gen = self->gen;
    x->launching = 0;
    x->doomed = NULL;
    return (PyObject *)x;
}

static PyObject *Graph_plan(GraphObject *self, PyObject *unused)
{
    (void)unused;
    npualloc_graph *g = graph_of(self);
    if (!g)
        return NULL;
    npualloc_graph_plan p;
    aclError rc = npualloc_graph_get_plan(g, &p);
    if (rc != ACL_SUCCESS)
        return graph_error(rc, "memory_plan");
    return Py_BuildValue("{s:i,s:K,s:K,s:K,s:K,s:K,s:n,s:n,s:n,s:O,s:O,s:O,s:i}", "device", (int)p.device, "base",
                         (unsigned long long)p.base, "footprint", (unsigned long long)p.footprint, "lower_bound",
                         (unsigned long long)p.lower_bound, "mapped", (unsigned long long)p.mapped, "output_bytes",
                         (unsigned long long)p.output_bytes, "alloc_count", (Py_ssize_t)p.alloc_count, "node_count",
                         (Py_ssize_t)p.node_count, "stream_count", (Py_ssize_t)p.stream_count, "checked",
                         p.checked ? Py_True : Py_False, "pool_mode", p.pool_mode ? Py_True : Py_False,
                         "instantiated", p.instantiated ? Py_True : Py_False, "capture_mode", (int)p.capture_mode);
}

static const char *const kind_names[] = {"alloc", "free", "memcpy", "memset", "host", "delay", "task"};

static PyObject *Graph_nodes(GraphObject *self, PyObject *unused)
{
    (void)unused;
    npualloc_graph *g = graph_of(self);
    if (!g)
        return NULL;
    size_t n = npualloc_graph_node_count(g);
    PyObject *list = PyList_New(0);
    for (size_t i = 0; list && i < n; i++) {
        npualloc_graph_node nd;
        if (npualloc_graph_get_node(g, i, &nd) != ACL_SUCCESS) {
            Py_DECREF(list);
            PyErr_SetString(PyExc_RuntimeError, "nodes(): the graph is still being captured");
            return NULL;
        }
        PyObject *deps = PyList_New((Py_ssize_t)nd.dep_count);
        for (uint32_t k = 0; deps && k < nd.dep_count; k++)
            PyList_SET_ITEM(deps, k, PyLong_FromUnsignedLong(nd.deps[k]));
        unsigned kind = (unsigned)nd.kind < 7 ? (unsigned)nd.kind : 6;
        PyObject *d = deps ? Py_BuildValue("{s:n,s:s,s:I,s:N}", "index", (Py_ssize_t)i, "kind", kind_names[kind],
                                           "stream", (unsigned)nd.stream, "deps", deps)
                           : NULL;
        int bad = !d;
        if (d && (nd.kind == NPUALLOC_GRAPH_NODE_ALLOC || nd.kind == NPUALLOC_GRAPH_NODE_FREE)) {
            PyObject *v = PyLong_FromUnsignedLong(nd.alloc);
            bad = !v || PyDict_SetItemString(d, "alloc", v) < 0;
            Py_XDECREF(v);
        } else if (d && (nd.kind == NPUALLOC_GRAPH_NODE_MEMCPY || nd.kind == NPUALLOC_GRAPH_NODE_MEMSET)) {
            PyObject *a = PyLong_FromUnsignedLongLong(nd.dst), *b = PyLong_FromUnsignedLongLong(nd.count);
            PyObject *c = nd.kind == NPUALLOC_GRAPH_NODE_MEMCPY ? PyLong_FromUnsignedLongLong(nd.src)
                                                                 : PyLong_FromLong(nd.value);
            bad = !a || !b || !c || PyDict_SetItemString(d, "dst", a) < 0 || PyDict_SetItemString(d, "count", b) < 0 ||
                  PyDict_SetItemString(d, nd.kind == NPUALLOC_GRAPH_NODE_MEMCPY ? "src" : "value", c) < 0;
            Py_XDECREF(a);
            Py_XDECREF(b);
            Py_XDECREF(c);
        }
        if (bad || PyList_Append(list, d) < 0) {
            Py_XDECREF(d);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(d);
    }
    return list;
}

static PyObject *mask_list(uint64_t mask)
{
    PyObject *l = PyList_New(0);
    for (int d = 0; l && d < 64; d++) {
        if ((mask >> d) & 1) {
            PyObject *v = PyLong_FromLong(d);
            if (!v || PyList_Append(l, v) < 0) {
                Py_XDECREF(v);
                Py_DECREF(l);
                return NULL;
            }
            Py_DECREF(v);
        }
    }
    return l;
}

static PyObject *Graph_allocations(GraphObject *self, PyObject *unused)
{
    (void)unused;
    npualloc_graph *g = graph_of(self);
    if (!g)
        return NULL;
    size_t n = npualloc_graph_alloc_count(g);
    PyObject *list = PyList_New(0);
    for (size_t i = 0; list && i < n; i++) {
        npualloc_graph_alloc a;
        if (npualloc_graph_get_alloc(g, i, &a) != ACL_SUCCESS)
            break;
        PyObject *free_node = a.free_node == NPUALLOC_GRAPH_NONE ? Py_NewRef(Py_None) : PyLong_FromUnsignedLong(a.free_node);
        PyObject *access = mask_list(a.access_mask);
        PyObject *d = free_node && access
                          ? Py_BuildValue("{s:n,s:K,s:K,s:K,s:K,s:I,s:N,s:N}", "index", (Py_ssize_t)i, "address",
                                          (unsigned long long)a.address, "offset", (unsigned long long)a.offset, "size",
                                          (unsigned long long)a.size, "requested", (unsigned long long)a.requested,
                                          "alloc_node", (unsigned)a.alloc_node, "free_node", free_node, "access", access)
                          : NULL;
        if (!d) {
            Py_XDECREF(free_node);
            Py_XDECREF(access);
        }
        if (!d || PyList_Append(list, d) < 0) {
            Py_XDECREF(d);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(d);
    }
    return list;
}

static PyObject *Graph_streams(GraphObject *self, PyObject *unused)
{
    (void)unused;
    npualloc_graph *g = graph_of(self);
    if (!g)
        return NULL;
    PyObject *list = PyList_New(0);
    uint64_t h;
    int32_t dev;
    for (size_t i = 0; list && npualloc_graph_stream(g, i, &h, &dev) == ACL_SUCCESS; i++) {
        PyObject *t = Py_BuildValue("(Ki)", (unsigned long long)h, (int)dev);
        if (!t || PyList_Append(list, t) < 0) {
            Py_XDECREF(t);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(t);
    }
    return list;
}

static PyMethodDef Graph_methods[] = {
    {"capture_begin", (PyCFunction)(void (*)(void))Graph_capture_begin, METH_FASTCALL,
     "capture_begin(stream, device, access_mask or None, pool id or None)"},
    {"capture_end", (PyCFunction)Graph_capture_end, METH_NOARGS, NULL},
    {"instantiate", (PyCFunction)Graph_instantiate, METH_NOARGS, NULL},
    {"plan", (PyCFunction)Graph_plan, METH_NOARGS, NULL},
    {"nodes", (PyCFunction)Graph_nodes, METH_NOARGS, NULL},
    {"allocations", (PyCFunction)Graph_allocations, METH_NOARGS, NULL},
    {"streams", (PyCFunction)Graph_streams, METH_NOARGS, NULL},
    {"violations", (PyCFunction)Graph_violations, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject Graph_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "npualloc._C.graph.Graph",
    .tp_basicsize = sizeof(GraphObject),
    .tp_dealloc = (destructor)Graph_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "A captured graph (npualloc_graph); npualloc.Graph wraps it.",
    .tp_methods = Graph_methods,
    .tp_init = (initproc)Graph_init,
    .tp_new = PyType_GenericNew,
};

/* ---- GraphExec ---- */

static void exec_release(ExecObject *self)
{
    npualloc_graph_exec *e = self->e;
    self->e = NULL;
    if (e && self->launching > 0)
        self->doomed = e;
    else if (e)
        WAITING_CALL(npualloc_graph_exec_destroy(e)); /* waits for its launches */
}

static void Exec_dealloc(ExecObject *self)
{
    exec_release(self);
    Py_CLEAR(self->graph);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Exec_launch(ExecObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (!check_nargs("launch", nargs, 2))
        return NULL;
    void *stream;
    int32_t dev;
    if (stream_args(args, "launch", &stream, &dev) < 0)
        return NULL;
    npualloc_graph_exec *e = self->e;
    if (!e) {
        PyErr_SetString(PyExc_RuntimeError, "launch: the executable graph was destroyed");
        return NULL;
    }
    aclError rc;
    self->launching++;
    WAITING_CALL(rc = npualloc_graph_launch(e, stream, dev));
    if (--self->launching == 0 && self->doomed) {
        npualloc_graph_exec *doomed = self->doomed;
        self->doomed = NULL;
        WAITING_CALL(npualloc_graph_exec_destroy(doomed)); /* destroyed meanwhile: after this launch */
    }
    if (rc != ACL_SUCCESS)
        return graph_error(rc, "launch");
    Py_RETURN_NONE;
}

static PyObject *Exec_destroy(ExecObject *self, PyObject *unused)
{
    (void)unused;
    exec_release(self);
    /* a destroyed executable no longer needs its graph: letting it go lets Graph.reset() release the
     * graph (and its private pool's reference) at once, while the executable object lives on */
    Py_CLEAR(self->graph);
    Py_RETURN_NONE;
}

static PyObject *Exec_get_destroyed(ExecObject *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(self->e == NULL);
}

static PyMethodDef Exec_methods[] = {
    {"launch", (PyCFunction)(void (*)(void))Exec_launch, METH_FASTCALL, "launch(stream, device)"},
    {"destroy", (PyCFunction)Exec_destroy, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Exec_getset[] = {
    {"destroyed", (getter)Exec_get_destroyed, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject Exec_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "npualloc._C.graph.GraphExec",
    .tp_basicsize = sizeof(ExecObject),
    .tp_dealloc = (destructor)Exec_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An executable graph (npualloc_graph_exec).",
    .tp_methods = Exec_methods,
    .tp_getset = Exec_getset,
};

/* ---- module ---- */

#define FAST(f) (PyCFunction)(void (*)(void))(f)

static PyMethodDef graph_methods[] = {
    {"mempool_id_new", g_mempool_id_new, METH_O, "mempool_id_new(user_created) -> (first, second)"},
    {"pool_create", FAST(g_pool_create), METH_FASTCALL, NULL},
    {"pool_create_with_allocator", FAST(g_pool_create_with_allocator), METH_FASTCALL, NULL},
    {"pool_release", FAST(g_pool_release), METH_FASTCALL, NULL},
    {"pool_begin_thread", FAST(g_pool_begin_thread), METH_FASTCALL, NULL},
    {"pool_end", FAST(g_pool_end), METH_FASTCALL, NULL},
    {"pool_empty", FAST(g_pool_empty), METH_FASTCALL, NULL},
    {"pool_use_count", FAST(g_pool_use_count), METH_FASTCALL, NULL},
    {"pool_mark_use_on_oom", FAST(g_pool_mark_use_on_oom), METH_FASTCALL, NULL},
    {"pool_clear_use_on_oom", FAST(g_pool_clear_use_on_oom), METH_FASTCALL, NULL},
    {"pool_set_no_split", FAST(g_pool_set_no_split), METH_FASTCALL, NULL},
    {"capture_status", FAST(g_capture_status), METH_FASTCALL, "capture_status(stream, device) -> bool"},
    {"set_mem_access", FAST(g_set_mem_access), METH_FASTCALL, "set_mem_access(device, mask)"},
    {"get_mem_access", g_get_mem_access, METH_O, "get_mem_access(device) -> mask"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef graph_def = {
    PyModuleDef_HEAD_INIT, "npualloc._C.graph", "Captured graphs with planned memory; private pools.", -1,
    graph_methods,         NULL,
    NULL,                  NULL,
    NULL,
};

int graph_py_attach(PyObject *module);

int graph_py_attach(PyObject *module)
{
    if (PyType_Ready(&Graph_Type) < 0 || PyType_Ready(&Exec_Type) < 0)
        return -1;
    PyObject *m = PyModule_Create(&graph_def);
    if (!m)
        return -1;
    GraphMemoryError = PyErr_NewExceptionWithDoc(
        "npualloc.GraphMemoryError",
        "A checked graph's capture used graph memory outside an allocation's lifetime.", PyExc_RuntimeError, NULL);
    if (!GraphMemoryError || PyModule_AddObject(m, "GraphMemoryError", Py_NewRef(GraphMemoryError)) < 0 ||
        PyModule_AddObject(m, "Graph", Py_NewRef((PyObject *)&Graph_Type)) < 0 ||
        PyModule_AddObject(m, "GraphExec", Py_NewRef((PyObject *)&Exec_Type)) < 0 ||
        PyModule_AddObject(module, "graph", m) < 0) {
        Py_DECREF(m);
        return -1;
    }
    return 0;
}
