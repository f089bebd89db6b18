/*
 * va_space.h - the device address space: one large reserved window of host address space
 * (PROT_NONE, MADV_DONTFORK) out of which every device address range is carved.
 *
 * Like a real NPU's device virtual addresses, a device address stays recognisable after the
 * memory behind it is freed: any address inside the window is device address space, and
 * anything outside it is host memory.  That is what lets memcpy reject a freed device
 * pointer with an error code instead of treating it as host memory.
 *
 * The window is NPUALLOC_VA_SPACE bytes (default 32 TiB), placed at 32 TiB when that part of
 * the address space is free (the kernel chooses otherwise).  It is split into one equal slice
 * per device, so the device of any device address is known without a lookup.  Ranges are
 * multiples of 2 MiB, handed out best-fit (smallest free range of the slice that fits, lowest
 * address among equals).
 *
 * Locking: one mutex, owned by this module; no other lock is taken while it is held.
 */
#ifndef NPUALLOC_VA_SPACE_H
#define NPUALLOC_VA_SPACE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define VA_UNIT ((size_t)2 << 20)

/* Takes a range of `size` bytes (rounded up to VA_UNIT) aligned to `align` (a power of two,
 * at least VA_UNIT) in a device's slice, or exactly at `at` when it is non-zero (any slice).
 * Returns 0, ENOMEM (no room), EEXIST (`at` is taken or outside the window) or EINVAL. */
int va_alloc(int32_t device, size_t size, size_t align, uintptr_t at, uintptr_t *out);
/* The device whose slice holds address a, or -1 outside the window.  Lock-free. */
int32_t va_device_of(uintptr_t a);
/* Gives a range back; it must be inaccessible again (nothing mapped in it). */
void va_free(uintptr_t start, size_t size);
/* True when [a, a + n) overlaps the window. */
bool va_overlaps(uintptr_t a, size_t n);
/* The window (0, 0 before first use). */
void va_window(uintptr_t *base, size_t *size);

/* False (with a message naming the variable and its value) when NPUALLOC_VA_SPACE is set and
 * malformed; the runtime then refuses to start. */
bool va_space_check_env(char *err, size_t errlen);

void va_atfork_prepare(void);
void va_atfork_parent(void);
/* The child has no window (it was not inherited): it reserves a new one on first use. */
void va_atfork_child(void);
/* Releases the window and all bookkeeping. */
void va_shutdown(void);

#endif
