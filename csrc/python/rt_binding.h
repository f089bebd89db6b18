/*
 * rt_binding.h - the conventions of the acl.rt functions, shared by acl_rt_py.c and ipc_py.c:
 * METH_FASTCALL functions named rt_NAME, positional arguments only, checked by count, converted with
 * pyarg.h's converters, `fn` ("acl.rt.NAME") naming the function in every TypeError, which starts with
 * pyACL's "acl.rt.NAME args parse failed: " (pyarg.h).
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

#define CALL_NOGIL(stmt)                                                                                           \
    do {                                                                                                           \
        Py_BEGIN_ALLOW_THREADS stmt;                                                                               \
        Py_END_ALLOW_THREADS                                                                                       \
    } while (0)

/* METH_KEYWORDS so that RT_BEGIN, not CPython, words the error for a keyword argument. */
#define RT_METHOD(name) {#name, (PyCFunction)(void (*)(void))rt_##name, METH_FASTCALL | METH_KEYWORDS, NULL}

#endif
