/* pyarg.c - see pyarg.h. */
#include "pyarg.h"

#include <stdarg.h>
#include <string.h>

#include "npualloc.h"

/* Raises `exc` with "FN() " + the detail, in pyACL's words for an acl.rt function (pyarg.h). */
static int arg_error(PyObject *exc, const char *fn, const char *format, va_list ap)
{
    PyObject *detail = PyUnicode_FromFormatV(format, ap);
    if (!detail)
        return ARG_TYPE_ERROR;
    static const char pyacl_rt[] = "acl.rt.";
    if (strncmp(fn, pyacl_rt, sizeof pyacl_rt - 1) == 0)
        PyErr_Format(exc, "%s args parse failed: %s() %U", fn, fn, detail);
    else
        PyErr_Format(exc, "%s() %U", fn, detail);
    Py_DECREF(detail);
    return ARG_TYPE_ERROR;
}

int arg_type_error(const char *fn, const char *format, ...)
{
    va_list ap;
    va_start(ap, format);
    int rc = arg_error(PyExc_TypeError, fn, format, ap);
    va_end(ap);
    return rc;
}

int arg_value_error(const char *fn, const char *format, ...)
{
    va_list ap;
    va_start(ap, format);
    int rc = arg_error(PyExc_ValueError, fn, format, ap);
    va_end(ap);
    return rc;
}

static int type_error(PyObject *o, const char *fn, const char *arg)
{
    return arg_type_error(fn, "argument '%s' must be int, not %.80s", arg, Py_TYPE(o)->tp_name);
}

int arg_u64(PyObject *o, const char *fn, const char *arg, uint64_t *out)
{
    if (!PyIndex_Check(o))
        return type_error(o, fn, arg);
    PyObject *v = PyNumber_Index(o);
    if (!v)
        return ARG_TYPE_ERROR;
    int overflow = 0;
    long long sv = PyLong_AsLongLongAndOverflow(v, &overflow);
    int rc;
    if (overflow == 0) {
        if (sv == -1 && PyErr_Occurred()) {
            rc = ARG_TYPE_ERROR;
        } else if (sv < 0) {
            rc = ARG_OUT_OF_RANGE;
        } else {
            *out = (uint64_t)sv;
            rc = ARG_OK;
        }
    } else if (overflow < 0) {
        rc = ARG_OUT_OF_RANGE;
    } else {
        unsigned long long uv = PyLong_AsUnsignedLongLong(v);
        if (uv == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            rc = ARG_OUT_OF_RANGE;
        } else {
            *out = uv;
            rc = ARG_OK;
        }
    }
    Py_DECREF(v);
    return rc;
}

int arg_i64(PyObject *o, const char *fn, const char *arg, int64_t *out)
{
    if (!PyIndex_Check(o))
        return type_error(o, fn, arg);
    PyObject *v = PyNumber_Index(o);
    if (!v)
        return ARG_TYPE_ERROR;
    int overflow = 0;
    long long sv = PyLong_AsLongLongAndOverflow(v, &overflow);
    Py_DECREF(v);
    if (overflow)
        return ARG_OUT_OF_RANGE;
    if (sv == -1 && PyErr_Occurred())
        return ARG_TYPE_ERROR;
    *out = sv;
    return ARG_OK;
}

int arg_i32(PyObject *o, const char *fn, const char *arg, int32_t *out)
{
    int64_t v;
    int rc = arg_i64(o, fn, arg, &v);
    if (rc != ARG_OK)
        return rc;
    if (v < INT32_MIN || v > INT32_MAX)
        return ARG_OUT_OF_RANGE;
    *out = (int32_t)v;
    return ARG_OK;
}

int arg_ptr(PyObject *o, const char *fn, const char *arg, void **out)
{
    uint64_t v;
    int rc = arg_u64(o, fn, arg, &v);
    if (rc == ARG_OK)
        *out = (void *)(uintptr_t)v;
    return rc;
}

bool check_nargs(const char *fn, Py_ssize_t nargs, Py_ssize_t want)
{
    if (nargs == want)
        return true;
    arg_type_error(fn, "takes exactly %zd argument%s (%zd given)", want, want == 1 ? "" : "s", nargs);
    return false;
}

bool check_no_kwargs(const char *fn, PyObject *kwnames)
{
    if (!kwnames || PyTuple_GET_SIZE(kwnames) == 0)
        return true;
    arg_type_error(fn, "takes no keyword arguments");
    return false;
}

bool raise_init_error(aclError ret)
{
    const char *msg;
    if (ret == ACL_ERROR_UNINITIALIZE && (msg = npualloc_init_error()) != NULL) {
        PyErr_SetString(PyExc_ValueError, msg);
        return true;
    }
    return false;
}

PyObject *ret_or_init_error(aclError ret)
{
    if (raise_init_error(ret))
        return NULL;
    return PyLong_FromLong(ret);
}

PyObject *ret_u64(uint64_t value, aclError ret)
{
    if (raise_init_error(ret))
        return NULL;
    return Py_BuildValue("(Ki)", (unsigned long long)(ret == ACL_SUCCESS ? value : 0), ret);
}

PyObject *ret_i64(int64_t value, aclError ret)
{
    if (raise_init_error(ret))
        return NULL;
    return Py_BuildValue("(Li)", (long long)(ret == ACL_SUCCESS ? value : 0), ret);
}

PyObject *ret_handle(const void *handle, aclError ret) { return ret_u64((uintptr_t)handle, ret); }
