/* fault.c - see fault.h. */
#include "fault.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const kind_names[NPUALLOC_FAULT_KINDS] = {"device_alloc", "map", "memfile", "reserve"};

static struct {
    _Atomic uint64_t nth;      /* 0: disarmed */
    _Atomic uint64_t seen;     /* operations since armed */
    _Atomic uint64_t injected; /* failures injected since the process started */
} faults[NPUALLOC_FAULT_KINDS];

bool fault_fires(npualloc_fault_kind kind)
{
    if (__builtin_expect(atomic_load_explicit(&faults[kind].nth, memory_order_relaxed) == 0, 1))
        return false;
    uint64_t n = atomic_fetch_add(&faults[kind].seen, 1) + 1;
    uint64_t nth = atomic_load(&faults[kind].nth);
    if (nth == 0 || n != nth)
        return false;
    atomic_store(&faults[kind].nth, 0); /* one failure, then disarmed */
    atomic_fetch_add(&faults[kind].injected, 1);
    return true;
}

aclError npualloc_fault_set(npualloc_fault_kind kind, uint64_t nth)
{
    if ((unsigned)kind >= NPUALLOC_FAULT_KINDS)
        return ACL_ERROR_INVALID_PARAM;
    atomic_store(&faults[kind].nth, 0);
    atomic_store(&faults[kind].seen, 0);
    atomic_store(&faults[kind].nth, nth);
    return ACL_SUCCESS;
}

void npualloc_fault_counts(npualloc_fault_kind kind, uint64_t *seen, uint64_t *injected)
{
    bool known = (unsigned)kind < NPUALLOC_FAULT_KINDS;
    if (seen)
        *seen = known ? atomic_load(&faults[kind].seen) : 0;
    if (injected)
        *injected = known ? atomic_load(&faults[kind].injected) : 0;
}

bool fault_arm_from_env(char *err, size_t errlen)
{
    const char *text = getenv("NPUALLOC_FAULT");
    if (!text || !*text)
        return true;
    uint64_t nth[NPUALLOC_FAULT_KINDS] = {0};
    bool armed[NPUALLOC_FAULT_KINDS] = {false};
    const char *p = text;
    while (*p) {
        int kind = -1;
        for (int k = 0; k < NPUALLOC_FAULT_KINDS; k++) {
            size_t n = strlen(kind_names[k]);
            if (strncmp(p, kind_names[k], n) == 0 && p[n] == ':') {
                kind = k;
                p += n + 1;
                break;
            }
        }
        char *end = (char *)p;
        errno = 0;
        /* digits only: strtoull would also take spaces, a sign, and "-1" as the largest count */
        unsigned long long v = kind >= 0 && *p >= '0' && *p <= '9' ? strtoull(p, &end, 10) : 0;
        /* a kind named twice is refused: which of its counts was meant? */
        if (kind < 0 || end == p || errno || (*end && *end != ',') || (*end == ',' && !end[1]) ||
            armed[kind]) {
            snprintf(err, errlen,
                     "NPUALLOC_FAULT='%s' is malformed: use kind:N[,kind:N] with kinds device_alloc, map, memfile, reserve",
                     text);
            return false;
        }
        nth[kind] = v;
        armed[kind] = true;
        p = *end ? end + 1 : end;
    }
    for (int k = 0; k < NPUALLOC_FAULT_KINDS; k++)
        if (nth[k])
            npualloc_fault_set((npualloc_fault_kind)k, nth[k]);
    return true;
}
