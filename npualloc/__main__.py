"""Command line: the allocator lab.

    python -m npualloc demo [--out DIR] [--size tiny|small|default] [--seed N] [--device-memory 8GiB]
                            [--traces DIR] [--traces-device-memory 80GiB] [--no-traces]
    python -m npualloc replay TRACE [TRACE ...] [--conf SETTINGS ...] [--device-memory 80GiB]
                              [--rounding npu|cuda] [--fraction F] [--huge1g-memory SIZE]
                              [--on-oom continue|stop] [--device N]
                              [--json FILE] [--plot FILE] [--progress] [--export-events FILE]
    python -m npualloc include

``include`` prints the directory of npualloc's C headers (``-I`` for a pluggable allocator's build).

``replay`` prints, per trace (named after its file, or by its path when two traces share a file name),
one row per configuration (peak requested, allocated, active and reserved, fragmentation,
device allocations and frees, retries, OOMs, wall time, replay speed) under a row with the recorded run's own
reservations, and where the first OOM of each configuration happened (position in ``device_traces``).
``--plot FILE`` writes the timeline in the format its extension names (none: ``FILE.png``, and the last line
names it); an extension matplotlib cannot write or a directory is refused before the replay runs.

Exit status: 0 when the command did its work; 2 for a usage error (the command line itself is wrong: an unknown
option, a bad size or fraction, a settings string torch_npu would refuse, options that conflict), as argparse
does; 1 for a run that failed (a missing, unreadable or malformed trace, an output that cannot be written).
Either way the error is one line on stderr.

``demo`` (what ``make demo`` runs) generates a transformer training trace with npualloc's workload model,
replays it under a set of allocator settings, prints the comparison, writes a timeline plot and the trace as a
snapshot pickle, and does the same for the PyTorch traces in ../shared/traces/ when they are there.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

PROG = "python -m npualloc"
GiB = 1 << 30
MAX_DEVICE_MEMORY = 1 << 60  # replay.MAX_DEVICE_MEMORY (not imported here: --help needs no extension)


class CliError(Exception):
    """A usage error (the command line itself is wrong): printed on one line, exit status 2, as argparse's."""

    status = 2


class RunError(CliError):
    """A run that failed (a trace that cannot be read or replayed, an output that cannot be written):
    printed on one line, exit status 1."""

    status = 1


# ---------------------------------------------------------------------------------------------------------------
# progress


class _Progress:
    """A one-line progress bar on stderr (only drawn when enabled)."""

    def __init__(self, enabled, label=""):
        self.enabled = enabled
        self.label = label
        self.last = -1
        self.drawn = False

    def __call__(self, done, total):
        if not self.enabled or total <= 0:
            return
        pct = int(100 * done / total)
        if pct == self.last:
            return
        self.last = pct
        width = 30
        fill = width * done // total
        sys.stderr.write(f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] {pct:3d}%")
        sys.stderr.flush()
        self.drawn = True

    def close(self):
        if self.drawn:
            sys.stderr.write("\r" + " " * (len(self.label) + 40) + "\r")
            sys.stderr.flush()
            self.drawn = False
        self.last = -1


# ---------------------------------------------------------------------------------------------------------------
# shared pieces


def _load(path):
    from . import replay as rp

    try:
        return rp.Trace.load(path)
    except rp.TraceError as e:
        raise RunError(str(e)) from None


def _setting_error(setting, e):
    # torch_npu's messages end with ", " where its error code follows; npualloc has none to add
    message = f"setting {setting.conf!r}: {str(e).rstrip(', ')}"
    if setting.conf.endswith(".pickle") or os.path.isfile(setting.conf):
        message += " (a trace? --conf takes every word after it: give the traces first, or end the settings with --)"
    return CliError(message)


def _load_all(paths):
    """The traces, named after their files; traces whose file names are the same (run1/snapshot.pickle,
    run2/snapshot.pickle) are named by their paths as given, and a path given twice gets "#2", ... so that each
    trace keeps its own table, winner (JSON) and plot panel."""
    traces = [_load(p) for p in paths]
    names = [t.name for t in traces]
    for i, t in enumerate(traces):
        if names.count(t.name) > 1:
            t.name = os.fspath(paths[i])
    seen = {}
    for t in traces:
        seen[t.name] = seen.get(t.name, 0) + 1
        if seen[t.name] > 1:
            t.name = f"{t.name}#{seen[t.name]}"
    return traces


