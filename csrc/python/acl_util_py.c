/*
 * acl_util_py.c - the rest of the pyACL face: acl.init / acl.finalize and the C half of
 * acl.util (npualloc/acl.py adds the numpy helpers on top).
 *
 * acl.util has no C counterpart in CANN; here it is defined so that a bad device pointer is a
 * Python exception, never a crash: device ranges are checked against the address registry
 * before they are read (host addresses are checked by the copy itself: mem.h).
 */
#include "acl_rt.h"
#include "binding.h"
#include "device.h"
#include "npualloc.h"
#include "pyarg.h"
#include "vmm.h"

/* init(config_path) -> ret: config_path is a str or None (its content is not read). */
static PyObject *acl_init(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char fn[] = "acl.init";
    if (!check_nargs(fn, nargs, 1))
        return NULL;
    const char *path = NULL;
    if (args[0] != Py_None) {
        if (!PyUnicode_Check(args[0])) {
            PyErr_Format(PyExc_TypeError, "%s() argument 'config_path' must be str or None, not %.80s", fn,
                         Py_TYPE(args[0])->tp_name);
            return NULL;
        }
        if (!(path = PyUnicode_AsUTF8(args[0])))
            return NULL;
    }
    return ret_or_init_error(aclInit(path));
}

static PyObject *acl_finalize(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    (void)args;
    if (!check_nargs("acl.finalize", nargs, 0))
        return NULL;
    return ret_or_init_error(aclFinalize());
}

/* Converts (ptr, size) for the util functions: TypeError for non-ints, ValueError for values
 * out of range or a size that no Python buffer can hold. */
static int util_range(PyObject *const *args, const char *fn, void **ptr, Py_ssize_t *size)
{
    uint64_t n = 0;
    int a = arg_ptr(args[0], fn, "ptr", ptr);
    if (a == ARG_TYPE_ERROR)
        return -1;
    int b = arg_u64(args[1], fn, "size", &n);
    if (b == ARG_TYPE_ERROR)
        return -1;
    if (a != ARG_OK) {
        PyErr_Format(PyExc_ValueError, "%s(): ptr must be an address in [0, 2**64)", fn);
        return -1;
    }
    if (b != ARG_OK || n > (uint64_t)PY_SSIZE_T_MAX) {
        PyErr_Format(PyExc_ValueError, "%s(): size must be from 0 to %zd", fn, PY_SSIZE_T_MAX);
        return -1;
    }
    if (n && !*ptr) {
        PyErr_Format(PyExc_ValueError, "%s(): ptr is NULL", fn);
        return -1;
    }
    *size = (Py_ssize_t)n;
    return 0;
}

/* 0 when [ptr, ptr + size) is mapped device memory or host memory (outside every reservation);
 * else -1 with ValueError (or the start-up error) set. */
static int check_range(const char *fn, void *ptr, Py_ssize_t size, bool *readonly)
{
    aclError rc = runtime_ensure_init();
    if (raise_init_error(rc))
        return -1;
    int32_t dev;
    vmm_read_lock();
    range_class cls = vmm_classify_locked(ptr, (size_t)size, &dev);
    /* read-only memory is the one the runtime writes through another view of */
    *readonly = cls == RANGE_DEVICE && vmm_runtime_view_locked(ptr) != ptr;
    vmm_read_unlock();
    if (cls != RANGE_INVALID)
        return 0;
    /* the address as the int the caller gave (%p prints NULL as "0x(nil)") */
    PyErr_Format(PyExc_ValueError, "%s(): %zd bytes at %zu are not mapped device memory", fn, size,
                 (size_t)(uintptr_t)ptr);
    return -1;
}

/* ptr_to_bytes(ptr, size) -> bytes: a copy of size bytes at ptr, read through aclrtMemcpy in RELAXED
 * capture mode (ValueError when it is not mapped device memory, checked before the copy is allocated, or
 * when the copy finds a host address unreadable). */
