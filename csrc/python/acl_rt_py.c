/*
 * acl_rt_py.c - the pyACL face: `acl.rt.*` functions with pyACL's conventions.
 *
 * Outputs come first and `ret` last: `(dev_ptr, ret) = acl.rt.malloc(size, policy)`.
 * Arguments are positional.  A wrong type raises TypeError naming the function and the
 * argument; a value of the right type that is out of range returns an ACL error code.
 * Every call that may block or make system calls releases the GIL.
 */
#include "acl_rt.h"
#include "binding.h"
#include "npualloc.h"
#include "pyarg.h"

/* Declares `fn`, checks the argument count. */
#define RT_BEGIN(name, n)                                                                                          \
    static const char fn[] = "acl.rt." name;                                                                       \
    (void)self;                                                                                                    \
    if (!check_nargs(fn, nargs, (n)))                                                                              \
        return NULL

/* Converts argument i with conv into var; a TypeError returns NULL, a bad value sets `bad`. */
#define RT_ARG(conv, i, argname, var)                                                                              \
    do {                                                                                                           \
        int conv_rc_ = conv(args[i], fn, argname, &(var));                                                         \
        if (conv_rc_ == ARG_TYPE_ERROR)                                                                            \
            return NULL;                                                                                           \
        if (conv_rc_ == ARG_OUT_OF_RANGE)                                                                          \
            bad = true;                                                                                            \
    } while (0)

#define CALL_NOGIL(stmt)                                                                                           \
    do {                                                                                                           \
        Py_BEGIN_ALLOW_THREADS stmt;                                                                               \
        Py_END_ALLOW_THREADS                                                                                       \
    } while (0)

/* ---- devices ---- */

static PyObject *rt_set_device(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    RT_BEGIN("set_device", 1);
    bool bad = false;
    int32_t dev = 0;
    RT_ARG(arg_i32, 0, "device_id", dev);
    if (bad)
        return ret_or_init_error(ACL_ERROR_RT_INVALID_DEVICEID);
    return ret_or_init_error(aclrtSetDevice(dev));
}

static PyObject *rt_reset_device(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    RT_BEGIN("reset_device", 1);
    bool bad = false;
    int32_t dev = 0;
    RT_ARG(arg_i32, 0, "device_id", dev);
    if (bad)
        return ret_or_init_error(ACL_ERROR_RT_INVALID_DEVICEID);
    aclError rc;
    CALL_NOGIL(rc = aclrtResetDevice(dev));
    return ret_or_init_error(rc);
}

static PyObject *rt_get_device(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    RT_BEGIN("get_device", 0);
    (void)args;
    int32_t dev = 0;
    aclError rc = aclrtGetDevice(&dev);
    return ret_i64(dev, rc);
}

static PyObject *rt_get_device_count(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    RT_BEGIN("get_device_count", 0);
    (void)args;
    uint32_t count = 0;
    aclError rc = aclrtGetDeviceCount(&count);
    return ret_u64(count, rc);
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
    CALL_NOGIL(rc = alloc(&p, (size_t)size, (aclrtMemMallocPolicy)policy));
    return ret_u64((uintptr_t)p, rc);
}

static PyObject *rt_malloc(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    RT_BEGIN("malloc", 2);
    return do_malloc(fn, aclrtMalloc, args);
}

static PyObject *rt_malloc_align32(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    RT_BEGIN("malloc_align32", 2);
    return do_malloc(fn, aclrtMallocAlign32, args);
}

static PyObject *rt_malloc_cached(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    RT_BEGIN("malloc_cached", 2);
    return do_malloc(fn, aclrtMallocCached, args);
}

static PyObject *rt_free(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    RT_BEGIN("free", 1);
    bool bad = false;
    void *p = NULL;
    RT_ARG(arg_ptr, 0, "dev_ptr", p);
    if (bad)
        return ret_or_init_error(ACL_ERROR_RT_MEMORY_FREE);
    aclError rc;
    CALL_NOGIL(rc = aclrtFree(p));
    return ret_or_init_error(rc);
}

#define RT_METHOD(name) {#name, (PyCFunction)(void (*)(void))rt_##name, METH_FASTCALL, NULL}

static PyMethodDef rt_methods[] = {
    RT_METHOD(set_device),
    RT_METHOD(reset_device),
    RT_METHOD(get_device),
    RT_METHOD(get_device_count),
    RT_METHOD(malloc),
    RT_METHOD(malloc_align32),
    RT_METHOD(malloc_cached),
    RT_METHOD(free),
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef rt_def = {
    PyModuleDef_HEAD_INIT, "npualloc.acl.rt", "pyACL runtime functions (acl.rt).", -1, rt_methods,
    NULL, NULL, NULL, NULL,
};

PyObject *acl_rt_module_create(void) { return PyModule_Create(&rt_def); }