def _replay_settings(confs, fraction, device_memory, rounding, huge1g_memory=None):
    """The Settings of the --conf texts, each checked (a usage error for one torch_npu refuses) before any trace
    is read; huge1g_memory is the pool of the settings that ask for page_size:1g (the others' device has none)."""
    from . import replay as rp

    out = []
    for c in confs:
        setting = rp.Setting(c, fraction=fraction)  # it takes "default" and surrounding spaces as the CLI does
        if rp._wants_1g_pages(setting.conf):
            setting.huge1g_memory = huge1g_memory
        try:
            rp._check_setting(setting, device_memory, rounding)
        except ValueError as e:
            raise _setting_error(setting, e) from None
        out.append(setting)
    if huge1g_memory is not None and not any(rp._wants_1g_pages(s.conf) for s in out):
        raise CliError("--huge1g-memory is the pool of page_size:1g: no --conf setting asks for page_size:1g")
    return out


def _run_settings(trace, settings, device_memory, rounding, on_oom, device, progress_enabled):
    """Replays every setting on every device of the trace; returns the results (a Comparison)."""
    from . import replay as rp

    devices = sorted(trace.devices) if device is None else [device]
    results = []
    for dev in devices:
        if dev not in trace.devices:
            raise RunError(f"{trace.name}: no events on device {dev} (devices: {sorted(trace.devices)})")
        n = len(trace.devices[dev])
        long_trace = n * len(settings) >= 200_000
        for i, s in enumerate(settings):
            show = progress_enabled is True or (progress_enabled is None and long_trace and sys.stderr.isatty())
            bar = _Progress(show, f"{trace.name} dev {dev} [{i + 1}/{len(settings)}] {s.label[:30]}")
            try:
                results.extend(rp.compare(trace, [s], device_memory=device_memory, rounding=rounding,
                                          on_oom=on_oom, device=dev, progress=bar))
            except ValueError as e:
                raise _setting_error(s, e) from None
            finally:
                bar.close()
    return rp.Comparison(results)


def _agg_canvas():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        raise RunError("the timeline plot needs matplotlib (pip install matplotlib)") from None
    return FigureCanvasAgg


def _check_output(path, option):
    """Refuses, before anything runs, an output file that cannot be written: a directory, a file in a directory
    that does not exist, or where this user may not write (a replay of a long trace is not wasted on it)."""
    name = f"{option} {path}"
    if os.path.isdir(path) or path.endswith(os.sep):
        raise RunError(f"{name}: is a directory; give a file name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        why = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise RunError(f"{name}: cannot write (the directory {parent} {why})")
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.lexists(path) and not os.access(path, os.W_OK)):
        raise RunError(f"{name}: cannot write (permission denied)")


def _check_distinct_outputs(traces, outputs):
    """A usage error when an output file is a trace (it would be overwritten) or another output."""
    seen = {os.path.realpath(t): "a trace" for t in traces}
    for option, path in outputs:
        if path is None:
            continue
        real = os.path.realpath(path)
        if real in seen:
            raise CliError(f"{option} {path} is {seen[real]} given on the command line: it would be overwritten")
        seen[real] = f"the {option} file"


def _plot_target(path):
    """Checks a --plot path before the replay runs (so a bad one fails at once); returns (file, format).

    The extension picks the format; without one, ``.png`` is appended (matplotlib's own default, made
    explicit here so the message names the file actually written).  A directory is refused rather than
    turned into ``DIR.png`` next to it."""
    supported = _agg_canvas().get_supported_filetypes()
    if os.path.isdir(path) or path.endswith(os.sep):
        raise RunError(f"--plot {path}: is a directory; give a file name such as "
                       f"{os.path.join(path, 'timeline.png')}")
    extension = os.path.splitext(path)[1][1:].lower()
    if not extension:
        path = path.rstrip(".") + ".png"
        _check_output(path, "--plot")
        return path, "png"
    if extension not in supported:
        raise CliError(f"--plot {path}: matplotlib cannot write .{extension} files (it writes "
                       f"{', '.join('.' + e for e in sorted(supported))})")
    _check_output(path, "--plot")
    return path, extension


