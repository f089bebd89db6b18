/* va_space.c - the device address window (see va_space.h). */
#include "va_space.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "avl.h"
#include "common.h"
#include "host.h"
#include "device.h"
#include "npualloc.h"

/* A free range, in both trees of its slice: by address (for merging) and by (size, address)
 * (best fit). */
typedef struct free_range {
    avl_node by_addr;
    avl_node by_size;
    uintptr_t start;
    size_t size;
} free_range;

typedef struct va_slice {
    avl_tree by_addr, by_size;
} va_slice;

#define DEFAULT_WINDOW ((size_t)32 << 40)
#define PREFERRED_BASE ((uintptr_t)32 << 40)

static struct {
    pthread_mutex_t lock;
    _Atomic uintptr_t base; /* read without the lock by va_device_of */
    _Atomic size_t size;
    /* ceil(2^64 / (slice size / VA_UNIT)), 0 while there is no window: va_device_of finds a
     * slice with a multiply instead of a 64-bit division (tens of cycles, on every free). */
    _Atomic uint64_t slice_reciprocal;
    int slice_count;
    va_slice slices[NPU_MAX_DEVICES];
} va = {.lock = PTHREAD_MUTEX_INITIALIZER};

static int addr_order(const avl_node *a, const avl_node *b)
{
    uintptr_t x = AVL_ENTRY(a, free_range, by_addr)->start, y = AVL_ENTRY(b, free_range, by_addr)->start;
    return (x > y) - (x < y);
}

static int addr_key(const void *key, const avl_node *n)
{
    uintptr_t x = *(const uintptr_t *)key, y = AVL_ENTRY(n, free_range, by_addr)->start;
    return (x > y) - (x < y);
}

static int size_order(const avl_node *a, const avl_node *b)
{
    const free_range *x = AVL_ENTRY(a, free_range, by_size), *y = AVL_ENTRY(b, free_range, by_size);
    if (x->size != y->size)
        return x->size < y->size ? -1 : 1;
    return (x->start > y->start) - (x->start < y->start);
}

/* Key: the smallest range of at least `size` bytes. */
static int size_key(const void *key, const avl_node *n)
{
    size_t want = *(const size_t *)key;
    const free_range *r = AVL_ENTRY(n, free_range, by_size);
    return want <= r->size ? -1 : 1;
}

static void range_insert(va_slice *sl, free_range *r)
{
    avl_insert(&sl->by_addr, &r->by_addr, addr_order);
    avl_insert(&sl->by_size, &r->by_size, size_order);
}

static void range_remove(va_slice *sl, free_range *r)
{
    avl_remove(&sl->by_addr, &r->by_addr);
    avl_remove(&sl->by_size, &r->by_size);
}

/* NPUALLOC_VA_SPACE: a size of at least 1 GiB (so that 64 device slices get 8 units each) and
 * at most 128 TiB (a 47-bit user address space).  False when the text is not one. */
static bool parse_window(const char *text, size_t *out)
{
    uint64_t v;
    if (npualloc_parse_size(text, &v) != 0 || v < ((uint64_t)1 << 30) || v > ((uint64_t)128 << 40))
        return false;
    *out = round_up((size_t)v, VA_UNIT);
    return true;
}

bool va_space_check_env(char *err, size_t errlen)
{
    const char *env = getenv("NPUALLOC_VA_SPACE");
    size_t size;
    if (!env || !*env || parse_window(env, &size))
        return true;
    snprintf(err, errlen, "NPUALLOC_VA_SPACE='%s' is not a window size: use a size from 1GiB to 128TiB", env);
    return false;
}

static size_t window_size(void)
{
    const char *env = getenv("NPUALLOC_VA_SPACE");
    size_t size;
    return env && *env && parse_window(env, &size) ? size : DEFAULT_WINDOW;
}

