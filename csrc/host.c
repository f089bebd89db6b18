/*
 * host.c - the Linux host backend (see host.h for the model).
 */
#include "host.h"

#include "common.h"
#include "fault.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

static atomic_int fd_budget = -1; /* -1: not decided yet */
static atomic_int fds_kept;

#define MAX_FD_BUDGET ((1L << 30) - 1) /* NPUALLOC_FD_BUDGET is a whole number from 0 to this */

bool host_check_env(char *err, size_t errlen)
{
    long budget;
    if (env_whole_number("NPUALLOC_FD_BUDGET", 0, MAX_FD_BUDGET, &budget) >= 0)
        return true;
    snprintf(err, errlen, "NPUALLOC_FD_BUDGET='%s' is not a descriptor count: use a whole number from 0 to %ld",
             getenv("NPUALLOC_FD_BUDGET"), MAX_FD_BUDGET);
    return false;
}

static int default_fd_budget(void)
{
    long budget;
    if (env_whole_number("NPUALLOC_FD_BUDGET", 0, MAX_FD_BUDGET, &budget) > 0)
        return (int)budget;
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY)
        return 4096;
    return (int)(rl.rlim_cur / 2);
}

static int host_fd_budget(void)
{
    int b = atomic_load(&fd_budget);
    if (b < 0) {
        int expected = -1;
        b = default_fd_budget();
        if (!atomic_compare_exchange_strong(&fd_budget, &expected, b))
            b = expected;
    }
    return b;
}

int host_fds_kept(void) { return atomic_load(&fds_kept); }

/* Takes one unit of the descriptor budget, or reports that none is left. */
static bool take_fd_slot(void)
{
    int budget = host_fd_budget();
    int cur = atomic_load(&fds_kept);
    while (cur < budget) {
        if (atomic_compare_exchange_weak(&fds_kept, &cur, cur + 1))
            return true;
    }
    return false;
}

/* glibc answers from the auxiliary vector, without a system call: nothing to cache (a cached copy
 * written by whichever thread came first was a data race). */
static size_t host_page_size(void) { return (size_t)sysconf(_SC_PAGESIZE); }

static size_t round_to_page(size_t size)
{
    size_t page = host_page_size();
    return (size + page - 1) & ~(page - 1);
}

/* Maps the memory file's home view and marks it not to be inherited by fork. */
static int map_home(int fd, size_t size, void **home)
{
    void *p = mmap(NULL, size, PROT_NONE, MAP_SHARED | MAP_NORESERVE, fd, 0);
    if (p == MAP_FAILED)
        return errno;
    if (madvise(p, size, MADV_DONTFORK) != 0) {
        int err = errno;
        munmap(p, size);
        return err;
    }
    *home = p;
    return 0;
}

int host_memfile_create(size_t size, host_memfile *out)
{
    if (size == 0)
        return EINVAL;
    if (fault_fires(NPUALLOC_FAULT_MEMFILE))
        return EMFILE;
    size = round_to_page(size);
    /* A memory file is a file: sized beyond RLIMIT_FSIZE, ftruncate would raise SIGXFSZ, whose default
     * action kills the process.  Refused as the EFBIG that ftruncate returns when the signal is ignored. */
    struct rlimit fsize;
    if (getrlimit(RLIMIT_FSIZE, &fsize) == 0 && fsize.rlim_cur != RLIM_INFINITY && size > fsize.rlim_cur)
        return EFBIG;
    /* ALLOW_SEALING: an exporter seals the size (ipc.c), so no importer can shrink it under others */
    int fd = memfd_create("npualloc", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0)
        return errno;
    int err = 0;
    if (ftruncate(fd, (off_t)size) != 0)
        err = errno;
    void *home = NULL;
    if (!err)
        err = map_home(fd, size, &home);
    if (err) {
        close(fd);
        return err;
    }
    out->home = home;
    out->size = size;
    if (take_fd_slot()) {
        out->fd = fd;
    } else {
        close(fd); /* the home mapping keeps the pages alive */
        out->fd = -1;
    }
    return 0;
}

int host_memfile_adopt(int fd, size_t size, host_memfile *out)
{
    struct stat st; /* not lseek: the descriptor shares its file offset with the exporter's */
    if (fstat(fd, &st) != 0)
        return errno;
    if (st.st_size < 0 || (size_t)st.st_size < size || size == 0 || size % host_page_size() != 0)
        return EINVAL;
    void *home = NULL;
    int err = map_home(fd, size, &home);
    if (err)
        return err;
    out->home = home;
    out->size = size;
    if (take_fd_slot()) {
        out->fd = fd;
    } else {
        close(fd);
        out->fd = -1;
    }
    return 0;
}

void host_memfile_destroy(host_memfile *mf)
{
    if (mf->home)
        munmap(mf->home, mf->size);
    if (mf->fd >= 0) {
        close(mf->fd);
        atomic_fetch_sub(&fds_kept, 1);
    }
    mf->home = NULL;
    mf->fd = -1;
}