def _plot(groups, path, file_format):
    """Writes one figure in file_format: a panel per (trace, device) group of results."""
    FigureCanvasAgg = _agg_canvas()
    from matplotlib.figure import Figure

    from . import replay as rp

    fig = Figure(figsize=(13, 4.2 * len(groups)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(groups), 1, squeeze=False)[:, 0]
    for ax, results in zip(axes, groups):
        rp.plot_timeline(results, ax=ax)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110, format=file_format)
    except OSError as e:
        raise RunError(f"{path}: cannot write the plot ({e.strerror or e})") from None
    except RuntimeError as e:  # a listed format whose writer is missing, e.g. .pgf without xelatex
        raise RunError(f"{path}: cannot write the plot ({e})") from None


def _groups(comparison):
    out, keys = [], {}
    for r in comparison:
        key = (r.trace, r.device)
        if key not in keys:
            keys[key] = len(out)
            out.append([])
        out[keys[key]].append(r)
    return out


def _write_bytes(path, data):
    """Writes an output file made whole beforehand (no half-made file on an error); RunError if it cannot."""
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError as e:
        raise RunError(f"{path}: cannot write ({e.strerror or e})") from None


def _write_json(path, payload):
    _write_bytes(path, json.dumps(payload, indent=1).encode())


def _device_index(text):
    """--device's value: a device index, 0 or more (argparse reports anything else as a usage error)."""
    n = int(text)
    if n < 0:
        raise ValueError(text)
    return n


_device_index.__name__ = "device index"  # argparse's message: "invalid device index value: '-1'"


def _parse_memory(text, option="--device-memory", allow_zero=False):
    from . import _C

    try:
        n = _C.parse_size(text)
    except ValueError as e:
        raise CliError(f"{option}: {e}") from None
    if n <= 0 and not allow_zero:
        raise CliError(f"{option} must be more than 0 bytes")
    if n > MAX_DEVICE_MEMORY:
        raise CliError(f"{option} must be at most 1 EiB")
    return n


# ---------------------------------------------------------------------------------------------------------------
# replay


_REPLAY_ONLY = (("--conf", "conf"), ("--device-memory", "device_memory"), ("--rounding", "rounding"),
                ("--huge1g-memory", "huge1g_memory"), ("--fraction", "fraction"), ("--on-oom", "on_oom"),
                ("--json", "json"), ("--plot", "plot"), ("--progress", "progress"))


def cmd_replay(args):
    from . import replay as rp

    if args.export_events:
        given = [option for option, attr in _REPLAY_ONLY if getattr(args, attr) not in (None, False)]
        if given:
            raise CliError(f"--export-events writes the events and stops, without replaying: "
                           f"{', '.join(given)} would have no effect")
    args.device_memory = args.device_memory or "80GiB"
    args.rounding = args.rounding or "npu"
    args.on_oom = args.on_oom or "continue"
    device_memory = _parse_memory(args.device_memory)
    if args.fraction is not None and not 0.0 < args.fraction <= 1.0:
        raise CliError(f"--fraction must be in (0, 1], got {args.fraction}")
    if args.export_events and len(args.trace) != 1:
        raise CliError("--export-events takes a single trace")
    huge1g = None
    if args.huge1g_memory is not None:
        huge1g = _parse_memory(args.huge1g_memory, "--huge1g-memory", allow_zero=True)
        if huge1g % GiB or huge1g > device_memory:
            raise CliError("--huge1g-memory must be a multiple of 1 GiB and at most --device-memory")
    settings = [] if args.export_events else _replay_settings(args.conf or [""], args.fraction, device_memory,
                                                              args.rounding, huge1g)
    # usage errors above; below, what the file system may refuse, before a trace is read
    plot_path, plot_format = _plot_target(args.plot) if args.plot else (None, None)
    _check_distinct_outputs(args.trace, [("--json", args.json), ("--plot", plot_path),
                                         ("--export-events", args.export_events)])
    if args.json:
        _check_output(args.json, "--json")
    if args.export_events:
        _check_output(args.export_events, "--export-events")
    traces = _load_all(args.trace)
    if args.export_events:
        tr = traces[0]
        if args.device is None and len(tr.devices) > 1:
            raise RunError(f"{tr.name}: the trace has events on devices {sorted(tr.devices)}: choose one with "
                           "--device")
        try:
            n = rp.export_events(tr, args.export_events, device=args.device)
        except ValueError as e:
            raise RunError(str(e)) from None
        except OSError as e:
            raise RunError(f"--export-events {args.export_events}: cannot write ({e.strerror or e})") from None
        print(f"wrote {n} events of {traces[0].name} to {args.export_events}")
        return 0
    all_results = []
    for tr in traces:
        comp = _run_settings(tr, settings, device_memory, args.rounding, args.on_oom, args.device,
                             True if args.progress else None)
        all_results.extend(comp)
        print(comp.format())
        print()
    comp = rp.Comparison(all_results)
    if args.json:
        _write_json(args.json, comp.to_dict())
        print(f"results: {args.json}")
    if plot_path:
        _plot(_groups(comp), plot_path, plot_format)
        print(f"timeline plot: {plot_path}")
    return 0


