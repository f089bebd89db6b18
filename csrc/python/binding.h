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

/* Creates the acl.rt submodule (a module object named "npualloc._C.rt"). */
PyObject *acl_rt_module_create(void);
/* Creates the module behind acl.init, acl.finalize and acl.util ("npualloc._C.acl"). */
PyObject *acl_util_module_create(void);

#endif