int host_memfile_dup_fd(const host_memfile *mf, int *fd_out)
{
    int fd;
    if (mf->fd >= 0) {
        fd = fcntl(mf->fd, F_DUPFD_CLOEXEC, 0);
    } else {
        char path[96];
        uintptr_t start = (uintptr_t)mf->home;
        snprintf(path, sizeof path, "/proc/self/map_files/%lx-%lx", (unsigned long)start,
                 (unsigned long)(start + mf->size));
        fd = open(path, O_RDWR | O_CLOEXEC);
    }
    if (fd < 0)
        return errno;
    *fd_out = fd;
    return 0;
}

int host_reserve(size_t size, size_t align, void *hint, void **out)
{
    if (size == 0 || (align & (align - 1)) != 0)
        return EINVAL;
    size_t page = host_page_size();
    if (align < page)
        align = page;
    size = round_to_page(size);
    const int prot = PROT_NONE;
    const int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
    void *base;
    if (hint) {
        if ((uintptr_t)hint % align != 0)
            return EINVAL;
        base = mmap(hint, size, prot, flags | MAP_FIXED_NOREPLACE, -1, 0);
        if (base == MAP_FAILED)
            return errno;
        if (base != hint) { /* kernels without MAP_FIXED_NOREPLACE treat it as a hint */
            munmap(base, size);
            return EEXIST;
        }
    } else {
        /* Over-reserve, then trim to the requested alignment. */
        size_t span = size + align - page;
        if (span < size)
            return ENOMEM;
        void *raw = mmap(NULL, span, prot, flags, -1, 0);
        if (raw == MAP_FAILED)
            return errno;
        uintptr_t start = ((uintptr_t)raw + align - 1) & ~(uintptr_t)(align - 1);
        size_t head = start - (uintptr_t)raw;
        size_t tail = span - head - size;
        if (head)
            munmap(raw, head);
        if (tail)
            munmap((void *)(start + size), tail);
        base = (void *)start;
    }
    if (madvise(base, size, MADV_DONTFORK) != 0) {
        int err = errno;
        munmap(base, size);
        return err;
    }
    *out = base;
    return 0;
}

int host_release(void *va, size_t size)
{
    return munmap(va, round_to_page(size)) == 0 ? 0 : errno;
}

int host_map(void *va, const host_memfile *mf)
{
    if (fault_fires(NPUALLOC_FAULT_MAP))
        return ENOMEM;
    if (mf->fd >= 0) {
        /* With the descriptor at hand, map the file directly (one call, and tools such as
         * valgrind do not support mremap's duplicate-a-mapping form). */
        void *p = mmap(va, mf->size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, mf->fd, 0);
        if (p == MAP_FAILED)
            return errno;
        if (madvise(p, mf->size, MADV_DONTFORK) != 0) {
            int err = errno;
            host_unmap(va, mf->size); /* the caller gives the range back as unmapped */
            return err;
        }
        return 0;
    }
    void *p = mremap(mf->home, 0, mf->size, MREMAP_MAYMOVE | MREMAP_FIXED, va);
    if (p == MAP_FAILED)
        return errno;
    if (mprotect(p, mf->size, PROT_READ | PROT_WRITE) != 0) {
        int err = errno;
        host_unmap(va, mf->size);
        return err;
    }
    return 0;
}

int host_protect_readonly(void *va, const host_memfile *mf, void **writable)
{
    if (mprotect(va, mf->size, PROT_READ) != 0 || mprotect(mf->home, mf->size, PROT_READ | PROT_WRITE) != 0)
        return errno;
    *writable = mf->home;
    return 0;
}

