/* va_space.c - the device address window (see va_space.h). */
#include "va_space.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "avl.h"
#include "common.h"
#include "host.h"
#include "npualloc.h"

/* A free range, in both trees: by address (for merging) and by (size, address) (best fit). */
typedef struct free_range {
    avl_node by_addr;
    avl_node by_size;
    uintptr_t start;
    size_t size;
} free_range;

#define DEFAULT_WINDOW ((size_t)16 << 40)
#define PREFERRED_BASE ((uintptr_t)32 << 40)

static struct {
    pthread_mutex_t lock;
    _Atomic uintptr_t base; /* read without the lock by va_contains */
    _Atomic size_t size;
    avl_tree by_addr, by_size;
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

static void range_insert(free_range *r)
{
    avl_insert(&va.by_addr, &r->by_addr, addr_order);
    avl_insert(&va.by_size, &r->by_size, size_order);
}

static void range_remove(free_range *r)
{
    avl_remove(&va.by_addr, &r->by_addr);
    avl_remove(&va.by_size, &r->by_size);
}

static size_t window_size(void)
{
    const char *env = getenv("NPUALLOC_VA_SPACE");
    uint64_t v;
    if (env && *env && npualloc_parse_size(env, &v) == 0 && v >= ((uint64_t)1 << 30))
        return round_up((size_t)v, VA_UNIT);
    return DEFAULT_WINDOW;
}

/* Reserves the window on first use (lock held). */
static int ensure_window(void)
{
    if (va.base)
        return 0;
    size_t size = window_size();
    void *base = NULL;
    int err = host_reserve(size, VA_UNIT, (void *)PREFERRED_BASE, &base);
    /* Taken (or under a sanitizer's shadow): let the kernel choose, shrinking if needed. */
    while (err && size >= ((size_t)1 << 30)) {
        err = host_reserve(size, VA_UNIT, NULL, &base);
        if (err)
            size /= 2;
    }
    if (err)
        return err;
    free_range *all = malloc(sizeof *all);
    if (!all) {
        host_release(base, size);
        return ENOMEM;
    }
    va.base = (uintptr_t)base;
    va.size = size;
    avl_init(&va.by_addr);
    avl_init(&va.by_size);
    all->start = va.base;
    all->size = size;
    range_insert(all);
    return 0;
}

/* Carves [start, start + size) out of free range r (lock held). */
static int carve(free_range *r, uintptr_t start, size_t size)
{
    uintptr_t end = start + size, r_end = r->start + r->size;
    free_range *tail = NULL;
    if (end < r_end && !(tail = malloc(sizeof *tail)))
        return ENOMEM;
    range_remove(r);
    if (tail) {
        tail->start = end;
        tail->size = r_end - end;
        range_insert(tail);
    }
    if (start > r->start) {
        r->size = start - r->start;
        range_insert(r);
    } else {
        free(r);
    }
    return 0;
}

int va_alloc(size_t size, size_t align, uintptr_t at, uintptr_t *out)
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
        avl_node *n = avl_floor(&va.by_addr, &at, addr_key);
        if (n && at % VA_UNIT == 0) {
            free_range *r = AVL_ENTRY(n, free_range, by_addr);
            if (at - r->start < r->size && size <= r->size - (at - r->start))
                err = carve(r, at, size);
        }
        if (!err)
            *out = at;
        pthread_mutex_unlock(&va.lock);
        return err;
    }
    /* Best fit: walk ranges from the smallest that could fit, until one fits aligned. */
    err = ENOMEM;
    for (avl_node *n = avl_ceil(&va.by_size, &size, size_key); n; n = avl_next(n)) {
        free_range *r = AVL_ENTRY(n, free_range, by_size);
        uintptr_t start = (r->start + align - 1) & ~(uintptr_t)(align - 1);
        if (start - r->start <= r->size && size <= r->size - (start - r->start)) {
            err = carve(r, start, size);
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
    /* Merge with the free neighbours on both sides. */
    free_range *p = NULL, *nx = NULL;
    avl_node *n = avl_floor(&va.by_addr, &start, addr_key);
    if (n && AVL_ENTRY(n, free_range, by_addr)->start + AVL_ENTRY(n, free_range, by_addr)->size == start)
        p = AVL_ENTRY(n, free_range, by_addr);
    uintptr_t end = start + size;
    if ((n = avl_find(&va.by_addr, &end, addr_key)) != NULL)
        nx = AVL_ENTRY(n, free_range, by_addr);
    if (p && nx) {
        range_remove(p);
        range_remove(nx);
        p->size += size + nx->size;
        free(nx);
        range_insert(p);
    } else if (p) {
        range_remove(p);
        p->size += size;
        range_insert(p);
    } else if (nx) {
        range_remove(nx);
        nx->start = start;
        nx->size += size;
        range_insert(nx);
    } else {
        free_range *r = malloc(sizeof *r);
        if (r) { /* without a node the range is lost to reuse, never handed out twice */
            r->start = start;
            r->size = size;
            range_insert(r);
        }
    }
    pthread_mutex_unlock(&va.lock);
}

bool va_contains(uintptr_t a) { return a - atomic_load(&va.base) < atomic_load(&va.size); }

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
    while (va.by_addr.root) {
        free_range *r = AVL_ENTRY(va.by_addr.root, free_range, by_addr);
        range_remove(r);
        free(r);
    }
    va.base = 0;
    va.size = 0;
}

void va_atfork_prepare(void) { pthread_mutex_lock(&va.lock); }
void va_atfork_parent(void) { pthread_mutex_unlock(&va.lock); }

void va_atfork_child(void)
{
    pthread_mutex_init(&va.lock, NULL);
    forget_ranges();
}

void va_shutdown(void)
{
    pthread_mutex_lock(&va.lock);
    if (va.base)
        host_release((void *)va.base, va.size);
    forget_ranges();
    pthread_mutex_unlock(&va.lock);
}
