/*
 * context.h - explicit contexts (context.c): the aclrt*Context calls are in acl_rt.h; this is their
 * lifetime with the process's (fork, shutdown).
 */
#ifndef NPUALLOC_CONTEXT_H
#define NPUALLOC_CONTEXT_H

/* fork(): the child has no contexts (a thread bound to one there has no current context). */
void context_atfork_prepare(void);
void context_atfork_parent(void);
void context_atfork_child(void);
/* Ends every context (npualloc_shutdown). */
void context_shutdown(void);

#endif
