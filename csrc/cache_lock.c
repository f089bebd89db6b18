/* cache_lock.c - the contended half of cache_lock.h. */
#include "cache_lock.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

void cache_lock_wait(cache_lock *l)
{
    /* Mark the lock contended (2) before sleeping, so the holder's unlock wakes someone; a
     * thread that gets it this way keeps it marked, since others may still be asleep. */
    while (atomic_exchange_explicit(&l->state, 2, memory_order_acquire) != 0)
        syscall(SYS_futex, &l->state, FUTEX_WAIT_PRIVATE, 2, NULL, NULL, 0);
}

void cache_lock_wake(cache_lock *l) { syscall(SYS_futex, &l->state, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0); }