/* Reserves the window on first use and splits it into device slices (lock held). */
static int ensure_window(void)
{
    if (va.base)
        return 0;
    int slices = device_count() > 0 ? device_count() : 1;
    size_t size = window_size();
    void *base = NULL;
    int err = host_reserve(size, VA_UNIT, (void *)PREFERRED_BASE, &base);
    /* Taken (or under a sanitizer's shadow): let the kernel choose, shrinking if needed. */
    while (err && size >= ((size_t)slices << 30)) {
        err = host_reserve(size, VA_UNIT, NULL, &base);
        if (err)
            size /= 2;
    }
    if (err)
        return err;
    size_t slice = size / (size_t)slices / VA_UNIT * VA_UNIT;
    for (int i = 0; i < slices; i++) {
        free_range *r = malloc(sizeof *r);
        if (!r) {
            for (int j = 0; j < i; j++) {
                free_range *x = AVL_ENTRY(va.slices[j].by_addr.root, free_range, by_addr);
                range_remove(&va.slices[j], x);
                free(x);
            }
            host_release(base, size);
            return ENOMEM;
        }
        avl_init(&va.slices[i].by_addr);
        avl_init(&va.slices[i].by_size);
        r->start = (uintptr_t)base + (size_t)i * slice;
        r->size = slice;
        range_insert(&va.slices[i], r);
    }
    va.slice_count = slices;
    size_t units = slice / VA_UNIT; /* at least 8: a window of 1 GiB or more, 64 devices at most */
    atomic_store(&va.slice_reciprocal, UINT64_MAX / units + 1);
    atomic_store(&va.size, slice * (size_t)slices);
    atomic_store(&va.base, (uintptr_t)base);
    return 0;
}

int32_t va_device_of(uintptr_t a)
{
    uintptr_t base = atomic_load(&va.base);
    size_t size = atomic_load(&va.size);
    if (a - base >= size)
        return -1;
    uint64_t reciprocal = atomic_load(&va.slice_reciprocal);
    if (unlikely(!reciprocal))
        return -1; /* the window is going away */
    /* Exact: with x = offset / VA_UNIT and d slice units, x * d < 2^64 (both below 2^27: the
     * window lies in the 47-bit user address space), so
     * floor(x * ceil(2^64 / d) / 2^64) = floor(x / d), and the base and slices are VA_UNIT-aligned. */
    uint64_t x = (uint64_t)(a - base) / VA_UNIT;
    return (int32_t)(((unsigned __int128)x * reciprocal) >> 64);
}

/* Carves [start, start + size) out of free range r of slice sl (lock held). */
static int carve(va_slice *sl, free_range *r, uintptr_t start, size_t size)
{
    uintptr_t end = start + size, r_end = r->start + r->size;
    free_range *tail = NULL;
    if (end < r_end && !(tail = malloc(sizeof *tail)))
        return ENOMEM;
    range_remove(sl, r);
    if (tail) {
        tail->start = end;
        tail->size = r_end - end;
        range_insert(sl, tail);
    }
    if (start > r->start) {
        r->size = start - r->start;
        range_insert(sl, r);
    } else {
        free(r);
    }
    return 0;
}

int va_alloc(int32_t device, size_t size, size_t align, uintptr_t at, uintptr_t *out)
{
    if (size == 0 || align < VA_UNIT || (align & (align - 1)) || size > ((size_t)1 << 62))
        return EINVAL;
    size = round_up(size, VA_UNIT);
    pthread_mutex_lock(&va.lock);
    int err = ensure_window();
    if (err) {
        pthread_mutex_unlock(&va.lock);
        return err;
    }
    if (at) {
        err = EEXIST;
        int32_t dev = va_device_of(at);
        avl_node *n = dev >= 0 ? avl_floor(&va.slices[dev].by_addr, &at, addr_key) : NULL;
        if (n && at % VA_UNIT == 0) {
            free_range *r = AVL_ENTRY(n, free_range, by_addr);
            if (at - r->start < r->size && size <= r->size - (at - r->start))
                err = carve(&va.slices[dev], r, at, size);
        }
        if (!err)
            *out = at;
        pthread_mutex_unlock(&va.lock);
        return err;
    }
    va_slice *sl = &va.slices[device >= 0 && device < va.slice_count ? device : 0];
    /* Best fit: walk ranges from the smallest that could fit, until one fits aligned. */
    err = ENOMEM;
    for (avl_node *n = avl_ceil(&sl->by_size, &size, size_key); n; n = avl_next(n)) {
        free_range *r = AVL_ENTRY(n, free_range, by_size);
        uintptr_t start = (r->start + align - 1) & ~(uintptr_t)(align - 1);
        if (start - r->start <= r->size && size <= r->size - (start - r->start)) {
            err = carve(sl, r, start, size);
            if (!err)
                *out = start;
            break;
        }
    }
    pthread_mutex_unlock(&va.lock);
    return err;
}

