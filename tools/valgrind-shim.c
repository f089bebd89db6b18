/* valgrind-shim.c - LD_PRELOAD'ed into the C tests under valgrind (make valgrind), never into
 * anything else.
 *
 * npualloc maps device memory with mremap(home, 0, size, MREMAP_MAYMOVE | MREMAP_FIXED, va):
 * with an old size of 0, Linux makes a second mapping of the same shared pages.  Valgrind does
 * not implement that form (it fails with EINVAL), so under valgrind no device memory could be
 * mapped.  This shim turns exactly that call into its equivalent: open the home mapping's
 * memory file through /proc/self/map_files and mmap it at the target address (same pages, same
 * protection, MAP_SHARED).  Every other mremap goes to the kernel unchanged. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
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
