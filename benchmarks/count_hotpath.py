#!/usr/bin/env python3
"""Counts what one alloc+free pair of bench_hotpath costs, with callgrind.

    python3 benchmarks/count_hotpath.py [--bin DIR] [--trace PICKLE] [--allocator NAME ...] [--json]

Timings on a shared machine move by several percent from run to run; callgrind's instruction count
does not move at all, so a change to the hot path can be judged by it before it is timed.  For each
workload of bench_hotpath (the recorded trace's alloc/free stream, and the synthetic small sizes) and
each allocator asked for, prints per pair:

- instructions (exact);
- mispredicted conditional branches and L1 data misses, from callgrind's simulated branch predictor
  and caches: compare them between runs of this tool, not with a real CPU's counters.

Only bench_hotpath's run_pass is counted (warm-up pass included, set-up excluded), so the figures
include the benchmark's own loop, as the timed figures do.  Needs valgrind (`make bench-count`
installs it).
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_TRACE = os.path.join(ROOT, "..", "shared", "traces", "cs336-ctx128-fullstep.pickle")
EVENTS = ("Ir", "Bcm", "D1mr", "D1mw")


def workload_runs(binary, events_file, allocator):
    """bench_hotpath's own JSON for one allocator: per workload, the pairs and passes it runs."""
    cmd = [binary, "--json", "--only", allocator] + ([events_file] if events_file else [])
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return {r["workload"]: r for r in map(json.loads, filter(None, out.splitlines()))}


def callgrind(binary, args):
    """The event totals callgrind collected inside run_pass."""
    cmd = ["valgrind", "--tool=callgrind", "--branch-sim=yes", "--cache-sim=yes",
           "--callgrind-out-file=/dev/null", "--toggle-collect=run_pass", binary] + args
    err = subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True).stderr
    names = re.search(r"Events\s*:\s*(.*)", err).group(1).split()
    values = re.search(r"Collected\s*:\s*(.*)", err).group(1).split()
    return dict(zip(names, map(int, values)))


def count(binary, events_file, allocator):
    runs = workload_runs(binary, events_file, allocator)
    rows = []
    for workload, args in (("trace", [events_file, "--trace-only"] if events_file else None),
                           ("synthetic-small", [])):
        if args is None or workload not in runs:
            continue
        totals = callgrind(binary, args + ["--only", allocator])
        pairs = runs[workload]["pairs"] * runs[workload]["passes"]
        rows.append({"workload": workload, "allocator": allocator, "pairs": pairs,
                     "instructions": totals["Ir"] / pairs, "mispredicted_branches": totals["Bcm"] / pairs,
                     "l1_data_misses": (totals["D1mr"] + totals["D1mw"]) / pairs})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "release", "bench"),
                    help="the directory holding bench_hotpath (default build/release/bench)")
    ap.add_argument("--trace", default=DEFAULT_TRACE, help="the recorded trace (skipped when absent)")
    ap.add_argument("--allocator", action="append", help="npualloc (default), glibc, jemalloc, mimalloc")
    ap.add_argument("--json", action="store_true", help="one JSON object per line instead of the table")
    args = ap.parse_args()
    if not shutil.which("valgrind"):
        sys.exit("count_hotpath: valgrind is not installed (make bench-count installs it)")
    binary = os.path.join(args.bin, "bench_hotpath")
    if not os.path.exists(binary):
        sys.exit(f"count_hotpath: {binary} does not exist (make bench-count builds it)")
    with tempfile.TemporaryDirectory() as tmp:
        events_file = None
        if os.path.exists(args.trace):
            events_file = os.path.join(tmp, "trace.events")
            subprocess.run([sys.executable, "-m", "npualloc", "replay", args.trace, "--export-events", events_file],
                           check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
        else:
            print(f"count_hotpath: {args.trace} not found: the synthetic workload only", file=sys.stderr)
        rows = [r for a in args.allocator or ["npualloc"] for r in count(binary, events_file, a)]
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"{'workload':<16} {'allocator':<10} {'instructions':>13} {'mispredicted':>13} {'L1d misses':>11}"
          "   (per alloc+free pair; the last two simulated)")
    for r in rows:
        print(f"{r['workload']:<16} {r['allocator']:<10} {r['instructions']:13.1f} "
              f"{r['mispredicted_branches']:13.2f} {r['l1_data_misses']:11.2f}")


if __name__ == "__main__":
    main()
