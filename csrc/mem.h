/*
 * mem.h - plain memory functions (aclrtMalloc family, pinned host memory, memset, memcpy);
 * the aclrt* functions themselves are declared in acl_rt.h.  Pinned host memory is ordinary
 * host memory, so a child created by fork() keeps it.
 */
#ifndef NPUALLOC_MEM_H
#define NPUALLOC_MEM_H

#include <stddef.h>

#include "acl_rt.h"
#include "vmm.h"

/* With the registry read lock held, after the ranges were checked (`dc`/`sc`: their classes):
 * copies (memmove semantics) or sets the bytes.  Device and pinned host memory are accessed
 * directly; other host memory through the kernel, so a bad host address is
 * ACL_ERROR_RT_PARAM_INVALID rather than a fault. */
aclError mem_move_locked(void *dst, range_class dc, const void *src, range_class sc, size_t count);
aclError mem_set_locked(void *dst, range_class dc, int value, size_t count);

void mem_atfork_prepare(void);
void mem_atfork_parent(void);
void mem_atfork_child(void);
/* Frees every pinned host block. */
void mem_shutdown(void);

#endif
