/*
 * binding.h - pieces of the npualloc._C extension, one file per face:
 *   module.c      module init and the npualloc-level functions (configure, introspection)
 *   acl_rt_py.c   the pyACL face: the acl.rt submodule
 *   acl_util_py.c the pyACL face: acl.init / acl.finalize and the C half of acl.util
 */
#ifndef NPUALLOC_BINDING_H
#define NPUALLOC_BINDING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdatomic.h>

/* The GIL around calls that may take a device's allocator lock, or wait for one who holds it (memory_py.c
 * explains): every call that releases the GIL counts itself in binding_gil_waiters while it runs, and while
 * any does, every other allocator call releases the GIL too (LOCKING_CALL, memory_py.c).  A call that
 * released the GIL uncounted let another thread keep the GIL while it waited for the lock that call held,
 * and a Python pool allocator under that lock then waited for the GIL for ever. */
extern atomic_int binding_gil_waiters;

#define WAITING_CALL(stmt)                                                                                         \
    do {                                                                                                           \
        atomic_fetch_add(&binding_gil_waiters, 1);                                                                 \
        Py_BEGIN_ALLOW_THREADS stmt;                                                                               \
        Py_END_ALLOW_THREADS                                                                                       \
        atomic_fetch_sub(&binding_gil_waiters, 1);                                                                 \
    } while (0)

/* Creates the acl.rt submodule (a module object named "npualloc._C.rt"). */
PyObject *acl_rt_module_create(void);
/* Creates the module behind acl.init, acl.finalize and acl.util ("npualloc._C.acl"). */
PyObject *acl_util_module_create(void);

#endif
