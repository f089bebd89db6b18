/*
 * module.c - the npualloc._C extension module: initialisation and the npualloc-level
 * functions.  The faces (acl.rt, the torch-like memory API) live in their own files.
 */
#include "binding.h"
#include "memory_py.h"
#include "npualloc.h"
#include "pyarg.h"

/* parse_size(text) -> int bytes; ValueError when text is not a size. */
static PyObject *py_parse_size(PyObject *self, PyObject *arg)
{
    (void)self;
    if (!PyUnicode_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "parse_size() argument must be str, not %.80s", Py_TYPE(arg)->tp_name);
        return NULL;
    }
    Py_ssize_t n = 0;
    const char *text = PyUnicode_AsUTF8AndSize(arg, &n);
    if (!text)
        return NULL;
    uint64_t bytes;
    if (strlen(text) != (size_t)n || npualloc_parse_size(text, &bytes) != 0) { /* "8\0junk" is no size either */
        PyErr_Format(PyExc_ValueError,
                     "%R is not a size: use bytes or a number with KiB, MiB, GiB or TiB (or K, M, G, T)", arg);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(bytes);
}

static PyObject *config_to_dict(const npualloc_config *c)
{
    return Py_BuildValue("{s:i,s:K,s:K,s:K,s:K}", "device_count", (int)c->device_count, "device_memory",
                         (unsigned long long)c->device_memory, "huge_memory", (unsigned long long)c->huge_memory,
                         "huge1g_memory", (unsigned long long)c->huge1g_memory, "ddr_memory",
                         (unsigned long long)c->ddr_memory);
}

/* env_config() -> dict: the NPUALLOC_* environment over the defaults (does not start the devices). */
static PyObject *py_env_config(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    npualloc_config c;
    char err[512];
    if (npualloc_config_from_env(&c, err, sizeof err) != ACL_SUCCESS) {
        PyErr_SetString(PyExc_ValueError, err);
        return NULL;
    }
    return config_to_dict(&c);
}