int host_unmap(void *va, size_t size)
{
    size = round_to_page(size);
    void *p = mmap(va, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    if (p == MAP_FAILED) {
        /* Above vm.max_map_count (a fixed mapping that split a reservation may leave the process one
         * above it) no mapping can be made, and the view would stay.  Removing the view's own area
         * needs none, and then the count allows the reservation back: NOREPLACE, so that a mapping
         * another thread made in the hole meanwhile is refused, not replaced. */
        int err = errno;
        if (err != ENOMEM || munmap(va, size) != 0)
            return err;
        p = mmap(va, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
        if (p == MAP_FAILED)
            return errno;
        if (p != va) { /* a kernel before 4.17 takes NOREPLACE as a hint */
            munmap(p, size);
            return EEXIST;
        }
    }
    return madvise(p, size, MADV_DONTFORK) == 0 ? 0 : errno;
}

int host_alloc_pinned(size_t size, void **out)
{
    if (size == 0)
        return EINVAL;
    if (size > SIZE_MAX - host_page_size())
        return ENOMEM;
    size_t bytes = round_to_page(size); /* whole pages are resident, so whole pages are charged */
    if (!host_pinned_charge(bytes))
        return ENOMEM;
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        int err = errno;
        host_pinned_uncharge(bytes);
        return err;
    }
    *out = p;
    return 0;
}

void host_free_pinned(void *p, size_t size)
{
    munmap(p, round_to_page(size));
    host_pinned_uncharge(round_to_page(size));
}

size_t host_ram_bytes(void)
{
    long pages = sysconf(_SC_PHYS_PAGES);
    return pages > 0 ? (size_t)pages * host_page_size() : SIZE_MAX;
}

/* Bytes of pinned host memory this process holds.  Pinned pages are resident, so together (not
 * only one by one) they cannot be more than the machine has, whatever the kernel's overcommit
 * policy would let mmap promise.  A forked child inherits the count with the memory. */
static _Atomic size_t pinned_bytes;

bool host_pinned_charge(size_t size)
{
    size_t ram = host_ram_bytes(), held = atomic_load(&pinned_bytes);
    do {
        if (size > ram - held)
            return false;
    } while (!atomic_compare_exchange_weak(&pinned_bytes, &held, held + size));
    return true;
}

void host_pinned_uncharge(size_t size) { atomic_fetch_sub(&pinned_bytes, size); }

/* ---- checked copies ---- */

#define BOUNCE_BYTES 4096 /* staging buffer for overlapping moves and memset patterns */
#define SET_IOVECS 64     /* pattern iovecs per process_vm_writev: 256 KiB per call */

/* Set when process_vm_readv/writev are refused: then memory is accessed directly. */
static atomic_bool kernel_copy_refused;

/* One kernel copy of `n` bytes from `src` to `dst`, both in this process; neither may overlap
 * the other.  `local` is the side described by the local iovecs (several, all of `local_len`
 * bytes at `local_base`, when `nlocal` > 1: a memset pattern).  `write`: local to remote,
 * else remote to local.  Returns 0, EFAULT or another errno; a partial transfer continues
 * where it stopped. */
static int kernel_copy(bool write, char *local_base, size_t local_len, size_t nlocal, char *remote, size_t n)
{
    struct iovec iov[SET_IOVECS];
    while (n) {
        size_t cnt = 0, bytes = 0;
        for (; cnt < nlocal && bytes < n; cnt++) {
            size_t len = n - bytes < local_len ? n - bytes : local_len;
            iov[cnt] = (struct iovec){.iov_base = nlocal > 1 ? local_base : local_base + bytes, .iov_len = len};
            bytes += len;
        }
        struct iovec rem = {.iov_base = remote, .iov_len = bytes};
        pid_t self = gettid(); /* a live thread of this process, unlike a leader that may have exited */
        ssize_t done = write ? process_vm_writev(self, iov, cnt, &rem, 1, 0) : process_vm_readv(self, iov, cnt, &rem, 1, 0);
        if (done < 0 && errno == EINTR)
            continue;
        if (done < 0)
            return errno;
        if (done == 0)
            return EFAULT;
        remote += done;
        n -= (size_t)done;
        if (nlocal == 1) /* (a memset pattern is the same byte throughout: any offset continues it) */
            local_base += done;
    }
    return 0;
}

static bool refused(int err)
{
    if (err != ENOSYS && err != EPERM)
        return false;
    atomic_store(&kernel_copy_refused, true);
    return true;
}

int host_move_checked(void *dst, const void *src, size_t n)
{
    char *d = dst;
    const char *s = src;
    if (atomic_load_explicit(&kernel_copy_refused, memory_order_relaxed)) {
        memmove(d, s, n);
        return 0;
    }
    if ((uintptr_t)d - (uintptr_t)s >= n && (uintptr_t)s - (uintptr_t)d >= n) { /* disjoint */
        int err = kernel_copy(false, d, n, 1, (char *)s, n);
        if (refused(err))
            return host_move_checked(dst, src, n);
        return err;
    }
    /* Overlapping: through a staging buffer, chunk by chunk, in the order memmove needs (a
     * chunk's destination only overwrites source bytes already staged). */
    char bounce[BOUNCE_BYTES];
    bool backward = d > s;
    for (size_t done = 0; done < n;) {
        size_t c = n - done < sizeof bounce ? n - done : sizeof bounce;
        size_t off = backward ? n - done - c : done;
        int err = kernel_copy(false, bounce, c, 1, (char *)s + off, c);
        if (!err)
            err = kernel_copy(true, bounce, c, 1, d + off, c);
        if (err && done == 0 && refused(err)) {
            memmove(d, s, n);
            return 0;
        }
        if (err)
            return err;
        done += c;
    }
    return 0;
}

int host_set_checked(void *dst, int value, size_t n)
{
    if (atomic_load_explicit(&kernel_copy_refused, memory_order_relaxed)) {
        memset(dst, value, n);
        return 0;
    }
    char pattern[BOUNCE_BYTES];
    memset(pattern, value, sizeof pattern);
    int err = kernel_copy(true, pattern, sizeof pattern, SET_IOVECS, dst, n);
    if (refused(err))
        return host_set_checked(dst, value, n);
    return err;
}

uint64_t host_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

uint64_t host_thread_serial(void)
{
    static atomic_uint_fast64_t threads;
    static _Thread_local uint64_t serial;
    if (!serial)
        serial = atomic_fetch_add(&threads, 1) + 1;
    return serial;
}

int64_t host_epoch_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

void host_sleep_ns(uint64_t ns)
{
    struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000u), .tv_nsec = (long)(ns % 1000000000u)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}