static PyObject *util_ptr_to_bytes(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char fn[] = "acl.util.ptr_to_bytes";
    if (!check_nargs(fn, nargs, 2))
        return NULL;
    void *ptr;
    Py_ssize_t size;
    bool readonly;
    if (util_range(args, fn, &ptr, &size) != 0 || (size > 0 && check_range(fn, ptr, size, &readonly) != 0))
        return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, size);
    if (!out || size == 0)
        return out;
    char *buf = PyBytes_AS_STRING(out);
    aclError rc;
    /* pyACL's ptr_to_bytes reads memory without a runtime call, so no capture mode refuses it: the
     * copy runs RELAXED (without a current device there is no capture to answer to anyway) */
    aclmdlRICaptureMode mode = ACL_MODEL_RI_CAPTURE_MODE_RELAXED;
    WAITING_CALL(bool exchanged = aclmdlRICaptureThreadExchangeMode(&mode) == ACL_SUCCESS;
                 rc = aclrtMemcpy(buf, (size_t)size, ptr, (size_t)size, ACL_MEMCPY_DEVICE_TO_HOST);
                 if (exchanged) (void)aclmdlRICaptureThreadExchangeMode(&mode));
    if (rc != ACL_SUCCESS) {
        Py_DECREF(out);
        if (!raise_init_error(rc))
            PyErr_Format(PyExc_ValueError, "%s(): cannot read %zd bytes at %zu: not mapped readable memory (ret %d)",
                         fn, size, (size_t)(uintptr_t)ptr, rc);
        return NULL;
    }
    return out;
}

/* bytes_to_ptr(bytes_obj) -> int: the address of a bytes or bytearray buffer (no copy; the
 * caller keeps the object alive, and a bytearray unresized). */
static PyObject *util_bytes_to_ptr(PyObject *self, PyObject *arg)
{
    (void)self;
    const char *p;
    if (PyBytes_Check(arg))
        p = PyBytes_AS_STRING(arg);
    else if (PyByteArray_Check(arg))
        p = PyByteArray_AS_STRING(arg);
    else {
        PyErr_Format(PyExc_TypeError,
                     "acl.util.bytes_to_ptr() argument 'bytes_obj' must be bytes or bytearray, not %.80s",
                     Py_TYPE(arg)->tp_name);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)p);
}

/* memory(ptr, size) -> memoryview: a view of size bytes at ptr, after checking that a device range
 * is mapped throughout (ValueError otherwise); read-only over ACL_MEM_ACCESS_USER_SPACE_READONLY
 * memory, whose pages fault on a write, so a write through the view is an exception, not a crash.
 * The view is valid only while the memory stays mapped (used by acl.util.ptr_to_numpy). */
static PyObject *util_memory(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char fn[] = "acl.util.ptr_to_numpy";
    if (!check_nargs(fn, nargs, 2))
        return NULL;
    void *ptr;
    Py_ssize_t size;
    if (util_range(args, fn, &ptr, &size) != 0)
        return NULL;
    if (size == 0)
        return PyMemoryView_FromMemory((char *)"", 0, PyBUF_WRITE);
    bool readonly;
    if (check_range(fn, ptr, size, &readonly) != 0)
        return NULL;
    return PyMemoryView_FromMemory(ptr, size, readonly ? PyBUF_READ : PyBUF_WRITE);
}

static PyMethodDef acl_methods[] = {
    {"init", (PyCFunction)(void (*)(void))acl_init, METH_FASTCALL, "init(config_path) -> ret"},
    {"finalize", (PyCFunction)(void (*)(void))acl_finalize, METH_FASTCALL, "finalize() -> ret"},
    /* public as acl.util.*: text signatures (positional-only, as the functions take no keywords) for help() and
     * inspect.signature() */
    {"ptr_to_bytes", (PyCFunction)(void (*)(void))util_ptr_to_bytes, METH_FASTCALL,
     "ptr_to_bytes($module, ptr, size, /)\n--\n\n"
     "data = acl.util.ptr_to_bytes(ptr, size)\n"
     "A bytes copy of size bytes at ptr (device or host memory); ValueError when they are not mapped readable."},
    {"bytes_to_ptr", util_bytes_to_ptr, METH_O,
     "bytes_to_ptr($module, bytes_obj, /)\n--\n\n"
     "ptr = acl.util.bytes_to_ptr(bytes_obj)\n"
     "The address of a bytes or bytearray object's buffer (no copy: keep the object alive, a bytearray unresized)."},
    {"memory", (PyCFunction)(void (*)(void))util_memory, METH_FASTCALL,
     "memory(ptr, size) -> memoryview (validated; read-only over read-only memory)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef acl_def = {
    PyModuleDef_HEAD_INIT, "npualloc._C.acl", "pyACL top-level functions and the C half of acl.util.", -1,
    acl_methods, NULL, NULL, NULL, NULL,
};

PyObject *acl_util_module_create(void) { return PyModule_Create(&acl_def); }