/* configure(device_count, device_memory, huge_memory, huge1g_memory, ddr_memory) */
static PyObject *py_configure(PyObject *self, PyObject *args)
{
    (void)self;
    npualloc_config c;
    int count;
    unsigned long long dm, hm, h1, ddr;
    if (!PyArg_ParseTuple(args, "iKKKK:configure", &count, &dm, &hm, &h1, &ddr))
        return NULL;
    c.device_count = count;
    c.device_memory = dm;
    c.huge_memory = hm;
    c.huge1g_memory = h1;
    c.ddr_memory = ddr;
    char err[512];
    aclError rc = npualloc_configure(&c, err, sizeof err);
    if (rc == ACL_ERROR_REPEAT_INITIALIZE) {
        PyErr_SetString(PyExc_RuntimeError, err);
        return NULL;
    }
    if (rc != ACL_SUCCESS) {
        PyErr_SetString(PyExc_ValueError, err);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* config() -> dict: the configuration in effect (starts the devices). */
static PyObject *py_config(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    npualloc_config c;
    aclError rc = npualloc_get_config(&c);
    if (raise_init_error(rc))
        return NULL;
    return config_to_dict(&c);
}

static PyObject *py_initialized(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyBool_FromLong(npualloc_initialized());
}

static PyObject *py_vmm_counts(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    npualloc_vmm_counts c;
    npualloc_vmm_counts_get(&c);
    return Py_BuildValue("{s:n,s:n,s:n,s:n}", "physical_handles", (Py_ssize_t)c.physical_handles, "reservations",
                         (Py_ssize_t)c.reservations, "mappings", (Py_ssize_t)c.mappings, "fds_kept",
                         (Py_ssize_t)c.fds_kept);
}

/* shutdown(): waits for every stream and releases everything (the next call restarts). */
static PyObject *py_shutdown(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    Py_ssize_t views = memory_py_buffer_views();
    if (views > 0) { /* as Buffer.free(): the memory would go from under them */
        PyErr_Format(PyExc_BufferError,
                     "npualloc: %zd exported view(s) of npualloc.Buffer memory still exist: release them "
                     "(memoryview.release(), or drop the arrays) before shutting the runtime down",
                     views);
        return NULL;
    }
    aclError rc;
    WAITING_CALL(rc = npualloc_shutdown()); /* a Python pool allocator's free may run under the allocator locks */
    if (rc != ACL_SUCCESS) {
        PyErr_Format(PyExc_RuntimeError,
                     "npualloc: the runtime cannot be shut down from a stream's task (error %d): it would wait "
                     "for that task's own stream",
                     (int)rc);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* sleep(seconds, stream) -> ret: queues a delay on a stream (0/None = default stream). */
static PyObject *py_sleep(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char fn[] = "npualloc._sleep";
    if (!check_nargs(fn, nargs, 2))
        return NULL;
    double seconds = PyFloat_AsDouble(args[0]);
    if (seconds == -1.0 && PyErr_Occurred())
        return NULL;
    void *stream;
    int a = arg_ptr(args[1], fn, "stream", &stream);
    if (a < 0)
        return NULL;
    if (a == ARG_OUT_OF_RANGE)
        return ret_or_init_error(ACL_ERROR_INVALID_PARAM);
    aclError rc = npualloc_sleep_async(stream, seconds);
    return ret_or_init_error(rc);
}

/* fault_set(kind, nth) -> None: the nth device allocation (0), map (1), memory-file creation (2)
 * or address reservation (3) from now fails once; nth 0 disarms.  fault_counts(kind) -> (seen, injected). */
static PyObject *py_fault_set(PyObject *self, PyObject *args)
{
    (void)self;
    int kind;
    unsigned long long nth;
    if (!PyArg_ParseTuple(args, "iK:fault_set", &kind, &nth))
        return NULL;
    if (npualloc_fault_set((npualloc_fault_kind)kind, nth) != ACL_SUCCESS) {
        PyErr_Format(PyExc_ValueError, "fault_set(): unknown fault kind %d (0 device_alloc, 1 map, 2 memfile, 3 reserve)", kind);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *py_fault_counts(PyObject *self, PyObject *arg)
{
    (void)self;
    long kind = PyLong_AsLong(arg);
    if (kind == -1 && PyErr_Occurred())
        return NULL;
    uint64_t seen, injected;
    npualloc_fault_counts((npualloc_fault_kind)kind, &seen, &injected);
    return Py_BuildValue("(KK)", (unsigned long long)seen, (unsigned long long)injected);
}

static PyMethodDef module_methods[] = {
    {"parse_size", py_parse_size, METH_O,
     "parse_size($module, text, /)\n--\n\n"
     "The bytes in a size text: a number of bytes, or one with KiB, MiB, GiB or TiB (or K, M, G, T), e.g. \"80GiB\"."},
    {"env_config", py_env_config, METH_NOARGS, "The NPUALLOC_* environment over the defaults."},
    {"configure", py_configure, METH_VARARGS, "Sets the device configuration before first use."},
    {"config", py_config, METH_NOARGS, "The configuration in effect (starts the devices)."},
    {"initialized", py_initialized, METH_NOARGS, "True once the devices have started."},
    {"vmm_counts", py_vmm_counts, METH_NOARGS, "Live physical handles, reservations, mappings, kept fds."},
    {"shutdown", py_shutdown, METH_NOARGS, "Releases every resource; the next use restarts the devices."},
    {"fault_set", py_fault_set, METH_VARARGS, "fault_set(kind, nth): make the nth operation of a kind fail once."},
    {"fault_counts", py_fault_counts, METH_O, "fault_counts(kind) -> (seen since armed, injected so far)."},
    {"sleep", (PyCFunction)(void (*)(void))py_sleep, METH_FASTCALL, "sleep(seconds, stream) -> ret"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "npualloc._C", "The npualloc C core.", -1, module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__C(void)
{
    PyObject *m = PyModule_Create(&module_def);
    if (!m)
        return NULL;
    PyObject *rt = acl_rt_module_create();
    if (!rt || PyModule_AddObject(m, "rt", rt) != 0) {
        Py_XDECREF(rt);
        Py_DECREF(m);
        return NULL;
    }
    PyObject *acl = acl_util_module_create();
    if (!acl || PyModule_AddObject(m, "acl", acl) != 0) {
        Py_XDECREF(acl);
        Py_DECREF(m);
        return NULL;
    }
    if (memory_py_attach(m) != 0) { Py_DECREF(m); return NULL; } /* the torch_npu-like memory face: _C.memory */
    { extern int replay_py_attach(PyObject *); if (replay_py_attach(m) != 0) { Py_DECREF(m); return NULL; } } /* trace replay: _C.replay */
    { extern int ipc_py_attach(PyObject *); if (ipc_py_attach(m) != 0) { Py_DECREF(m); return NULL; } } /* cross-process sharing: acl.rt ipc functions, _C.ipc */
    { extern int graph_py_attach(PyObject *); if (graph_py_attach(m) != 0) { Py_DECREF(m); return NULL; } } /* captured graphs, private pools: _C.graph */
    return m;
}