# ---------------------------------------------------------------------------------------------------------------
# demo


def demo_settings(device_memory):
    """The settings the demo compares (expandable segments are marked "not available" if this build lacks
    them; page_size:1g gets a pool of 1 GiB pages of 3/4 of the device)."""
    from .replay import Setting

    pool = device_memory * 3 // 4 // GiB * GiB
    settings = [
        Setting("", label="default"),
        Setting("max_split_size_mb:128"),
        Setting("garbage_collection_threshold:0.8", fraction=0.9,
                label="garbage_collection_threshold:0.8 +fraction 0.9"),
        Setting("expandable_segments:True"),
    ]
    if pool:  # a device below 4/3 GiB has no 1 GiB page to give: the row would be the default's
        settings.append(Setting("page_size:1g", huge1g_memory=pool, label=f"page_size:1g ({pool // GiB} GiB pool)"))
    return settings


def _default_traces_dir():
    here = Path(__file__).resolve().parent.parent  # the project (npualloc/..)
    for cand in (Path.cwd().parent / "shared" / "traces", here.parent / "shared" / "traces"):
        if cand.is_dir():
            return cand
    return None


def _safe_name(name):
    stem = name[:-7] if name.endswith(".pickle") else name
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in stem)


def cmd_demo(args):
    import pickle

    from . import replay as rp
    from . import workload

    t_start = time.perf_counter()
    gen_memory = _parse_memory(args.device_memory)
    shared_memory = _parse_memory(args.traces_device_memory, "--traces-device-memory")
    if args.traces and not Path(args.traces).is_dir():
        raise RunError(f"--traces {args.traces}: not a directory")
    traces_dir = None if args.no_traces else (Path(args.traces) if args.traces else _default_traces_dir())
    traces_missing = traces_dir is None and not args.no_traces
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunError(f"{out}: cannot create the output directory ({e.strerror or e})") from None
    print("npualloc allocator lab: which PYTORCH_NPU_ALLOC_CONF wastes the least memory on a workload?")
    print("Each setting replays the same trace through npualloc's caching allocator (torch_npu's algorithm) on a "
          "simulated device;\nfragmentation = 1 - peak active / peak reserved (GMLake).\n")

    # 1. the built-in workload, recorded from its first step: nothing to reconstruct, so the default row
    # replays the recorded run exactly (see docs/allocator.md on traces recorded mid-run)
    snap = workload.transformer_trace(args.size, seed=args.seed, record_from_step=0)
    info = snap["npualloc_workload"]
    trace_path = out / "transformer-trace.pickle"
    _write_bytes(trace_path, pickle.dumps(snap, protocol=4))
    print(f"Workload model: transformer training loop ({info['layers']} layers, hidden {info['hidden']}, "
          f"batch {info['batch']}, sequence lengths {'/'.join(map(str, info['seq_choices']))}, {info['steps']} steps, "
          f"seed {args.seed}; gradient buckets on a second stream), recorded from step {info['record_from_step']}: "
          f"{info['recorded_events']} of {info['events']} events.")
    trace = rp.Trace(snap, name="transformer-trace.pickle")
    settings = demo_settings(gen_memory)
    comp = _run_settings(trace, settings, gen_memory, "npu", "continue", None, None)
    print()
    print(comp.format())
    print()
    plots, all_results = [], list(comp)
    plot_ok = _demo_plot(comp, out / "timeline-transformer.png", plots)

    # 2. the PyTorch traces
    if traces_dir is not None:
        # (not the trace written above, when --traces is the output directory)
        files = [p for p in sorted(traces_dir.glob("*.pickle")) if p.resolve() != trace_path.resolve()]
        shared_settings = [rp.Setting("", label="default (cuda rounding)", rounding="cuda")] + \
            demo_settings(shared_memory)
        if files:
            print(f"PyTorch CUDA traces in {traces_dir} ({len(files)}): replayed with CUDA rounding (the allocator "
                  f"that recorded them) and NPU rounding (+32 bytes), {rp.format_size(shared_memory)} device.\n")
        else:
            print(f"No PyTorch traces (*.pickle) in {traces_dir}.\n")
        for p in files:
            try:
                tr = rp.Trace.load(p)
            except rp.TraceError as e:
                print(f"skipped: {e}\n")
                continue
            c = _run_settings(tr, shared_settings, shared_memory, "npu", "continue", None, None)
            all_results.extend(c)
            print(c.format())
            print()
            if plot_ok:
                _demo_plot(c, out / f"timeline-{_safe_name(p.name)}.png", plots)
    if traces_missing:
        print("No PyTorch traces: ../shared/traces is not beside the project or the current directory; "
              f"{PROG} demo --traces DIR (make demo TRACES=DIR) replays the *.pickle snapshots in DIR.\n")
    _write_json(out / "results.json", rp.Comparison(all_results).to_dict())
    print(f"Wrote to {out}/:")
    print(f"  {trace_path.name:<40} the generated trace (a PyTorch-format memory snapshot pickle)")
    for p in plots:
        print(f"  {p.name:<40} allocated vs reserved over time, per setting")
    print(f"  {'results.json':<40} every result (npualloc.replay's to_dict())")
    print(f"Replay a trace yourself: {PROG} replay {trace_path} --conf expandable_segments:True "
          f"--plot {out / 'timeline.png'}")
    print(f"(demo took {time.perf_counter() - t_start:.1f} s)")
    return 0


