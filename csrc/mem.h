/*
 * mem.h - plain memory functions (aclrtMalloc family, pinned host memory, memset, memcpy);
 * the aclrt* functions themselves are declared in acl_rt.h.  Pinned host memory is ordinary
 * host memory, so a child created by fork() keeps it.
 */
#ifndef NPUALLOC_MEM_H
#define NPUALLOC_MEM_H

#include <stddef.h>

/* Live aclrtMallocHost blocks (for tests and leak checks). */
size_t mem_host_blocks_live(void);

void mem_atfork_prepare(void);
void mem_atfork_parent(void);
void mem_atfork_child(void);
/* Frees every pinned host block. */
void mem_shutdown(void);

#endif
