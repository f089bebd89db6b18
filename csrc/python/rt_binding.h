/*
 * rt_binding.h - the conventions of the acl.rt functions, shared by acl_rt_py.c and ipc_py.c:
 * METH_FASTCALL functions named rt_NAME with a docstring rt_NAME_doc (RT_DOC), positional arguments only,
 * checked by count, converted with pyarg.h's converters, `fn` ("acl.rt.NAME") naming the function in every
 * TypeError, which starts with pyACL's "acl.rt.NAME args parse failed: " (pyarg.h).
 */
#ifndef NPUALLOC_RT_BINDING_H
#define NPUALLOC_RT_BINDING_H

#include "binding.h"
#include "pyarg.h"

/* Declares `fn`, refuses keyword arguments, checks the argument count. */
#define RT_BEGIN(name, n)                                                                                          \
    static const char fn[] = "acl.rt." name;                                                                       \
    (void)self;                                                                                                    \
    if (!check_no_kwargs(fn, kwnames) || !check_nargs(fn, nargs, (n)))                                            \
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

/* Like RT_ARG, but a value out of range becomes `sentinel`: an invalid value of the C type
 * that the C function rejects with its own code, in its own order of checks. */
#define RT_ARG_OR(conv, i, argname, var, sentinel)                                                                 \
    do {                                                                                                           \
        int conv_rc_ = conv(args[i], fn, argname, &(var));                                                         \
        if (conv_rc_ == ARG_TYPE_ERROR)                                                                            \
            return NULL;                                                                                           \
        if (conv_rc_ == ARG_OUT_OF_RANGE)                                                                          \
            (var) = (sentinel);                                                                                    \
    } while (0)

/* A pointer or handle no live object can have (handles carry a table tag in their top byte,
 * and no tag is 0xFF): lookups of it fail with the function's own "not found" code. */
#define BAD_HANDLE ((void *)(uintptr_t)UINT64_MAX)
/* An invalid device id. */
#define BAD_DEVICE (-1)

/* name() -> (value, ret) for a call with one output, of `type`, which `to_int` (ret_i64, ret_u64 or ret_handle)
 * makes the tuple of. */
#define RT_OUTPUT(name, type, call, to_int)                                                                        \
    static PyObject *rt_##name(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)         \
    {                                                                                                              \
        RT_BEGIN(#name, 0);                                                                                        \
        (void)args;                                                                                                \
        type out = 0;                                                                                              \
        aclError rc = call(&out);                                                                                  \
        return to_int(out, rc);                                                                                    \
    }

/* The docstring of acl.rt.NAME (rt_NAME_doc, which RT_METHOD takes): CPython's text signature first, which
 * help() and inspect.signature() read, positional-only ("/") because RT_BEGIN refuses keywords; then pyACL's
 * call form, "RETURNS = acl.rt.NAME(PARAMS)", made from the same PARAMS so that the two cannot disagree; then
 * `text`.  PARAMS are the names the binding's TypeErrors use.  RT_DOC0: a function of no arguments. */
#define RT_DOC(name, params, returns, text)                                                                        \
    PyDoc_STRVAR(rt_##name##_doc,                                                                                  \
                 #name "($module, " params ", /)\n--\n\n" returns " = acl.rt." #name "(" params ")\n" text)
#define RT_DOC0(name, returns, text)                                                                               \
    PyDoc_STRVAR(rt_##name##_doc, #name "($module, /)\n--\n\n" returns " = acl.rt." #name "()\n" text)

/* METH_KEYWORDS so that RT_BEGIN, not CPython, words the error for a keyword argument.  A function without an
 * RT_DOC does not compile. */
#define RT_METHOD(name)                                                                                            \
    {#name, (PyCFunction)(void (*)(void))rt_##name, METH_FASTCALL | METH_KEYWORDS, rt_##name##_doc}

#endif
