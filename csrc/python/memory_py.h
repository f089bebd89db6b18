/*
 * memory_py.h - the torch_npu-like memory face: the `npualloc._C.memory` submodule
 * (caching_allocator_alloc / delete, the Buffer type, OutOfMemoryError, stats, snapshots,
 * streams and events for npualloc/streams.py, the thread's current streams).
 */
#ifndef NPUALLOC_MEMORY_PY_H
#define NPUALLOC_MEMORY_PY_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "npualloc.h"

/* Creates the submodule and adds it to `module` as `memory`.  Returns 0, or -1 with an exception set. */
int memory_py_attach(PyObject *module);

/* Views of npualloc.Buffer memory exported (a memoryview, a NumPy array) and not released yet: while
 * any is, shutdown() refuses (the GIL held). */
Py_ssize_t memory_py_buffer_views(void);

/* Raises the failure of an npualloc_cache_* call by npualloc_last_error's kind, with torch_npu's error
 * suffix where the allocator recorded one (npualloc_last_error_suffix); always NULL.  Shared with the
 * graph face (MemPool, use_mem_pool), whose pool calls fail with the same errors. */
PyObject *raise_cache_error(aclError rc);

/* _snapshot()'s "allocator_settings" dict for settings s and their text (NULL: ""); NULL with an
 * exception set on failure.  Shared with the replay sessions, whose snapshots carry their own. */
PyObject *allocator_settings_dict(const npualloc_allocator_settings *s, const char *text);

#endif
