/*
 * ipc_py.c - cross-process sharing in Python:
 *   - the pyACL functions, added to the acl.rt module (`_C.rt`) with pyACL's conventions
 *     (outputs first, `ret` last; TypeError for a wrong type, an ACL code for a bad value);
 *   - `_C.ipc`: the C half of npualloc.share / open_shared / close_shared, and counters.
 * Every call that may talk to a socket releases the GIL.
 *
 * ipc_py_attach(module) is called once from PyInit__C (module.c).
 */
#include <string.h>

#include "acl_rt.h"
#include "binding.h"
#include "ipc.h"
#include "npualloc.h"
#include "pyarg.h"
#include "rt_binding.h"

/* A pid list: pyACL wants a list (ValueError otherwise); items are ints (TypeError otherwise).
 * Returns a PyMem buffer (NULL with an exception); *n receives the count; *bad is set when an
 * item does not fit an int32.  The items are read from a tuple copy of the list: an item's
 * __index__ may change the list, and the copy keeps every item alive until it is converted. */
static int32_t *pid_list(PyObject *o, const char *fn, size_t *n, bool *bad)
{
    if (!PyList_Check(o)) {
        PyErr_SetString(PyExc_ValueError, "argument 2 only support the format of list");
        return NULL;
    }
    PyObject *items = PyList_AsTuple(o);
    if (!items)
        return NULL;
    Py_ssize_t len = PyTuple_GET_SIZE(items);
    int32_t *pids = PyMem_Malloc((size_t)(len ? len : 1) * sizeof *pids);
    if (!pids) {
        Py_DECREF(items);
        return (int32_t *)PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        int rc = arg_i32(PyTuple_GET_ITEM(items, i), fn, "pid_list item", &pids[i]);
        if (rc == ARG_TYPE_ERROR) {
            PyMem_Free(pids);
            Py_DECREF(items);
            return NULL;
        }
        if (rc == ARG_OUT_OF_RANGE)
            *bad = true;
    }
    Py_DECREF(items);
    *n = (size_t)len;
    return pids;
}

/* A key argument: a str (TypeError otherwise) that is a C string, as pyACL parses it: ValueError for
 * a NUL inside it, which C would take for the key's end (key + "\0junk" would name the key), or
 * for a character UTF-8 cannot encode. */
static const char *key_arg(PyObject *o, const char *fn)
{
    if (!PyUnicode_Check(o)) {
        arg_type_error(fn, "argument 'key' must be str, not %.80s", Py_TYPE(o)->tp_name);
        return NULL;
    }
    Py_ssize_t len = 0;
    const char *key = PyUnicode_AsUTF8AndSize(o, &len);
    if (!key) {
        if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError))
            return NULL; /* out of memory */
        PyErr_Clear();
        arg_value_error(fn, "argument 'key' cannot be encoded as UTF-8");
        return NULL;
    }
    if (strlen(key) != (size_t)len) {
        arg_value_error(fn, "argument 'key' contains a null character");
        return NULL;
    }
    return key;
}

/* ---- acl.rt ---- */

RT_DOC(mem_export_to_shareable_handle, "handle, handle_type, flags", "(shareable_handle, ret)",
       "aclrtMemExportToShareableHandle: an int by which other processes import the physical memory handle;\n"
       "handle_type: ACL_MEM_HANDLE_TYPE_NONE; flags: ACL_RT_VMM_EXPORT_FLAG_*.");
static PyObject *rt_mem_export_to_shareable_handle(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                                   PyObject *kwnames)
{
    RT_BEGIN("mem_export_to_shareable_handle", 3);
    void *handle = NULL;
    int32_t type = 0;
    uint64_t flags = 0;
    RT_ARG_OR(arg_ptr, 0, "handle", handle, BAD_HANDLE);
    RT_ARG_OR(arg_i32, 1, "handle_type", type, -1);
    RT_ARG_OR(arg_u64, 2, "flags", flags, UINT64_MAX);
    uint64_t value = 0;
    aclError rc;
    WAITING_CALL(rc = aclrtMemExportToShareableHandle(handle, (aclrtMemHandleType)type, flags, &value));
    return ret_u64(value, rc);
}

RT_DOC(mem_set_pid_to_shareable_handle, "shareable_handle, pid_list", "ret",
       "aclrtMemSetPidToShareableHandle: lets the processes in pid_list (a list of device_get_bare_tgid()\n"
       "values) import shareable_handle.");
static PyObject *rt_mem_set_pid_to_shareable_handle(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                                    PyObject *kwnames)
{
    RT_BEGIN("mem_set_pid_to_shareable_handle", 2);
    uint64_t value = 0;
    RT_ARG_OR(arg_u64, 0, "shareable_handle", value, 0);
    size_t n = 0;
    bool bad = false;
    int32_t *pids = pid_list(args[1], fn, &n, &bad);
    if (!pids)
        return NULL;
    aclError rc;
    if (bad)
        rc = ACL_ERROR_INVALID_PARAM;
    else
        WAITING_CALL(rc = aclrtMemSetPidToShareableHandle(value, pids, n));
    PyMem_Free(pids);
    return ret_or_init_error(rc);
}

RT_DOC(mem_import_from_shareable_handle, "shareable_handle, device_id", "(handle, ret)",
       "aclrtMemImportFromShareableHandle: a physical memory handle on device_id for the memory another\n"
       "process exported as shareable_handle.");
static PyObject *rt_mem_import_from_shareable_handle(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                                     PyObject *kwnames)
{
    RT_BEGIN("mem_import_from_shareable_handle", 2);
    uint64_t value = 0;
    int32_t dev = 0;
    RT_ARG_OR(arg_u64, 0, "shareable_handle", value, 0);
    RT_ARG_OR(arg_i32, 1, "device_id", dev, -1);
    aclrtDrvMemHandle h = NULL;
    aclError rc;
    WAITING_CALL(rc = aclrtMemImportFromShareableHandle(value, dev, &h));
    return ret_handle(h, rc);
}

RT_DOC0(device_get_bare_tgid, "(pid, ret)", "aclrtDeviceGetBareTgid: this process's id, as the pid lists expect it.");
RT_OUTPUT(device_get_bare_tgid, int32_t, aclrtDeviceGetBareTgid, ret_i64)

RT_DOC(ipc_mem_get_export_key, "dev_ptr, size, len, flags", "(key, ret)",
       "aclrtIpcMemGetExportKey: a str key naming size bytes of malloc memory at dev_ptr for other processes;\n"
       "len: the key's buffer size (65; ValueError from 1024); flags: ACL_RT_IPC_MEM_EXPORT_FLAG_*.");
static PyObject *rt_ipc_mem_get_export_key(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("ipc_mem_get_export_key", 4);
    void *ptr = NULL;
    uint64_t size = 0, len = 0, flags = 0;
    RT_ARG_OR(arg_ptr, 0, "dev_ptr", ptr, BAD_HANDLE);
    RT_ARG_OR(arg_u64, 1, "size", size, 0);
    RT_ARG_OR(arg_u64, 2, "len", len, UINT64_MAX);
    RT_ARG_OR(arg_u64, 3, "flags", flags, UINT64_MAX);
    if (len >= 1024) {
        PyErr_SetString(PyExc_ValueError, "key len should be less than 1024");
        return NULL;
    }
    char key[1024] = "";
    aclError rc;
    WAITING_CALL(rc = aclrtIpcMemGetExportKey(ptr, (size_t)size, key, (size_t)len, flags));
    if (raise_init_error(rc))
        return NULL;
    return Py_BuildValue("(si)", rc == ACL_SUCCESS ? key : "", rc);
}

RT_DOC(ipc_mem_set_import_pid, "key, pid_list", "ret",
       "aclrtIpcMemSetImportPid: lets the processes in pid_list (a list of device_get_bare_tgid() values)\n"
       "import key.");
static PyObject *rt_ipc_mem_set_import_pid(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("ipc_mem_set_import_pid", 2);
    const char *key = key_arg(args[0], fn);
    if (!key)
        return NULL;
    size_t n = 0;
    bool bad = false;
    int32_t *pids = pid_list(args[1], fn, &n, &bad);
    if (!pids)
        return NULL;
    aclError rc;
    if (bad)
        rc = ACL_ERROR_INVALID_PARAM;
    else
        WAITING_CALL(rc = aclrtIpcMemSetImportPid(key, pids, n));
    PyMem_Free(pids);
    return ret_or_init_error(rc);
}

RT_DOC(ipc_mem_import_by_key, "key, flags", "(dev_ptr, ret)",
       "aclrtIpcMemImportByKey: maps the memory key names into this process; flags:\n"
       "ACL_RT_IPC_MEM_IMPORT_FLAG_*.");
static PyObject *rt_ipc_mem_import_by_key(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("ipc_mem_import_by_key", 2);
    const char *key = key_arg(args[0], fn);
    if (!key)
        return NULL;
    uint64_t flags = 0;
    RT_ARG_OR(arg_u64, 1, "flags", flags, UINT64_MAX);
    void *p = NULL;
    aclError rc;
    WAITING_CALL(rc = aclrtIpcMemImportByKey(&p, key, flags));
    return ret_handle(p, rc);
}

RT_DOC(ipc_mem_close, "key", "ret",
       "aclrtIpcMemClose: unmaps an imported key, or, in the exporting process, stops sharing it.");
