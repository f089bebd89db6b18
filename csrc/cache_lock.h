/*
 * cache_lock.h - the lock of one device cache: an atomic word, with a futex to sleep on.
 *
 * Why not pthread_mutex_t: a cache hit takes and drops the lock once, and glibc's mutex costs
 * about 55 instructions per lock/unlock pair (two calls, type and owner checks); uncontended,
 * this lock is one atomic instruction each way, inlined.  Contended, a waiter spins briefly,
 * then sleeps in the kernel, as Drepper's "Futexes Are Tricky" (mutex 3) does it.  Not
 * recursive; no owner checks.
 *
 * State: 0 free, 1 held, 2 held and someone may be sleeping (unlock must wake one).
 */
#ifndef NPUALLOC_CACHE_LOCK_H
#define NPUALLOC_CACHE_LOCK_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

typedef struct cache_lock {
    _Atomic uint32_t state;
} cache_lock;

/* The sleeping half (cache_lock.c), out of line: the fast paths stay small. */
void cache_lock_wait(cache_lock *l);
void cache_lock_wake(cache_lock *l);

/* Also after fork in the child, whatever state the parent's threads left it in. */
static inline void cache_lock_init(cache_lock *l) { atomic_store_explicit(&l->state, 0, memory_order_relaxed); }

static inline void cache_lock_acquire(cache_lock *l)
{
    uint32_t expected = 0;
    if (__builtin_expect(!atomic_compare_exchange_strong_explicit(&l->state, &expected, 1, memory_order_acquire,
                                                                  memory_order_relaxed),
                         0))
        cache_lock_wait(l);
}

static inline bool cache_lock_try(cache_lock *l)
{
    uint32_t expected = 0;
    return atomic_compare_exchange_strong_explicit(&l->state, &expected, 1, memory_order_acquire,
                                                   memory_order_relaxed);
}

static inline void cache_lock_release(cache_lock *l)
{
    if (__builtin_expect(atomic_exchange_explicit(&l->state, 0, memory_order_release) == 2, 0))
        cache_lock_wake(l);
}

#endif
