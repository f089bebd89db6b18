/* common.h - small helpers shared by every npualloc source file. */
#ifndef NPUALLOC_COMMON_H
#define NPUALLOC_COMMON_H

#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define likely(x) __builtin_expect(!!(x), 1)
#define unlikely(x) __builtin_expect(!!(x), 0)
/* For the few hot-path helpers the compiler would keep out of line: a call there costs more than
 * the work (saved registers, moved arguments). */
#define ALWAYS_INLINE inline __attribute__((always_inline))
#define ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))
#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)
#define GiB ((size_t)1 << 30)

static inline size_t round_up(size_t x, size_t align) { return (x + align - 1) / align * align; }

/* True when x + y would overflow size_t. */
static inline int add_overflows(size_t x, size_t y) { return x > SIZE_MAX - y; }

/* Reads environment variable `name` as a whole decimal number from min to max: 1 with *out set,
 * 0 when it is unset or empty, -1 when it is anything else (malformed). */
static inline int env_whole_number(const char *name, long min, long max, long *out)
{
    const char *text = getenv(name);
    if (!text || !*text)
        return 0;
    if (!(*text >= '0' && *text <= '9') && !(*text == '-' && min < 0))
        return -1; /* strtol would also take leading spaces and a '+' */
    char *end;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (end == text || *end != '\0' || errno || v < min || v > max)
        return -1;
    *out = v;
    return 1;
}

/* Makes room for `need` items of `elem` bytes in a growable array: `array` is the address of the
 * array's pointer (any object pointer type), *cap its capacity, which doubles from `first`.
 * False when out of memory or the size would overflow; the array is then unchanged.  The
 * pointer is read and written with memcpy, not through a void ** (which would break aliasing). */
static inline bool array_reserve(void *array, size_t *cap, size_t need, size_t elem, size_t first)
{
    if (need <= *cap)
        return true;
    size_t n = *cap ? *cap : first;
    while (n < need) {
        if (n > SIZE_MAX / 2)
            return false;
        n *= 2;
    }
    if (n > SIZE_MAX / elem)
        return false;
    void *items, *grown;
    memcpy(&items, array, sizeof items);
    if (!(grown = realloc(items, n * elem)))
        return false; /* the old array stays in place */
    memcpy(array, &grown, sizeof grown);
    *cap = n;
    return true;
}
#define ARRAY_RESERVE(arr, cap, need, first) array_reserve(&(arr), &(cap), (need), sizeof *(arr), (first))

#include "sanitizer.h"
#if defined(NPUALLOC_TSAN)
#include <sanitizer/tsan_interface.h>
#endif

/* In a fork child: the child's copy of an rwlock that the fork's prepare handler write-locked.
 * A mutex taken there is simply unlocked in the child, but this cannot be: glibc identifies an
 * rwlock's writer by thread id, the child's thread has a new one, and its unlock would release a
 * read lock instead.  So the lock is initialised again (what glibc itself does with its locks in
 * a child); ThreadSanitizer, which cannot see that, is told that this thread unlocked it. */
static inline void rwlock_reset_in_child(pthread_rwlock_t *lock)
{
#if defined(NPUALLOC_TSAN)
    __tsan_mutex_pre_unlock(lock, 0);
    __tsan_mutex_post_unlock(lock, 0);
#endif
    pthread_rwlock_init(lock, NULL);
}

#endif
