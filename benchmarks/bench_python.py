"""Python-level costs: a caching_allocator_alloc + caching_allocator_delete pair, an npualloc.empty()
buffer, acl.rt.malloc + acl.rt.free, and the statistics readers memory_stats() and memory_allocated()
(one call each, with blocks held), and a reference loop of two builtin calls that tells how fast the
machine runs the interpreter at the time.  Prints ns per pair or call (median of 7 rounds); --json prints
one JSON object per line."""
import json
import statistics
import sys
import time

import npualloc
from npualloc import acl


def per_pair(fn, pairs):
    rounds = []
    for _ in range(7):
        t0 = time.perf_counter_ns()
        fn(pairs)
        rounds.append((time.perf_counter_ns() - t0) / pairs)
    return statistics.median(rounds)


def caching_pairs(n):
    alloc, free = npualloc.caching_allocator_alloc, npualloc.caching_allocator_delete
    for _ in range(n):
        free(alloc(4096))


def reference_pairs(n):
    """The same loop with two calls of builtins for the pair, one making a new 47-bit int (as an
    allocation's pointer is): no npualloc.  It tells how fast this machine runs the interpreter
    at the moment: on a shared VM, every row here moves with it, up to 2x from one process to the next."""
    make, drop = int.__add__, abs
    for i in range(n):
        drop(make(0x7F0000000000, i))


def empty_pairs(n):
    empty = npualloc.empty
    for _ in range(n):
        empty(4096).free()


def acl_pairs(n):
    malloc, free = acl.rt.malloc, acl.rt.free
    for _ in range(n):
        ptr, _ = malloc(4096, 0)
        free(ptr)


def stats_calls(n):
    stats = npualloc.memory_stats
    for _ in range(n):
        stats()


def allocated_calls(n):
    allocated = npualloc.memory_allocated
    for _ in range(n):
        allocated()


def main():
    as_json = "--json" in sys.argv
    acl.rt.set_device(0)
    caching_pairs(1000)  # warm the cache
    rows = [
        ("caching_allocator_alloc+delete", per_pair(caching_pairs, 200000)),
        ("reference: 2 builtin calls", per_pair(reference_pairs, 200000)),
        ("npualloc.empty().free()", per_pair(empty_pairs, 100000)),
        ("acl.rt.malloc+free (4 KiB)", per_pair(acl_pairs, 2000)),
    ]
    held = [npualloc.caching_allocator_alloc(size) for size in (512, 4096, 3 << 20)]
    readers = [("memory_stats()", per_pair(stats_calls, 5000)),
               ("memory_allocated()", per_pair(allocated_calls, 100000))]
    for ptr in held:
        npualloc.caching_allocator_delete(ptr)
    for (name, ns), per in [(row, "pair") for row in rows] + [(row, "call") for row in readers]:
        if as_json:
            print(json.dumps({"bench": "python", "what": name, "ns": round(ns, 1), "per": per}))
        else:
            print(f"{name:<36} {ns:10.1f} ns/{per}")


if __name__ == "__main__":
    main()
