/*
 * fault.h - fault injection for tests: make the Nth device allocation, mapping, memory-file
 * creation or address reservation fail, to prove every failure surfaces as a documented error and loses nothing.
 *
 * Armed with npualloc_fault_set() or NPUALLOC_FAULT="device_alloc:N,map:N,memfile:N,reserve:N" (read
 * when the runtime starts).  Each kind counts its operations from the moment it is armed; the
 * Nth fails once, then the kind is disarmed.  Disarmed, a check is one relaxed atomic load.
 */
#ifndef NPUALLOC_FAULT_H
#define NPUALLOC_FAULT_H

#include <stdbool.h>

#include "npualloc.h"

/* True when this operation of `kind` must fail. */
bool fault_fires(npualloc_fault_kind kind);
/* Arms the kinds named in NPUALLOC_FAULT; false (with nothing armed) when it is malformed. */
bool fault_arm_from_env(char *err, size_t errlen);

#endif
