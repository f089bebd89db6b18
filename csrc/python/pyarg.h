/*
 * pyarg.h - argument conversion shared by the binding's faces.
 *
 * pyACL convention: a wrong Python type raises TypeError naming the function and the
 * argument; a value of the right type that is out of range is not an exception but an ACL
 * error code returned to the caller.
 */
#ifndef NPUALLOC_PYARG_H
#define NPUALLOC_PYARG_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdbool.h>
#include <stdint.h>

#include "acl_rt.h"

/* Results of a conversion. */
enum { ARG_TYPE_ERROR = -1, ARG_OUT_OF_RANGE = 0, ARG_OK = 1 };

/* Converts an int (or __index__) argument to uint64 / int64 / int32. */
int arg_u64(PyObject *o, const char *fn, const char *arg, uint64_t *out);
int arg_i64(PyObject *o, const char *fn, const char *arg, int64_t *out);
int arg_i32(PyObject *o, const char *fn, const char *arg, int32_t *out);
/* A pointer or handle: an int in [0, 2**64). */
int arg_ptr(PyObject *o, const char *fn, const char *arg, void **out);

/* Raises TypeError "FN() " + the detail (formatted as PyUnicode_FromFormat does) and returns
 * ARG_TYPE_ERROR.  A function of pyACL's acl.rt face (fn "acl.rt.NAME") words it as pyACL does,
 * "acl.rt.NAME args parse failed", followed by ": " and npualloc's message.  The converters, the
 * argument checks below and the acl.rt bindings raise every argument TypeError with it. */
int arg_type_error(const char *fn, const char *format, ...);
/* The same words as a ValueError: an argument of the right type that cannot be parsed (a str that
 * is no C string). */
int arg_value_error(const char *fn, const char *format, ...);

/* TypeError unless exactly `want` positional arguments were given. */
bool check_nargs(const char *fn, Py_ssize_t nargs, Py_ssize_t want);
/* TypeError when keyword arguments were given (kwnames of a METH_FASTCALL | METH_KEYWORDS call). */
bool check_no_kwargs(const char *fn, PyObject *kwnames);

/* Returns `ret` as a Python int, or raises ValueError when the runtime could not start
 * because of a malformed NPUALLOC_* environment (not a bad argument of this call). */
PyObject *ret_or_init_error(aclError ret);
/* (value, ret) tuples. */
PyObject *ret_u64(uint64_t value, aclError ret);
PyObject *ret_i64(int64_t value, aclError ret);
/* (handle, ret): a handle or pointer as pyACL's int. */
PyObject *ret_handle(const void *handle, aclError ret);
/* Raises ValueError for a failed runtime start; returns true if it did. */
bool raise_init_error(aclError ret);

#endif
