"""Fault injection for tests: make the Nth device allocation, mapping, memory-file creation or address
reservation fail (a reservation fails with 207000, as on a runtime without virtual memory management).

    with npualloc.faults.inject("device_alloc", 3):
        ...   # the third device allocation from here fails once (as out of memory)

The same is armed for a whole process with NPUALLOC_FAULT="device_alloc:N,map:N,memfile:N,reserve:N".
"""
import contextlib

from . import _C

KINDS = {"device_alloc": 0, "map": 1, "memfile": 2, "reserve": 3}


def _kind(name):
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown fault kind {name!r}: use one of {', '.join(KINDS)}") from None


def arm(kind, nth):
    """The nth operation of `kind` from now fails once (nth 0 disarms)."""
    if isinstance(nth, bool) or not isinstance(nth, int) or nth < 0:
        raise TypeError("nth must be a non-negative int")
    _C.fault_set(_kind(kind), nth)


def counts(kind):
    """(operations seen since armed, failures injected so far) for a kind."""
    return _C.fault_counts(_kind(kind))


@contextlib.contextmanager
def inject(kind, nth):
    """Arms a fault for the duration of a with-block (disarmed afterwards if it did not fire)."""
    arm(kind, nth)
    try:
        yield
    finally:
        arm(kind, 0)
