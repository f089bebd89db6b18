/*
 * replay_py.h - the trace-replay face: the `npualloc._C.replay` submodule (the Session type
 * behind npualloc/replay.py).
 */
#ifndef NPUALLOC_REPLAY_PY_H
#define NPUALLOC_REPLAY_PY_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Creates the submodule and adds it to `module` as `replay`.  Returns 0, or -1 with an
 * exception set. */
int replay_py_attach(PyObject *module);
/* replay.check_pickle(data): None when the pickle's opcodes stay within the data, else
 * ValueError (pickle_scan.c). */
PyObject *pickle_check(PyObject *self, PyObject *arg);
/* replay.check_pickle_prefix(data, start, limit): the data read so far of a stream of at most `limit`
 * bytes, checked from `start` (a previous call's resume point): (resume, stopped), where resume is the
 * start of the first opcode the data cuts off (or just past STOP, stopped True); ValueError for an
 * opcode that is wrong whatever follows (a length past the limit included). */
PyObject *pickle_check_prefix(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif
