/* common.h - small helpers shared by every npualloc source file. */
#ifndef NPUALLOC_COMMON_H
#define NPUALLOC_COMMON_H

#include <stddef.h>
#include <stdint.h>

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

#endif