def _demo_plot(comp, path, plots):
    try:
        _plot(_groups(comp), path, "png")
    except CliError as e:
        print(f"no plot: {e}")
        return False
    plots.append(path)
    return True


# ---------------------------------------------------------------------------------------------------------------


def cmd_include(args):
    from . import get_include
    print(get_include())
    return 0


class _PipeSafeStdout:
    """sys.stdout for a run whose reader may go away (``| head -1``): from the first broken pipe on, the output
    goes to /dev/null (its file descriptor too, so that what is buffered flushes there) and the run goes on, so
    that --json, --plot and the demo's files are still written.  Any other write error (a full disk) fails the
    run with one line on stderr."""

    def __init__(self, stream):
        self.stream = stream

    def _drop(self):
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):  # no descriptor (captured output): drop it in Python
            self.stream = open(os.devnull, "w")

    def _failed(self, e):
        # another write error (a full disk): the run failed; what is buffered goes nowhere, not to an exit traceback
        self._drop()
        return RunError(f"cannot write the output ({e.strerror or e})")

    def write(self, text):
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self._drop()
            return len(text)
        except OSError as e:
            raise self._failed(e) from None

    def flush(self):
        try:
            self.stream.flush()
        except BrokenPipeError:
            self._drop()
            self.stream.flush()
        except OSError as e:
            raise self._failed(e) from None

    def __getattr__(self, name):
        return getattr(self.stream, name)


