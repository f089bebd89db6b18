/*
 * host.h - the host backend: the only part of npualloc that talks to the operating system
 * about memory.  Everything above it sees "memory files" (the physical memory of one handle)
 * and "reserved ranges" (virtual address space with nothing behind it).
 *
 * Model (Linux):
 *   - A memory file is an anonymous memfd, sized with ftruncate.  Its pages are committed
 *     only when touched, so a 64 GiB device costs nothing until used.
 *   - Each memory file has a "home" mapping (PROT_NONE, MAP_SHARED) that keeps its pages alive
 *     without a file descriptor; the descriptor itself is kept only while the process-wide
 *     descriptor budget allows (it is needed to export the memory to another process).
 *   - Mapping a memory file into a reserved range maps its descriptor there, or, when the
 *     descriptor was closed, duplicates the home mapping with mremap(old_size = 0).
 *   - A reserved range is PROT_NONE anonymous memory; unmapping puts PROT_NONE memory back,
 *     so the reservation stays intact and an access to an unmapped page faults.
 *   - Device memory is MADV_DONTFORK: a child created by fork() does not inherit it (a real
 *     NPU context is not inherited either).
 *
 * All functions return 0 or a positive errno value.
 */
#ifndef NPUALLOC_HOST_H
#define NPUALLOC_HOST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct host_memfile {
    void *home;  /* PROT_NONE shared mapping that keeps the pages alive */
    size_t size; /* bytes, a multiple of the host page size */
    int fd;      /* -1 when the descriptor budget was exhausted at creation */
} host_memfile;

/* Creates a memory file of `size` bytes (rounded up to the host page size). */
int host_memfile_create(size_t size, host_memfile *out);
/* Releases the home mapping and the descriptor; the pages live on while mapped elsewhere. */
void host_memfile_destroy(host_memfile *mf);
/* Adopts a descriptor received from another process (the memory file of an exporter). */
int host_memfile_adopt(int fd, size_t size, host_memfile *out);
/* Returns a new descriptor for the memory file (caller closes it): a dup of the kept one, or
 * one reopened through /proc/self/map_files when the budget had been exhausted (this needs
 * CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE: EPERM or EACCES without them).  Returns 0 or errno. */
int host_memfile_dup_fd(const host_memfile *mf, int *fd_out);

/* Reserves `size` bytes of address space aligned to `align` (a power of two).  When `hint` is
 * non-NULL the range must start exactly there (EEXIST if taken). */
int host_reserve(size_t size, size_t align, void *hint, void **out);
int host_release(void *va, size_t size);
/* Maps the whole memory file read-write at `va` (inside a reservation). */
int host_map(void *va, const host_memfile *mf);
/* Makes the view at `va` of the whole memory file (mapped there by host_map) read-only, and opens the
 * file's home view read-write instead: *writable receives it, for the writes the runtime itself does
 * (ACL_MEM_ACCESS_USER_SPACE_READONLY memory). */
int host_protect_readonly(void *va, const host_memfile *mf, void **writable);
/* Puts reserved, inaccessible memory back over [va, va + size). */
int host_unmap(void *va, size_t size);

/* Page-aligned host memory for pinned-host allocations (inherited by fork like any memory), charged
 * to the pinned count below in whole pages (ENOMEM when it would pass the machine's memory). */
int host_alloc_pinned(size_t size, void **out);
void host_free_pinned(void *p, size_t size);
/* The machine's physical memory. */
size_t host_ram_bytes(void);
/* Charges `size` bytes of pinned host memory, false when the process's pinned memory would then be
 * more than host_ram_bytes(); host_pinned_uncharge gives a charge back. */
bool host_pinned_charge(size_t size);
void host_pinned_uncharge(size_t size);

/* Copies (memmove semantics) or sets host memory that may be anything the caller passed: the
 * kernel does the access (process_vm_readv / process_vm_writev on this process), so an address
 * that is not mapped readable (source) or writable (destination) is EFAULT, not a fault.  On
 * EFAULT some bytes may have been written.  Where those system calls are refused (ENOSYS,
 * EPERM: a seccomp filter), the memory is accessed directly, unchecked. */
int host_move_checked(void *dst, const void *src, size_t n);
int host_set_checked(void *dst, int value, size_t n);

uint64_t host_now_ns(void); /* CLOCK_MONOTONIC */
/* The calling thread's serial, from 1, never reused in the process (a pthread_t is, once its thread
 * was joined): what the thread made stays its own, not a later thread's. */
uint64_t host_thread_serial(void);
int64_t host_epoch_us(void); /* microseconds since the Unix epoch (trace timestamps, as torch) */
void host_sleep_ns(uint64_t ns);

/* False (with a message naming the variable and its value) when NPUALLOC_FD_BUDGET is set and
 * malformed; the runtime then refuses to start. */
bool host_check_env(char *err, size_t errlen);

/* How many memory-file descriptors are kept open now (at most NPUALLOC_FD_BUDGET, default half of
 * the open-file limit). */
int host_fds_kept(void);

#endif
