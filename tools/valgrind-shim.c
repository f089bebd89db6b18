/* valgrind-shim.c - LD_PRELOAD'ed into the C tests under valgrind (make valgrind), never into
 * anything else.
 *
 * npualloc maps device memory with mremap(home, 0, size, MREMAP_MAYMOVE | MREMAP_FIXED, va):
 * with an old size of 0, Linux makes a second mapping of the same shared pages.  Valgrind does
 * not implement that form (it fails with EINVAL), so under valgrind no device memory could be
 * mapped.  This shim turns exactly that call into its equivalent: open the home mapping's
 * memory file through /proc/self/map_files and mmap it at the target address (same pages, same
 * protection, MAP_SHARED).  Every other mremap goes to the kernel unchanged.  It also stands in
 * for MADV_DONTFORK in fork children (below). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

void *mremap(void *old_address, size_t old_size, size_t new_size, int flags, ...)
{
    void *new_address = NULL;
    if (flags & MREMAP_FIXED) {
        va_list ap;
        va_start(ap, flags);
        new_address = va_arg(ap, void *);
        va_end(ap);
    }
    if (old_size == 0 && (flags & MREMAP_FIXED)) {
        char path[96];
        snprintf(path, sizeof path, "/proc/self/map_files/%lx-%lx", (unsigned long)(uintptr_t)old_address,
                 (unsigned long)((uintptr_t)old_address + new_size));
        int fd = open(path, O_RDWR | O_CLOEXEC);
        if (fd < 0)
            return MAP_FAILED;
        /* the home view is PROT_NONE; npualloc mprotects the new view itself */
        void *p = mmap(new_address, new_size, PROT_NONE, MAP_SHARED | MAP_FIXED, fd, 0);
        int err = errno;
        close(fd);
        errno = err;
        return p;
    }
    return (void *)syscall(SYS_mremap, old_address, old_size, new_size, flags, new_address);
}

/* Valgrind does not model MADV_DONTFORK either: in a fork child it still counts the ranges the
 * kernel left out (npualloc's device window) as mapped, places the child's new window elsewhere,
 * and its leak check at the child's exit reads the parent's device memory page fault by page
 * fault (minutes per child).  The shim keeps the ranges given MADV_DONTFORK and not unmapped
 * since, and unmaps them in the child, which tells valgrind what the kernel already did.  (A range
 * mapped over with MAP_FIXED keeps its entry; npualloc advises every such mapping again.)
 * Unmapping there is safe only because valgrind still believes the ranges taken: it places no
 * other mapping in them. */
enum { MAX_RANGES = 65536 };
static struct range {
    uintptr_t start, end;
} dontfork[MAX_RANGES];
static int ranges;
static pthread_mutex_t ranges_lock = PTHREAD_MUTEX_INITIALIZER;

static void remember(uintptr_t start, uintptr_t end)
{
    for (int i = 0; i < ranges; i++)
        if (dontfork[i].start <= start && end <= dontfork[i].end)
            return; /* a mapping inside the window */
    if (ranges < MAX_RANGES)
        dontfork[ranges++] = (struct range){start, end};
}

static void forget(uintptr_t start, uintptr_t end)
{
    for (int i = 0; i < ranges; i++) {
        struct range *r = &dontfork[i];
        if (end <= r->start || r->end <= start)
            continue;
        if (start <= r->start && r->end <= end) { /* gone whole: the last entry takes its place */
            dontfork[i--] = dontfork[--ranges];
            continue;
        }
        if (r->start < start && end < r->end && ranges < MAX_RANGES) /* a hole: two pieces */
            dontfork[ranges++] = (struct range){end, r->end};
        if (r->start < start)
            r->end = start;
        else
            r->start = end;
    }
}

int madvise(void *addr, size_t len, int advice)
{
    int rc = (int)syscall(SYS_madvise, addr, len, advice);
    if (rc == 0 && advice == MADV_DONTFORK) {
        pthread_mutex_lock(&ranges_lock);
        remember((uintptr_t)addr, (uintptr_t)addr + len);
        pthread_mutex_unlock(&ranges_lock);
    }
    return rc;
}

int munmap(void *addr, size_t len)
{
    int rc = (int)syscall(SYS_munmap, addr, len);
    if (rc == 0) {
        pthread_mutex_lock(&ranges_lock);
        forget((uintptr_t)addr, (uintptr_t)addr + len);
        pthread_mutex_unlock(&ranges_lock);
    }
    return rc;
}

static void lock_ranges(void) { pthread_mutex_lock(&ranges_lock); }
static void unlock_ranges(void) { pthread_mutex_unlock(&ranges_lock); }

static void unmap_in_child(void)
{
    for (int i = 0; i < ranges; i++)
        syscall(SYS_munmap, dontfork[i].start, dontfork[i].end - dontfork[i].start);
    ranges = 0;
    pthread_mutex_unlock(&ranges_lock);
}

__attribute__((constructor)) static void install_fork_handlers(void)
{
    pthread_atfork(lock_ranges, unlock_ranges, unmap_in_child);
}
