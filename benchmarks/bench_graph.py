"""The graph planner on a real trace: captures every allocation and free of a trace's device events on one
stream into an npualloc.Graph and prints the planned footprint against the lower bound (the largest total
live at any point).  --json prints one JSON object per line.

    python3 benchmarks/bench_graph.py [--json] [TRACE.pickle ...]   (default: cs336-ctx128-fullstep in
    $NPUALLOC_TRACES_DIR, else ../shared/traces)
"""
import json
import os
import sys
import time

import npualloc
from npualloc import replay

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACES = os.environ.get("NPUALLOC_TRACES_DIR", os.path.join(ROOT, "..", "shared", "traces"))
DEFAULT_TRACE = os.path.join(TRACES, "cs336-ctx128-fullstep.pickle")


def plan_trace(path):
    ev = replay.Trace.load(path).device_events()
    npualloc._C.shutdown()
    npualloc.configure(device_count=1, device_memory=64 << 30)
    alloc, free = npualloc.caching_allocator_alloc, npualloc.caching_allocator_delete
    s, g, live = npualloc.Stream(), npualloc.Graph(), {}
    t0 = time.perf_counter()
    with g.capture(stream=s):
        for action, addr, size in zip(ev.action, ev.addr, ev.size):
            if action == 0:
                live[addr] = alloc(size)
            elif addr in live:
                free(live.pop(addr))
    with g.instantiate() as exe:
        plan = exe.memory_plan()
    return {"bench": "graph", "trace": os.path.basename(path)[:-len(".pickle")],
            "allocations": plan["alloc_count"], "footprint": plan["footprint"],
            "lower_bound": plan["lower_bound"], "ratio": round(plan["ratio"], 4),
            "seconds": round(time.perf_counter() - t0, 2)}


def main(argv):
    as_json = "--json" in argv
    paths = [a for a in argv if a != "--json"] or [DEFAULT_TRACE]
    for path in paths:
        r = plan_trace(path)
        if as_json:
            print(json.dumps(r))
        else:
            print(f"{r['trace']}: {r['allocations']} allocations, footprint {r['footprint'] / 2**30:.2f} GiB, "
                  f"lower bound {r['lower_bound'] / 2**30:.2f} GiB, ratio {r['ratio']:.4f} ({r['seconds']} s)")


if __name__ == "__main__":
    main(sys.argv[1:])
