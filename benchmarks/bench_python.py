"""Python-level costs: a caching_allocator_alloc + caching_allocator_delete pair, an npualloc.empty()
buffer, and acl.rt.malloc + acl.rt.free.  Prints ns per pair (median of 7 rounds); --json prints
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


def empty_pairs(n):
    empty = npualloc.empty
    for _ in range(n):
        empty(4096).free()


def acl_pairs(n):
    malloc, free = acl.rt.malloc, acl.rt.free
    for _ in range(n):
        ptr, _ = malloc(4096, 0)
        free(ptr)


def main():
    as_json = "--json" in sys.argv
    acl.rt.set_device(0)
    caching_pairs(1000)  # warm the cache
    rows = [
        ("caching_allocator_alloc+delete", per_pair(caching_pairs, 200000)),
        ("npualloc.empty().free()", per_pair(empty_pairs, 100000)),
        ("acl.rt.malloc+free (4 KiB)", per_pair(acl_pairs, 2000)),
    ]
    for name, ns in rows:
        if as_json:
            print(json.dumps({"bench": "python", "what": name, "ns_per_pair": round(ns, 1)}))
        else:
            print(f"{name:<36} {ns:10.1f} ns/pair")


if __name__ == "__main__":
    main()