static PyObject *rt_ipc_mem_close(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RT_BEGIN("ipc_mem_close", 1);
    const char *key = key_arg(args[0], fn);
    if (!key)
        return NULL;
    aclError rc;
    WAITING_CALL(rc = aclrtIpcMemClose(key));
    return ret_or_init_error(rc);
}

static PyMethodDef ipc_rt_methods[] = {
    RT_METHOD(mem_export_to_shareable_handle),
    RT_METHOD(mem_set_pid_to_shareable_handle),
    RT_METHOD(mem_import_from_shareable_handle),
    RT_METHOD(device_get_bare_tgid),
    RT_METHOD(ipc_mem_get_export_key),
    RT_METHOD(ipc_mem_set_import_pid),
    RT_METHOD(ipc_mem_import_by_key),
    RT_METHOD(ipc_mem_close),
    {NULL, NULL, 0, NULL},
};

/* ---- _C.ipc: npualloc.share and friends ---- */

static PyObject *share_error(const char *what, aclError rc)
{
    if (raise_init_error(rc))
        return NULL;
    const char *why;
    switch (rc) {
    case ACL_ERROR_RT_INVALID_HANDLE:
        why = "the block is no longer shared (its owner freed it, or exited)";
        break;
    case ACL_ERROR_RT_DRV_INTERNAL_ERROR:
        why = "not permitted (the owner's own block, or a user the owner does not accept)";
        break;
    case ACL_ERROR_RT_FEATURE_NOT_SUPPORT:
        why = "the block is on another device and peer access between the two is not enabled";
        break;
    case ACL_ERROR_RT_INVALID_DEVICEID:
        why = "invalid device";
        break;
    case ACL_ERROR_RT_IPC_ERROR:
        if (strcmp(what, "open_shared") == 0 && ipc_last_peer_version()) {
            PyErr_Format(PyExc_RuntimeError,
                         "%s: the owner speaks version %d of npualloc's sharing protocol and this process "
                         "version %d: both must run the same npualloc (ACL error %d)",
                         what, (int)ipc_last_peer_version(), IPC_VERSION, (int)rc);
            return NULL;
        }
        why = "the owner did not answer properly";
        break;
    case ACL_ERROR_RT_RESOURCE_ALLOC_FAIL: /* docs/sharing.md, Limits: the two ways out of descriptors */
        why = strcmp(what, "share") == 0 ? "out of descriptors (memory created past NPUALLOC_FD_BUDGET is exported "
                                           "only with CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE)"
                                         : "out of descriptors (the owner had none free to hand out)";
        break;
    default:
        why = "failed";
        break;
    }
    PyErr_Format(PyExc_RuntimeError, "%s: %s (ACL error %d)", what, why, (int)rc);
    return NULL;
}

/* share(ptr) -> bytes */
static PyObject *py_share(PyObject *self, PyObject *arg)
{
    (void)self;
    void *ptr = NULL;
    int a = arg_ptr(arg, "share", "ptr", &ptr);
    if (a == ARG_TYPE_ERROR)
        return NULL;
    char buf[4096];
    size_t len = 0;
    aclError rc;
    if (a == ARG_OUT_OF_RANGE)
        rc = ACL_ERROR_INVALID_PARAM;
    else
        WAITING_CALL(rc = ipc_share(ptr, buf, sizeof buf, &len));
    if (rc == ACL_SUCCESS)
        return PyBytes_FromStringAndSize(buf, (Py_ssize_t)len);
    if (rc == ACL_ERROR_INVALID_PARAM && len > sizeof buf) { /* a block over many pages */
        char *big = PyMem_Malloc(len);
        if (!big)
            return PyErr_NoMemory();
        size_t len2 = 0;
        WAITING_CALL(rc = ipc_share(ptr, big, len, &len2));
        PyObject *out = rc == ACL_SUCCESS ? PyBytes_FromStringAndSize(big, (Py_ssize_t)len2) : NULL;
        PyMem_Free(big);
        if (rc == ACL_SUCCESS)
            return out;
    }
    if (rc == ACL_ERROR_INVALID_PARAM) {
        PyErr_Format(PyExc_RuntimeError, "share: %R is not a live block of the caching allocator", arg);
        return NULL;
    }
    return share_error("share", rc);
}

/* open_shared(desc: bytes, device: int or None (the owner's)) -> ptr */
static PyObject *py_open_shared(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (!check_nargs("open_shared", nargs, 2))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) != 0)
        return NULL;
    int32_t dev = -1;
    int a = args[1] == Py_None ? ARG_OK : arg_i32(args[1], "open_shared", "device", &dev);
    if (a == ARG_TYPE_ERROR) {
        PyBuffer_Release(&view);
        return NULL;
    }
    void *ptr = NULL;
    aclError rc;
    /* ipc_open_shared reads any negative device as "the owner's": only None may ask for that,
     * a negative index is no device (it used to open on the owner's device). */
    if (a == ARG_OUT_OF_RANGE || (args[1] != Py_None && dev < 0))
        rc = ACL_ERROR_RT_INVALID_DEVICEID;
    else
        WAITING_CALL(rc = ipc_open_shared(view.buf, (size_t)view.len, dev, &ptr));
    PyBuffer_Release(&view);
    if (rc == ACL_ERROR_INVALID_PARAM) {
        PyErr_SetString(PyExc_ValueError, "open_shared: not a handle made by npualloc.share");
        return NULL;
    }
    if (rc != ACL_SUCCESS)
        return share_error("open_shared", rc);
    return PyLong_FromUnsignedLongLong((uintptr_t)ptr);
}