class _Parser(argparse.ArgumentParser):
    words = ()  # the command line being parsed (main sets it)

    def error(self, message):  # argparse's usage errors: one line, exit 2
        if "required: trace" in message and "--conf" in self.words:  # --conf took the traces as settings
            message += " (--conf takes every word after it: give the traces first, or end the settings with --)"
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv=None):
    parser = _Parser(prog=PROG, description="npualloc: the allocator lab.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    d = sub.add_parser("demo", help="generate a workload trace, compare allocator settings, plot (make demo)")
    d.add_argument("--out", default="npualloc-demo-out", help="output directory (default: ./npualloc-demo-out)")
    d.add_argument("--size", default="default", choices=["tiny", "small", "default"],
                   help="size of the generated workload (default: default, ~12k events)")
    d.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    d.add_argument("--device-memory", default="8GiB", metavar="SIZE",
                   help="simulated device for the generated workload (8GiB)")
    which = d.add_mutually_exclusive_group()
    which.add_argument("--traces", default=None,
                       help="directory of PyTorch snapshot pickles (default: ../shared/traces)")
    d.add_argument("--traces-device-memory", default="80GiB", metavar="SIZE",
                   help="simulated device for those traces (80GiB)")
    which.add_argument("--no-traces", action="store_true", help="do not replay the PyTorch traces")
    d.set_defaults(func=cmd_demo)

    r = sub.add_parser("replay", help="replay memory-snapshot traces under allocator settings")
    r.add_argument("trace", nargs="+", help="snapshot pickle (torch/npualloc _dump_snapshot output)")
    r.add_argument("--conf", action="extend", nargs="+", metavar="SETTINGS",
                   help="PYTORCH_NPU_ALLOC_CONF settings to compare, one row each (--conf A B or --conf A "
                        "--conf B; '' or 'default' = the defaults); it takes every word after it, so give the "
                        "traces first or end the settings with --")
    r.add_argument("--device-memory", default=None, metavar="SIZE", help="simulated device capacity (default 80GiB)")
    r.add_argument("--rounding", default=None, choices=["npu", "cuda"],
                   help="npu: torch_npu's +32-byte pad; cuda: torch's CUDA rounding (default npu)")
    r.add_argument("--huge1g-memory", default=None, metavar="SIZE",
                   help="the device's pool of 1 GiB pages for the page_size:1g settings (default: 3/4 of the "
                        "device; the other settings' device has none)")
    r.add_argument("--fraction", type=float, default=None, metavar="F",
                   help="per-process memory fraction in (0, 1] for every setting, as "
                        "set_per_process_memory_fraction(F) after start-up (so it overrides a "
                        "per_process_memory_fraction in --conf)")
    r.add_argument("--on-oom", default=None, choices=["continue", "stop"],
                   help="on an OOM: skip that allocation and its free and go on, or end that replay there "
                        "(default continue)")
    r.add_argument("--device", type=_device_index, default=None, metavar="N",
                   help="replay one device's events (default: every device with events)")
    r.add_argument("--json", metavar="FILE", help="write every result as JSON")
    r.add_argument("--plot", metavar="FILE",
                   help="write the allocated/reserved timeline to FILE (needs matplotlib); its extension picks the "
                        "format (.png, .pdf, .svg, ...), none means .png appended (--plot t writes t.png)")
    r.add_argument("--progress", action="store_true",
                   help="show a progress bar on stderr (without it: only on a terminal, for long replays)")
    r.add_argument("--export-events", metavar="FILE",
                   help="write the trace's replay events (those of --device N for a trace of several devices) as "
                        "the binary file benchmarks/bench_replay.c reads, and stop: nothing is replayed, so no other "
                        "option applies")
    r.set_defaults(func=cmd_replay)

    i = sub.add_parser("include", help="print the directory of npualloc's C headers (for -I)")
    i.set_defaults(func=cmd_include)

    _Parser.words = tuple(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    stdout = sys.stdout
    if stdout is not None:  # None: no stdout at all (>&-), and print() writes nothing
        sys.stdout = _PipeSafeStdout(stdout)
    try:
        status = args.func(args)
        if sys.stdout is not None:
            sys.stdout.flush()
        return status
    except CliError as e:
        print(f"{PROG} {args.command}: error: {e}", file=sys.stderr)
        return e.status
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    finally:
        sys.stdout = stdout


if __name__ == "__main__":
    sys.exit(main())