void va_free(uintptr_t start, size_t size)
{
    size = round_up(size, VA_UNIT);
    pthread_mutex_lock(&va.lock);
    int32_t dev = va_device_of(start);
    if (dev < 0) {
        pthread_mutex_unlock(&va.lock);
        return;
    }
    va_slice *sl = &va.slices[dev];
    /* Merge with the free neighbours on both sides. */
    free_range *p = NULL, *nx = NULL;
    avl_node *n = avl_floor(&sl->by_addr, &start, addr_key);
    if (n && AVL_ENTRY(n, free_range, by_addr)->start + AVL_ENTRY(n, free_range, by_addr)->size == start)
        p = AVL_ENTRY(n, free_range, by_addr);
    uintptr_t end = start + size;
    if ((n = avl_find(&sl->by_addr, &end, addr_key)) != NULL)
        nx = AVL_ENTRY(n, free_range, by_addr);
    if (p && nx) {
        range_remove(sl, p);
        range_remove(sl, nx);
        p->size += size + nx->size;
        free(nx);
        range_insert(sl, p);
    } else if (p) {
        range_remove(sl, p);
        p->size += size;
        range_insert(sl, p);
    } else if (nx) {
        range_remove(sl, nx);
        nx->start = start;
        nx->size += size;
        range_insert(sl, nx);
    } else {
        free_range *r = malloc(sizeof *r);
        if (r) { /* without a node the range is lost to reuse, never handed out twice */
            r->start = start;
            r->size = size;
            range_insert(sl, r);
        }
    }
    pthread_mutex_unlock(&va.lock);
}

bool va_overlaps(uintptr_t a, size_t n)
{
    uintptr_t base = atomic_load(&va.base);
    size_t size = atomic_load(&va.size);
    return size && n && a < base + size && a + n > base;
}

void va_window(uintptr_t *base, size_t *size)
{
    *base = atomic_load(&va.base);
    *size = atomic_load(&va.size);
}

static void forget_ranges(void)
{
    for (int i = 0; i < va.slice_count; i++) {
        va_slice *sl = &va.slices[i];
        while (sl->by_addr.root) {
            free_range *r = AVL_ENTRY(sl->by_addr.root, free_range, by_addr);
            range_remove(sl, r);
            free(r);
        }
    }
    va.slice_count = 0;
    atomic_store(&va.base, 0);
    atomic_store(&va.size, 0);
    atomic_store(&va.slice_reciprocal, 0);
}

void va_atfork_prepare(void) { pthread_mutex_lock(&va.lock); }
void va_atfork_parent(void) { pthread_mutex_unlock(&va.lock); }

void va_atfork_child(void)
{
    pthread_mutex_unlock(&va.lock); /* taken by this thread in prepare */
    forget_ranges();
}

void va_shutdown(void)
{
    pthread_mutex_lock(&va.lock);
    uintptr_t base = atomic_load(&va.base);
    if (base)
        host_release((void *)base, atomic_load(&va.size));
    forget_ranges();
    pthread_mutex_unlock(&va.lock);
}