/* close_shared(ptr) */
static PyObject *py_close_shared(PyObject *self, PyObject *arg)
{
    (void)self;
    void *ptr = NULL;
    int a = arg_ptr(arg, "close_shared", "ptr", &ptr);
    if (a == ARG_TYPE_ERROR)
        return NULL;
    aclError rc = ACL_ERROR_INVALID_PARAM;
    if (a == ARG_OK)
        WAITING_CALL(rc = ipc_close_shared(ptr));
    if (rc != ACL_SUCCESS) {
        PyErr_Format(PyExc_RuntimeError, "close_shared: %R was not opened by open_shared", arg);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* describe(desc) -> (kind, pid, device, size) */
static PyObject *py_describe(PyObject *self, PyObject *arg)
{
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) != 0)
        return NULL;
    char kind = 0;
    int32_t pid = 0, dev = 0;
    uint64_t size = 0;
    aclError rc = ipc_share_describe(view.buf, (size_t)view.len, &kind, &pid, &dev, &size);
    PyBuffer_Release(&view);
    if (rc != ACL_SUCCESS) {
        PyErr_SetString(PyExc_ValueError, "not a handle made by npualloc.share");
        return NULL;
    }
    return Py_BuildValue("(C i i K)", (int)kind, (int)pid, (int)dev, (unsigned long long)size);
}

static PyObject *py_counts(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    ipc_counts c;
    ipc_get_counts(&c);
    return Py_BuildValue("{s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:K,s:K,s:O,s:I}", "exports", (Py_ssize_t)c.exports,
                         "imports",
                         (Py_ssize_t)c.imports, "key_imports", (Py_ssize_t)c.key_imports, "shares",
                         (Py_ssize_t)c.shares, "opens", (Py_ssize_t)c.opens, "sessions", (Py_ssize_t)c.sessions,
                         "clients", (Py_ssize_t)c.clients, "pins", (Py_ssize_t)c.pins, "failed",
                         (unsigned long long)c.failed, "refused", (unsigned long long)c.refused, "server_running",
                         c.server_running ? Py_True : Py_False, "secret", (unsigned)c.secret);
}

/* server_name(pid, secret) -> str: the abstract socket name (without the leading NUL). */
static PyObject *py_server_name(PyObject *self, PyObject *args)
{
    (void)self;
    int pid;
    unsigned secret;
    if (!PyArg_ParseTuple(args, "iI:server_name", &pid, &secret))
        return NULL;
    char name[108];
    ipc_server_name(pid, secret, name, sizeof name);
    return PyUnicode_FromString(name);
}

static PyMethodDef ipc_methods[] = {
    {"share", py_share, METH_O, "share(ptr) -> bytes: a handle for a live caching-allocator block"},
    {"open_shared", (PyCFunction)(void (*)(void))py_open_shared, METH_FASTCALL,
     "open_shared(handle, device) -> ptr (device None: the owner's)"},
    {"close_shared", py_close_shared, METH_O, "close_shared(ptr)"},
    {"describe", py_describe, METH_O, "describe(handle) -> (kind, pid, device, size)"},
    {"counts", py_counts, METH_NOARGS, "Live exports, imports, shares, opens, sessions, server clients, pins."},
    {"server_name", py_server_name, METH_VARARGS, "server_name(pid, secret) -> the exporter's socket name"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef ipc_def = {
    PyModuleDef_HEAD_INIT, "npualloc._C.ipc", "Cross-process sharing (npualloc.share and friends).", -1,
    ipc_methods, NULL, NULL, NULL, NULL,
};

int ipc_py_attach(PyObject *module);

int ipc_py_attach(PyObject *module)
{
    PyObject *rt = PyObject_GetAttrString(module, "rt");
    if (!rt)
        return -1;
    int rc = PyModule_AddFunctions(rt, ipc_rt_methods);
    Py_DECREF(rt);
    if (rc != 0)
        return -1;
    PyObject *ipc = PyModule_Create(&ipc_def);
    if (!ipc || PyModule_AddObject(module, "ipc", ipc) != 0) {
        Py_XDECREF(ipc);
        return -1;
    }
    return 0;
}
