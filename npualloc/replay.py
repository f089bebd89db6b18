"""Trace replay: which allocator settings waste the least memory on a recorded workload?

A PyTorch memory snapshot (``torch.cuda.memory._dump_snapshot`` or ``npualloc.memory._dump_snapshot``)
records every allocation and free.  :func:`replay` runs those events, stream by stream in their recorded
order, through a fresh caching allocator (npualloc's, which follows torch_npu decision for decision) on a
simulated device of a chosen capacity, under a chosen ``PYTORCH_NPU_ALLOC_CONF``, and reports what that
allocator would have reserved.  The replay runs in C on a private allocator instance: it does not touch the
live runtime, and 20k events take milliseconds.

    >>> from npualloc import replay
    >>> r = replay.replay("snapshot.pickle", conf="max_split_size_mb:128")
    >>> r.peak_reserved, r.fragmentation
    >>> table = replay.compare("snapshot.pickle", ["", "expandable_segments:True"])
    >>> replay.plot_timeline(table)          # allocated vs reserved over the run

A free completes where the trace says: a block freed while another stream still used it (``record_stream``)
has its ``free_completed`` after later events, and stays out of the cache (and active) until then, as in the
recorded run; if the replayed allocator drains the device first (its last-resort retry), the free completes
there, as torch's would.  A trace without ``free_completed`` entries frees every block at its request.
Segments given back outside any allocation (no segment_alloc / segment_map / oom of an allocation follows
them) were given back by ``empty_cache()``: the replay empties its cache there (``result.empty_caches``).
The replay has one pool: every allocation goes to the default pool whatever its ``segment_pool_id`` /
``pool_id``.  A release of private-pool segments only (entries with a ``pool_id`` other than (0, 0), as in
torch's newest traces) is not taken for an ``empty_cache()``; npualloc's own traces carry no ``pool_id``, so
there a collected ``MemPool``'s release is.
An ``oom`` entry (an allocation the recorded run could not make) is tried again, with the same side
effects (the retry releases cached segments) and freed at once if it succeeds: ``result.recorded_ooms`` /
``recorded_ooms_reproduced`` count them; ``result.ooms`` counts only the trace's allocations that failed.

Traces start mid-run: memory alive before recording began (freed in the trace but never allocated in it,
or alive in the final ``segments`` without an allocation in the trace) is reconstructed and allocated first;
``result.reconstructed_count`` / ``reconstructed_bytes`` say how much.  The recorded run's own reservations
(from its ``segments`` and ``segment_alloc`` / ``segment_free`` events) are in ``result.recorded``.

Snapshots are read with an unpickler that refuses every global: a snapshot holds only dicts, lists, tuples,
numbers, strings and bools, so a pickle that names any class or function is rejected before anything in it
runs (:class:`UnsafeTraceError`).
"""
import io
import math
import operator
import os
import pickle
import stat
import struct
import sys
import time
from array import array

from . import _C

__all__ = ["TraceError", "UnsafeTraceError", "Unavailable", "load_trace", "Trace", "RecordedRun", "ReplayResult",
           "Comparison", "Setting", "replay", "compare", "least_waste", "plot_timeline", "export_events", "format_size"]

GiB = 1 << 30
MiB = 1 << 20
MAX_DEVICE_MEMORY = 1 << 60  # the largest simulated device (1 EiB)
CHUNK = 1 << 16  # events per call into C (progress is reported between chunks)
MAX_TIMELINE_POINTS = 1 << 22  # a timeline's samples (24 bytes each) per replay

Unavailable = _C.replay.Unavailable  # NotImplementedError: a setting this build's allocator does not implement


class TraceError(ValueError):
    """A trace that is missing, unreadable, or not a PyTorch memory snapshot."""


class UnsafeTraceError(TraceError):
    """A pickle that refers to a class or function: refused before anything in it ran."""


# ---------------------------------------------------------------------------------------------------------------
# Loading


class _NoGlobalsUnpickler(pickle.Unpickler):
    """An unpickler for plain data: every global (class, function) is refused, so nothing can be called."""

    def find_class(self, module, name):
        raise UnsafeTraceError(
            f"refused to load: the pickle refers to the global {module}.{name}; a memory snapshot holds only "
            "dicts, lists, numbers and strings, so nothing from this file was run")

    def persistent_load(self, pid):
        raise UnsafeTraceError("refused to load: the pickle uses persistent ids, which a memory snapshot never does")


def _unpickle(data, name):
    try:
        # Opcodes first (in C, at memory speed): a memo index or a length far beyond the file would
        # make the unpickler allocate for it before noticing (a few bytes can ask for gigabytes).
        _C.replay.check_pickle(data)
    except ValueError as e:
        raise TraceError(f"{name}: not a readable pickle ({e}){_looks_like(data, str(e))}") from None
    try:
        return _NoGlobalsUnpickler(io.BytesIO(data)).load()
    except UnsafeTraceError as e:
        raise UnsafeTraceError(f"{name}: {e}") from None
    except RecursionError:
        raise TraceError(f"{name}: not a memory snapshot (nested too deeply)") from None
    except MemoryError:
        raise TraceError(f"{name}: the pickle needs more memory than this machine has") from None
    except Exception as e:  # UnpicklingError, EOFError, ValueError, ... from a damaged or foreign file
        raise TraceError(f"{name}: not a readable pickle ({type(e).__name__}: {e})") from None


def _memory_limit():
    """The largest trace file load_trace reads: half the machine's physical memory (its objects take several
    times the pickle's size, so a larger file cannot be loaded anyway)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError):
        return 1 << 62


def _read_bounded(f, name):
    """The bytes of an open file, refusing at once a file larger than _memory_limit() (which reading whole
    would exhaust the machine's memory).  A stream (a pipe, a device) is read in chunks up to the same limit,
    its opcodes checked as they come: one that goes wrong is refused there (/dev/zero, or a pickle's start
    followed by it, would otherwise be read to the limit), and reading ends at the pickle's STOP."""
    limit = _memory_limit()
    st = os.fstat(f.fileno())
    too_large = f"{name}: too large to load ({{}}; the limit is half of this machine's memory, {format_size(limit)})"
    if stat.S_ISREG(st.st_mode):
        if st.st_size > limit:
            raise TraceError(too_large.format(format_size(st.st_size)))
        return f.read()
    data, resume, check_at = bytearray(), 0, 0
    while True:
        chunk = f.read1(1 << 20)  # what has come (read() would wait for a whole chunk, or the writer's end)
        if not chunk:
            return bytes(data)  # cut off before STOP: check_pickle says where
        data += chunk
        if len(data) > limit:
            raise TraceError(too_large.format(f"more than {format_size(limit)}"))
        if len(data) < check_at:
            continue
        try:
            resumed, stopped = _C.replay.check_pickle_prefix(data, resume, limit)
        except ValueError as e:
            raise TraceError(f"{name}: not a readable pickle ({e}){_looks_like(data, str(e))}") from None
        if stopped:
            return bytes(data[:resumed])
        # An opcode still cut off after a whole chunk (a long string or line) is looked at again only once
        # the data has doubled: a line is searched from its start each time.
        check_at = 2 * len(data) if resumed == resume else 0
        resume = resumed


# The scan's words for an opcode the end of the data cut off (csrc/python/pickle_scan.c).
_CUT_OFF = ("truncated argument", "frame longer than the data", "truncated length", "length beyond the end of the data",
            "unterminated line", "no STOP opcode")


def _looks_like(head, why=""):
    """A hint for data that is not a readable pickle (the scan said ``why``): what it looks like from its first
    bytes, or that it ends in the middle of a pickle, or ""."""
    text = head[:64].lstrip()
    if text[:1] in (b"{", b"["):
        return ": it looks like JSON; a trace is the pickle torch's _dump_snapshot() writes"
    if head[:1] == b"\x80" and why.startswith(_CUT_OFF):  # a pickle of protocol 2 or later that stops short
        return ": the file ends inside the pickle (cut short?)"
    if head[:1] != b"\x80" and head[:64] and all(32 <= c < 127 or c in b"\t\r\n" for c in head[:64]):
        return ": it looks like text, not a pickle; a trace is the pickle torch's _dump_snapshot() writes"
    return ""


def load_trace(path):
    """Reads a snapshot pickle with an unpickler that refuses every global; returns the snapshot (a dict).

    Raises :class:`TraceError` for a missing, unreadable or damaged file, a file larger than half of the
    machine's memory, a stream (a pipe, a device) as soon as its opcodes go wrong, and
    :class:`UnsafeTraceError` for a pickle that refers to any class or function (nothing in it is executed).
    """
    name = os.fsdecode(path) or "''"  # a str in every message, for a bytes path too; an empty one shown
    try:
        with open(path, "rb") as f:
            data = _read_bounded(f, name)
    except FileNotFoundError:
        raise TraceError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise TraceError(f"{name}: is a directory, not a snapshot pickle") from None
    except PermissionError:
        raise TraceError(f"{name}: permission denied") from None
    except OSError as e:
        raise TraceError(f"{name}: cannot read ({e.strerror or e})") from None
    except MemoryError:
        raise TraceError(f"{name}: the file needs more memory than this machine has") from None
    if not data:
        raise TraceError(f"{name}: empty file, not a snapshot pickle")
    return _unpickle(data, name)


# ---------------------------------------------------------------------------------------------------------------
# Sizes


def format_size(n):
    """1536 -> '1.50 KiB'; bytes below 1 KiB are shown as such."""
    if n is None:
        return "-"
    n = int(n)
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _parse_size(value, what):
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int or a size string, not bool")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what} must not be negative")
        if value > _U64:
            raise ValueError(f"{what} is too large")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str):
        return _C.parse_size(value.strip())
    raise TypeError(f"{what} must be an int or a size string such as '80GiB', not {type(value).__name__}")


# ---------------------------------------------------------------------------------------------------------------
# Extracting the events


class RecordedRun:
    """The recorded run's own reservations on one device, from its snapshot.

    ``final_reserved`` is the total of the final segments; ``initial_reserved`` is that minus the
    reservations made during the trace (segment_alloc / segment_map) plus those given back (segment_free /
    segment_unmap); ``peak_reserved`` is the largest total along the way.  When the segments hold less than
    the trace shows (a snapshot without 'segments'), the start is the least that keeps every total along the
    trace at zero or more, and ``final_reserved`` follows from it.  ``segment_allocs`` /
    ``segment_frees`` count the device allocations and frees (segment_alloc and segment_map / segment_free and
    segment_unmap entries), as the allocator's num_device_alloc / num_device_free and the replay's
    ``device_allocs`` / ``device_frees`` do, but only those made while recording: ``initial_segments`` is the
    number of segments held when recording began (the final segments, less those allocated in the trace, plus
    those freed in it; None when that cannot be told: expandable segments, whose mappings before recording
    are unknown), so that ``initial_segments + segment_allocs`` compares with the replay's ``device_allocs``,
    which include the reconstruction's.  ``peak_requested`` counts the bytes
    requested by live allocations (the memory alive before recording included), so a replay that completes
    without OOM reaches exactly this peak.
    """

    __slots__ = ("device", "initial_reserved", "peak_reserved", "final_reserved", "final_allocated",
                 "initial_segments", "segment_allocs", "segment_frees", "peak_requested", "ooms", "settings",
                 "timeline")

    def __init__(self, **kw):
        for k in self.__slots__:
            setattr(self, k, kw.get(k))

    def to_dict(self):
        """The attributes as a JSON-ready dict (bytes and counts as ints); ``timeline`` becomes
        ``{"event": [...], "reserved": [...]}``, the reserved bytes after each replay event index; ``settings``
        (the snapshot's own ``allocator_settings``, whatever plain data it holds) is made JSON-ready: keys as
        strings, tuples and sets as lists, bytes decoded, non-finite floats as strings."""
        d = {k: getattr(self, k) for k in self.__slots__ if k != "timeline"}
        d["settings"] = _json_ready(self.settings)
        d["timeline"] = {"event": list(self.timeline[0]), "reserved": list(self.timeline[1])}
        return d

    def __repr__(self):
        return (f"RecordedRun(device={self.device}, peak_reserved={format_size(self.peak_reserved)}, "
                f"final_reserved={format_size(self.final_reserved)}, segment_allocs={self.segment_allocs}, "
                f"segment_frees={self.segment_frees})")


def _json_ready(v):
    """Plain data from a snapshot (what the no-globals unpickler can build) as values json.dump writes."""
    if isinstance(v, dict):
        return {k if isinstance(k, str) else str(k): _json_ready(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set, frozenset)):
        return [_json_ready(x) for x in v]
    if isinstance(v, (bytes, bytearray)):
        return bytes(v).decode("utf-8", "replace")
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if v is None or isinstance(v, (str, int, float)):
        return v
    return repr(v)


class _DeviceEvents:
    """The events of one device, ready for C: parallel arrays, the reconstructed allocations first."""

    __slots__ = ("device", "action", "addr", "size", "stream", "prefix", "reconstructed_from_frees",
                 "reconstructed_from_segments", "reconstructed_bytes", "recorded", "streams", "trace_index",
                 "time_us", "empty_caches")

    def __len__(self):
        return len(self.action)


def _bad(name, where, what):
    raise TraceError(f"{name}: malformed snapshot: {where}: {what}")


_U64 = (1 << 64) - 1


def _int_field(entry, key, name, where):
    v = entry.get(key)
    if type(v) is not int:  # noqa: E721 (bool is not a size)
        if not isinstance(v, int) or isinstance(v, bool):
            _bad(name, where, f"'{key}' must be an int, not {type(v).__name__}")
        v = int(v)  # an int subclass (IntEnum) from a snapshot dict built in Python: checked like an int
    if v < 0:
        _bad(name, where, f"'{key}' is negative")
    return v


def _u64_field(entry, key, name, where):
    """_int_field for a value that goes to C as an unsigned 64-bit integer (an address or a size)."""
    v = _int_field(entry, key, name, where)
    if v > _U64:
        _bad(name, where, f"'{key}' is too large")
    return v


def _in_private_pool(entry, name, where):
    """Whether the entry says it is of a private pool: torch's newest trace entries carry ``pool_id``,
    (0, 0) for the default pools; without it, the pool is unknown (False)."""
    pool = entry.get("pool_id")
    if pool is None:
        return False
    if (not isinstance(pool, (tuple, list)) or len(pool) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in pool)):
        _bad(name, where, f"'pool_id' must be a pair of ints, not {pool!r:.60}")
    return tuple(pool) != (0, 0)


def _time_us(entry):
    """An entry's time_us, or -1 when it has none that fits an int64."""
    t = entry.get("time_us")
    return t if type(t) is int and -(1 << 63) <= t < (1 << 63) else -1


_RESERVE_DELTA = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


def _extract_device(name, device, entries, segments):
    """Builds the replay events of one device (see the module docstring for the reconstruction)."""
    actions = bytearray()
    addrs, sizes, streams = [], [], []
    trace_index, times = array("Q"), array("q")  # per replayed trace event: where it is in device_traces
    alive = {}  # address -> True while an allocation made in the trace lives there, False once freed in the trace
    pre = []  # (address, size, stream) alive before recording began
    reserve_deltas = []  # (replay event index without prefix, delta)
    seg_allocs = seg_frees = ooms = 0
    mapped = False  # expandable segments' segment_map / segment_unmap entries seen
    live_requested = peak_requested_trace = 0  # relative to the start of the trace
    requested = {}
    # A free completes (its block returns to the cache, its bytes leave the requested count) at its
    # free_completed, which torch records after the free_requested once the streams that used the
    # block are done; a trace without completions (skip_actions) has every free complete at once.
    completions = any(type(e) is dict and e.get("action") == "free_completed" for e in entries)
    awaiting = {}  # address -> (its free's index in actions, requested bytes) until free_completed
    freed_last = set()  # addresses whose last event in the trace is a free_requested (pending if still active)
    # Segments given back by an allocation (its retry, GC) are followed by that allocation's segment_alloc /
    # segment_map or oom; given back with nothing of the kind before the next alloc or free request, they were given
    # back by empty_cache(), which the trace does not record as such: replayed as an EMPTY_CACHE there.
    release_at = None  # trace index of the first segment_free / segment_unmap not yet accounted for
    empty_caches = 0

    def add_empty_cache():
        nonlocal release_at, empty_caches
        actions.append(_C.replay.EMPTY_CACHE)
        addrs.append(0)
        sizes.append(0)
        streams.append(0)
        trace_index.append(release_at)
        times.append(_time_us(entries[release_at]))
        release_at = None
        empty_caches += 1

    for i, e in enumerate(entries):
        if type(e) is not dict:
            _bad(name, f"device_traces[{device}][{i}]", f"a trace entry must be a dict, not {type(e).__name__}")
        act = e.get("action")
        if act == "alloc" or act == "free_requested" or act == "free_completed":
            # (a free_completed may come between an allocation's releases: its retry completes pending frees)
            if release_at is not None and act != "free_completed":
                add_empty_cache()
            addr = e.get("addr")
            size = e.get("size")
            stream = e.get("stream", 0)
            if type(addr) is not int or type(size) is not int or type(stream) is not int:
                where = f"device_traces[{device}][{i}]"
                addr = _int_field(e, "addr", name, where)
                size = _int_field(e, "size", name, where)
                stream = _int_field(e, "stream", name, where) if "stream" in e else 0
            if addr < 0 or size < 0 or addr > _U64 or size > _U64:
                which = "addr" if not 0 <= addr <= _U64 else "size"
                value = addr if which == "addr" else size
                _bad(name, f"device_traces[{device}][{i}]", f"'{which}' is {'negative' if value < 0 else 'too large'}")
            stream &= _U64
            if act == "alloc":
                actions.append(_C.replay.ALLOC)
                freed_last.discard(addr)
                alive[addr] = True
                requested[addr] = size
                live_requested += size
                if live_requested > peak_requested_trace:
                    peak_requested_trace = live_requested
            elif act == "free_requested":
                freed_last.add(addr)
                state = alive.get(addr)
                if state:
                    freed = requested.pop(addr, 0)
                elif state is False:
                    freed = 0  # freed again, nothing allocated there since: the replay counts an unknown free
                else:
                    pre.append((addr, size, stream))  # freed in the trace, never allocated in it
                    freed = size
                alive[addr] = False
                if completions:
                    awaiting[addr] = (len(actions), freed)
                else:
                    live_requested -= freed
                actions.append(_C.replay.FREE)
            else:
                freed_last.discard(addr)
                waiting = awaiting.pop(addr, None)
                if waiting is None:
                    continue  # its request came before the recording (or is malformed): nothing waits
                at, freed = waiting
                live_requested -= freed
                if at == len(actions) - 1:
                    continue  # completed before anything else happened: the FREE replays both
                actions[at] = _C.replay.FREE_REQUESTED
                actions.append(_C.replay.FREE_COMPLETED)
            addrs.append(addr)
            sizes.append(size)
            streams.append(stream)
            trace_index.append(i)
            times.append(_time_us(e))
        elif not isinstance(act, str):
            what = "missing 'action'" if act is None else f"'action' must be a str, not {type(act).__name__}"
            _bad(name, f"device_traces[{device}][{i}]", what)
        elif act in _RESERVE_DELTA:
            size = _int_field(e, "size", name, f"device_traces[{device}][{i}]")
            reserve_deltas.append((len(actions), _RESERVE_DELTA[act] * size))
            mapped = mapped or act in ("segment_map", "segment_unmap")
            if _RESERVE_DELTA[act] > 0:  # a mapping of an expandable segment is a device allocation too
                seg_allocs += 1
                release_at = None  # the releases before it were this allocation's
            else:
                seg_frees += 1
                # a private pool's own release (~MemPool's emptyCache(pool.id)) is no empty_cache(); the
                # replay has no pools, so it has nothing to release there
                private = _in_private_pool(e, name, f"device_traces[{device}][{i}]")
                if release_at is None and not private:
                    release_at = i
        elif act == "oom":
            release_at = None  # the releases before it were this allocation's retry
            # the recorded run's failed allocation: tried again (its retry releases cached memory)
            where = f"device_traces[{device}][{i}]"
            actions.append(_C.replay.OOM)
            addrs.append(0)
            sizes.append(_u64_field(e, "size", name, where))
            streams.append(_int_field(e, "stream", name, where) & _U64 if "stream" in e else 0)
            trace_index.append(i)
            times.append(_time_us(e))
            ooms += 1
    if release_at is not None:
        add_empty_cache()
    for at, _ in awaiting.values():  # no completion in the trace: still pending at its end
        actions[at] = _C.replay.FREE_REQUESTED
    # Blocks alive in the final segments without a live allocation in the trace were allocated before it.
    final_reserved = final_allocated = 0
    pre_end = []
    for si, seg in enumerate(segments):
        where = f"segments[{si}]"
        final_reserved += _int_field(seg, "total_size", name, where)
        if seg.get("allocated_size") is not None:
            final_allocated += _int_field(seg, "allocated_size", name, where)
        seg_stream = seg.get("stream", 0)
        seg_stream = seg_stream & _U64 if isinstance(seg_stream, int) else 0
        blocks = seg.get("blocks", [])
        if not isinstance(blocks, list):
            _bad(name, where, "'blocks' must be a list")
        for bi, b in enumerate(blocks):
            if type(b) is not dict:
                _bad(name, f"{where}.blocks[{bi}]", "a block must be a dict")
            state = b.get("state")
            if state not in ("active_allocated", "active_pending_free", "active_awaiting_free"):
                continue
            addr = _u64_field(b, "address", name, f"{where}.blocks[{bi}]")
            if alive.get(addr) or addr in freed_last:  # allocated, or freed and pending, in the trace
                continue
            # the bytes the allocation asked for; snapshots without it (or with 0) give the block's size
            size_key = "requested_size" if b.get("requested_size") else "size"
            size = _u64_field(b, size_key, name, f"{where}.blocks[{bi}]")
            pre_end.append((addr, size, seg_stream))
    # The reconstructed allocations go first, in address order (blocks of one recorded segment together).
    pre_all = sorted(pre + pre_end)
    n_pre = len(pre_all)
    ev = _DeviceEvents()
    ev.device = device
    ev.action = bytes(n_pre) + bytes(actions)
    ev.addr = array("Q", [p[0] for p in pre_all])
    ev.addr.extend(addrs)
    ev.size = array("Q", [p[1] for p in pre_all])
    ev.size.extend(sizes)
    ev.stream = array("Q", [p[2] for p in pre_all])
    ev.stream.extend(streams)
    ev.prefix = n_pre
    ev.trace_index = trace_index
    ev.time_us = times
    ev.empty_caches = empty_caches
    ev.reconstructed_from_frees = (len(pre), sum(p[1] for p in pre))
    ev.reconstructed_from_segments = (len(pre_end), sum(p[1] for p in pre_end))
    pre_bytes = ev.reconstructed_from_frees[1] + ev.reconstructed_from_segments[1]
    ev.reconstructed_bytes = pre_bytes
    ev.streams = sorted(set(ev.stream))
    # The recorded run's reservations along the trace (event indices of the replay, prefix included).
    # What the segments say was reserved at the start, but never so little that the trace's own reservations
    # would take the count below zero: a snapshot without 'segments' tells nothing of the end.
    lowest = total = 0
    for _, d in reserve_deltas:
        total += d
        lowest = min(lowest, total)
    initial = max(final_reserved - total, -lowest)
    final_reserved = initial + total
    cur = peak = initial
    tl_events, tl_reserved = [0], [initial]
    for at, d in reserve_deltas:
        cur += d
        peak = max(peak, cur)
        tl_events.append(n_pre + at)
        tl_reserved.append(cur)
    tl_events.append(n_pre + len(actions))
    tl_reserved.append(cur)
    initial_segments = len(segments) - seg_allocs + seg_frees
    if initial == 0:
        initial_segments = 0
    elif mapped or any(seg.get("is_expandable") for seg in segments) or initial_segments < 0:
        initial_segments = None  # unknown, or a trace whose segments do not add up
    ev.recorded = RecordedRun(device=device, initial_reserved=initial, peak_reserved=peak,
                              final_reserved=final_reserved, final_allocated=final_allocated,
                              initial_segments=initial_segments, segment_allocs=seg_allocs, segment_frees=seg_frees,
                              peak_requested=pre_bytes + peak_requested_trace if actions or pre_all else 0,
                              ooms=ooms, settings=None, timeline=(tl_events, tl_reserved))
    return ev


_SETTINGS_DEPTH = 32  # torch's allocator_settings is a dict of numbers, strings and a list or two
_SETTINGS_ITEMS = 100_000
_CONTAINERS = (dict, list, tuple, set, frozenset)


def _settings_too_big(value):
    """Would _json_ready's copy of plain data (dict keys included) be deeper than _SETTINGS_DEPTH levels or
    hold more than _SETTINGS_ITEMS items (an object met along several paths is copied once per path), or
    does the data hold itself?  Each container is measured once, without recursion."""
    if not isinstance(value, _CONTAINERS):
        return False
    shape = {}  # id -> (levels, items) of a container measured
    on_path = set()
    todo = [(value, False)]
    while todo:
        v, measured = todo.pop()
        parts = [*v.keys(), *v.values()] if isinstance(v, dict) else v
        if measured:
            levels, items = 1, 1
            for x in parts:
                x_levels, x_items = shape[id(x)] if isinstance(x, _CONTAINERS) else (0, 1)
                levels, items = max(levels, x_levels + 1), items + x_items
            if levels > _SETTINGS_DEPTH or items > _SETTINGS_ITEMS:
                return True
            shape[id(v)] = (levels, items)
            on_path.discard(id(v))
            continue
        if id(v) in shape:
            continue
        if id(v) in on_path or len(on_path) >= _SETTINGS_DEPTH:
            return True  # it holds itself, or is too deep already
        on_path.add(id(v))
        todo.append((v, True))
        todo.extend((x, False) for x in parts if isinstance(x, _CONTAINERS) and id(x) not in shape)
    return False


def _is_segment_list(obj):
    """memory_snapshot()'s list of segments, which is not a snapshot with events (Trace() says so)."""
    return isinstance(obj, list) and all(isinstance(s, dict) for s in obj)


def _not_a_snapshot(name, holder, obj):
    kind = type(obj).__name__
    return (f"{name}: not a memory snapshot: {holder} {'an' if kind[0] in 'aeiou' else 'a'} {kind}, not a dict with "
            "'segments' and 'device_traces'")


class Trace:
    """A snapshot prepared for replay: per device, the events as arrays (built once, replayed many times).

    ``Trace.load(path)`` reads a pickle safely; ``Trace(snapshot_dict, name=...)`` takes a loaded snapshot.
    """

    def __init__(self, snapshot, name="<snapshot>"):
        self.name = name
        if _is_segment_list(snapshot):
            raise TraceError(f"{name}: this is a list of segments (memory_snapshot()), not a full snapshot with "
                             "device_traces: record one with _record_memory_history() and _dump_snapshot()")
        if isinstance(snapshot, (str, bytes, os.PathLike)):
            raise TraceError(f"{name}: Trace() takes a loaded snapshot (a dict); Trace.load({snapshot!r}) reads "
                             "a pickle file")
        if not isinstance(snapshot, dict):
            raise TraceError(_not_a_snapshot(name, "it is", snapshot))
        traces = snapshot.get("device_traces")
        if traces is None:
            raise TraceError(f"{name}: not a memory snapshot: no 'device_traces' (keys: "
                             f"{', '.join(map(str, list(snapshot)[:8])) or 'none'}); record the trace with "
                             "_record_memory_history() before _dump_snapshot()")
        if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
            raise TraceError(f"{name}: malformed snapshot: 'device_traces' must be a list of lists")
        segments = snapshot.get("segments", [])
        if not isinstance(segments, list) or not all(isinstance(s, dict) for s in segments):
            raise TraceError(f"{name}: malformed snapshot: 'segments' must be a list of dicts")
        settings = snapshot.get("allocator_settings")
        if _settings_too_big(settings):  # to_dict() and json.dump recurse once per level, and copy every path
            raise TraceError(f"{name}: malformed snapshot: 'allocator_settings' nests more than {_SETTINGS_DEPTH} "
                             f"levels deep, holds more than {_SETTINGS_ITEMS} items, or holds itself")
        self.allocator_settings = settings if isinstance(settings, dict) else {}
        by_device = {}
        for s in segments:
            dev = s.get("device", 0)
            by_device.setdefault(dev if isinstance(dev, int) else 0, []).append(s)
        self.devices = {}
        for dev, entries in enumerate(traces):
            segs = by_device.get(dev, [])
            if not entries and not segs:
                continue
            ev = _extract_device(name, dev, entries, segs)
            ev.recorded.settings = self.allocator_settings
            if len(ev):
                self.devices[dev] = ev
        if not self.devices:
            raise TraceError(f"{name}: the snapshot has no alloc or free events to replay")

    @classmethod
    def load(cls, path):
        """The Trace of the snapshot pickle at ``path`` (read by :func:`load_trace`: no global is loaded),
        named after the file; TraceError for a file that is not a snapshot with events to replay."""
        name = os.path.basename(os.fsdecode(path))
        snapshot = load_trace(path)
        if not isinstance(snapshot, dict) and not _is_segment_list(snapshot):
            raise TraceError(_not_a_snapshot(name, "the pickle holds", snapshot))
        return cls(snapshot, name=name)

    def device_events(self, device=None):
        """The events :func:`replay` runs for ``device`` (None: the trace's only device): parallel arrays
        ``action``, ``addr``, ``size``, ``stream`` (bytes and addresses), the ``prefix`` reconstructed
        allocations first, and the recorded run in ``recorded``.  ValueError when ``device`` is None and the
        trace has several devices, or when it has no events on ``device``."""
        if device is None:
            if len(self.devices) > 1:
                raise ValueError(f"{self.name}: the trace has events on devices {sorted(self.devices)}: "
                                 "choose one with device=")
            device = next(iter(self.devices))
        if isinstance(device, bool):
            raise TypeError("device must be an int or None, not bool")
        try:
            device = operator.index(device)  # numpy integers too
        except TypeError:
            raise TypeError(f"device must be an int or None, not {type(device).__name__}") from None
        if device not in self.devices:
            raise ValueError(f"{self.name}: no events on device {device} (devices: {sorted(self.devices)})")
        return self.devices[device]

    def __repr__(self):
        parts = [f"device {d}: {len(ev)} events ({ev.prefix} reconstructed)" for d, ev in self.devices.items()]
        return f"<Trace {self.name}: {'; '.join(parts)}>"


def _as_trace(trace):
    if isinstance(trace, Trace):
        return trace
    if isinstance(trace, (dict, list)):
        return Trace(trace)
    if isinstance(trace, (str, bytes, os.PathLike)):
        return Trace.load(trace)
    raise TypeError(f"trace must be a path, a snapshot dict or a Trace, not {type(trace).__name__}")


# ---------------------------------------------------------------------------------------------------------------
# Replaying


class Setting:
    """One configuration to replay under: the settings text and what goes with it.

    ``conf`` is ``PYTORCH_NPU_ALLOC_CONF`` text; surrounding spaces are dropped, and "" or "default" (as the CLI
    takes it) is torch_npu's defaults.  ``label`` names the row (default: the text, or "default"); ``fraction`` a
    per-process memory fraction; ``huge1g_memory`` the simulated device's pool of 1 GiB pages (None: 3/4 of the
    device when the text asks for page_size:1g; only such a setting takes one); ``rounding`` overrides the
    replay's "npu" / "cuda" rounding (either case).
    """

    __slots__ = ("conf", "label", "fraction", "huge1g_memory", "rounding")

    def __init__(self, conf="", label=None, fraction=None, huge1g_memory=None, rounding=None):
        if conf is None:
            conf = ""
        if not isinstance(conf, str):
            raise TypeError(f"conf must be a str, not {type(conf).__name__}")
        if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))):
            raise TypeError(f"fraction must be a number in (0, 1], not {type(fraction).__name__}")
        conf = conf.strip()
        if conf.lower() == "default":
            conf = ""
        if huge1g_memory is not None and not _wants_1g_pages(conf):
            raise ValueError(f"huge1g_memory is the pool of page_size:1g, and the setting {conf or 'default'!r} "
                             "does not ask for page_size:1g")
        self.conf = conf
        self.fraction = fraction
        self.huge1g_memory = huge1g_memory
        self.rounding = None if rounding is None else _normal_rounding(rounding)
        if label is None:
            label = conf if conf else "default"
            if fraction is not None:
                label += f" +fraction {fraction:g}"
        self.label = label

    @classmethod
    def of(cls, item):
        """A Setting from what :func:`compare` accepts: a Setting (returned as is), a settings text (None:
        the defaults), a dict of Setting's arguments, or a ``(label, conf)`` tuple."""
        if isinstance(item, Setting):
            return item
        if item is None or isinstance(item, str):
            return cls(item or "")
        if isinstance(item, dict):
            return cls(**item)
        if isinstance(item, tuple) and len(item) == 2:
            return cls(item[1], label=item[0])
        raise TypeError(f"a setting must be a str, dict, (label, conf) tuple or Setting, not {type(item).__name__}")

    def __repr__(self):
        return f"Setting({self.conf!r}, label={self.label!r})"


def _wants_1g_pages(conf):
    for part in conf.replace(" ", "").lower().split(","):
        if part.startswith("page_size:") and part.split(":", 1)[1] == "1g":
            return True
    return False


# Keys npualloc's allocator accepts and never reads (docs/allocator.md, Settings): a replay cannot tell them
# from the default.
_IDLE_KEYS = ("pinned_use_background_threads", "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb",
              "pin_memory_expandable_segments", "pinned_mem_register", "pinned_reserve_segment_size_mb",
              "multi_stream_lazy_reclaim", "release_lock_on_npumalloc")


def _conf_items(conf):
    """{key: value text} of a settings text (commas inside [...] lists do not split)."""
    items, depth, start = {}, 0, 0
    for i, ch in enumerate(conf + ","):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth <= 0:
            key, _, value = conf[start:i].partition(":")
            if key.strip():
                items[key.strip()] = value.strip()
            start = i + 1
    return items


def _idle_setting_notes(r):
    """Notes on the keys of a result's setting that could not change its replay, so that a tie it wins is
    not read as a recommendation."""
    items = _conf_items(r.conf)
    notes = []
    idle = [k for k in _IDLE_KEYS if k in items]
    if idle:
        verb = "changes" if len(idle) == 1 else "change"
        notes.append(f"{r.label}: {', '.join(idle)} {verb} nothing in npualloc's allocator (docs/allocator.md, "
                     "Settings)")
    if r.fraction is None and "per_process_memory_fraction" not in items:
        needs = [k for k in ("garbage_collection_threshold", "throw_on_npumalloc_oom") if k in items]
        if needs:
            verb = "acts" if len(needs) == 1 else "act"
            notes.append(f"{r.label}: {', '.join(needs)} {verb} only with a memory fraction (--fraction, or "
                         "per_process_memory_fraction in the setting)")
    if "base_addr_aligned_kb" in items and items.get("expandable_segments", "").lower() != "true":
        notes.append(f"{r.label}: base_addr_aligned_kb acts only with expandable_segments:True")
    return notes


_RESULT_FIELDS = ("events", "allocs", "frees", "unknown_frees", "skipped_frees", "duplicate_allocs", "ignored",
                  "ooms", "recorded_ooms", "recorded_ooms_reproduced", "stopped", "peak_requested", "peak_allocated",
                  "peak_active", "peak_reserved", "final_allocated", "final_reserved", "live_allocations",
                  "fragmentation", "device_allocs", "device_frees", "retries", "segments", "huge1g_fallbacks",
                  "expandable", "wall_seconds", "events_per_second")


class ReplayResult:
    """What one configuration did with one trace (plain attributes; ``to_dict()`` for JSON).

    Peaks are bytes over the whole replay (the reconstructed memory included).  ``fragmentation`` is
    1 - peak_active / peak_reserved, as GMLake defines it.  ``oom_events`` describes the first 64 of the
    ``ooms`` allocations that failed.  ``available`` is False (and ``error`` says why)
    when the configuration cannot run in this build, e.g. expandable segments before they exist, or on the
    device: one whose allocations the device refuses for another reason than memory (expandable segments
    with large-pool pages off the 2 MiB physical granularity, such as ``large_segment_size_mb:11``, which
    aclrtMallocPhysical refuses; torch_npu raises then).
    """

    def __init__(self, trace_name, device, setting, rounding, device_memory, huge1g_memory, on_oom, recorded,
                 events=None):
        self.trace = trace_name
        self.device = device
        self.label = setting.label
        self.conf = setting.conf
        self.fraction = setting.fraction
        self.rounding = rounding
        self.device_memory = device_memory
        self.huge1g_memory = huge1g_memory
        self.on_oom = on_oom
        self.recorded = recorded
        self.available = True
        self.error = None
        self.reconstructed_count = self.reconstructed_bytes = 0
        self.reconstructed_from_frees = self.reconstructed_from_segments = (0, 0)
        self.trace_events = 0
        self.empty_caches = 0  # empty_cache() calls of the recorded run, inferred and replayed
        for k in _RESULT_FIELDS:
            setattr(self, k, None)
        self.timeline = ([], [], [])
        self.oom_events = []
        self.warnings = []
        self.load_seconds = 0.0
        if events is not None:
            self.reconstructed_count = events.prefix
            self.reconstructed_bytes = events.reconstructed_bytes
            self.reconstructed_from_frees = events.reconstructed_from_frees
            self.reconstructed_from_segments = events.reconstructed_from_segments
            self.trace_events = len(events) - events.prefix
            self.empty_caches = events.empty_caches

    def to_dict(self):
        """Every attribute as a JSON-ready dict (bytes, counts and seconds as numbers): the peaks, the
        counters, ``oom_events``, ``warnings``, ``timeline`` as ``{"event", "allocated", "reserved"}`` lists
        and ``recorded`` as :meth:`RecordedRun.to_dict`."""
        d = {
            "trace": self.trace, "device": self.device, "label": self.label, "conf": self.conf,
            "fraction": self.fraction, "rounding": self.rounding, "device_memory": self.device_memory,
            "huge1g_memory": self.huge1g_memory, "on_oom": self.on_oom, "available": self.available,
            "error": self.error, "trace_events": self.trace_events, "empty_caches": self.empty_caches,
            "reconstructed_count": self.reconstructed_count, "reconstructed_bytes": self.reconstructed_bytes,
            "reconstructed_from_frees": list(self.reconstructed_from_frees),
            "reconstructed_from_segments": list(self.reconstructed_from_segments),
        }
        for k in _RESULT_FIELDS:
            d[k] = getattr(self, k)
        d["oom_events"] = list(self.oom_events)
        d["warnings"] = list(self.warnings)
        d["timeline"] = {"event": list(self.timeline[0]), "allocated": list(self.timeline[1]),
                         "reserved": list(self.timeline[2])}
        d["recorded"] = self.recorded.to_dict() if self.recorded is not None else None
        return d

    def __repr__(self):
        head = f"<ReplayResult {self.trace} dev {self.device} [{self.label}] rounding={self.rounding}"
        if not self.available:
            return f"{head}: not available ({self.error})>"
        lines = [
            head,
            f"  peak requested {format_size(self.peak_requested)}, allocated {format_size(self.peak_allocated)}, "
            f"active {format_size(self.peak_active)}, reserved {format_size(self.peak_reserved)}",
            f"  fragmentation {self.fragmentation:.1%}; {self.device_allocs} device allocs, {self.device_frees} "
            f"frees, {self.retries} retries, {self.ooms} OOMs{' (stopped)' if self.stopped else ''}",
            f"  {self.events} events ({self.reconstructed_count} reconstructed, "
            f"{format_size(self.reconstructed_bytes)}; {self.unknown_frees} unknown frees) in "
            f"{self.wall_seconds * 1e3:.2f} ms, {self.events_per_second / 1e6:.2f} M events/s",
        ]
        for oom in self.oom_events[:3]:
            lines.append("  " + describe_oom(self, oom))
        if self.ooms > 3 and self.oom_events:
            lines.append(f"  ... {self.ooms - 3} more OOMs")
        if self.recorded is not None:
            lines.append(f"  recorded run: peak reserved {format_size(self.recorded.peak_reserved)}, final "
                         f"{format_size(self.recorded.final_reserved)}")
        return "\n".join(lines) + ">"


def _normal_rounding(rounding):
    """"npu" or "cuda" (given in either case; results carry the lower-case name that ranking compares)."""
    if isinstance(rounding, str) and rounding.lower() in ("npu", "cuda"):
        return rounding.lower()
    raise ValueError(f"rounding must be 'npu' or 'cuda', not {rounding!r}")


def _session_config(setting, rounding, device_memory):
    """(rounding, pad, huge1g_memory, fraction) of a session replaying under ``setting``."""
    rounding = _normal_rounding(setting.rounding or rounding)
    pad = _C.replay.PAD_NPU if rounding == "npu" else _C.replay.PAD_CUDA
    huge1g = setting.huge1g_memory
    if huge1g is None:
        huge1g = (device_memory * 3 // 4) // GiB * GiB if _wants_1g_pages(setting.conf) else 0
    else:
        huge1g = _parse_size(huge1g, "huge1g_memory")
    fraction = setting.fraction
    if fraction is not None:
        fraction = float(fraction)
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    return rounding, pad, huge1g, fraction


def _check_setting(setting, device_memory="80GiB", rounding="npu"):
    """Raises ValueError (torch_npu's message for a settings text it refuses) unless ``setting`` (what
    :func:`compare` accepts as one configuration) can be replayed on such a device; nothing is replayed.  A
    setting this build does not implement passes: its replay reports it not available."""
    device_memory = _check_common(device_memory, "continue", rounding)
    setting = Setting.of(setting)
    _, pad, huge1g, fraction = _session_config(setting, rounding, device_memory)
    try:
        _C.replay.Session(setting.conf, device_memory, huge1g, pad, fraction or 0.0, False, 2)
    except Unavailable:
        pass


def _check_timeline_points(timeline_points):
    if isinstance(timeline_points, bool) or not isinstance(timeline_points, int):
        raise TypeError(f"timeline_points must be an int, not {type(timeline_points).__name__}")
    if not 0 <= timeline_points <= MAX_TIMELINE_POINTS:
        raise ValueError(f"timeline_points must be in [0, {MAX_TIMELINE_POINTS}] (0: no timeline), "
                         f"not {timeline_points}")


def _run(events, trace_name, setting, rounding, device_memory, on_oom, timeline_points, progress):
    rounding, pad, huge1g, fraction = _session_config(setting, rounding, device_memory)
    res = ReplayResult(trace_name, events.device, setting, rounding, device_memory, huge1g, on_oom,
                       events.recorded, events)
    try:
        session = _C.replay.Session(setting.conf, device_memory, huge1g, pad, fraction or 0.0, on_oom == "stop",
                                    timeline_points)
    except Unavailable as e:
        res.available = False
        res.error = str(e)
        return res
    n = len(events)
    for start in range(0, n, CHUNK):
        try:
            going = session.feed(events.action, events.addr, events.size, events.stream, start, CHUNK)
        except _C.replay.DeviceError as e:
            res.available = False
            res.error = f"the device refused an allocation: {e}"
            return res
        if progress is not None:
            progress(min(start + CHUNK, n), n)
        if not going:
            break
    for k, v in session.result().items():
        setattr(res, k, v)
    res.timeline = session.timeline()
    res.oom_events = [_locate(o, events) for o in session.ooms()]
    res.warnings = session.warnings()
    return res


def _locate(oom, events):
    """Adds where an OOM happened in the trace: ``trace_index`` (position in ``device_traces[device]``) and
    ``time_us``, or ``reconstructed`` True for an allocation alive before recording began."""
    i = oom["event"] - events.prefix
    oom["reconstructed"] = i < 0
    oom["trace_index"] = events.trace_index[i] if i >= 0 else None
    oom["time_us"] = events.time_us[i] if i >= 0 and events.time_us[i] >= 0 else None
    return oom


def describe_oom(result, oom):
    """One line saying where a replay ran out of memory, e.g. for a report."""
    if oom["reconstructed"]:
        where = "an allocation alive before recording began (reconstructed)"
    else:
        where = f"device_traces[{result.device}][{oom['trace_index']}]"
        if oom["time_us"] is not None:
            where += f" (time_us {oom['time_us']})"
    return (f"{result.trace} [{result.label}]: OOM at {where}: {format_size(oom['size'])} on stream "
            f"{oom['stream']:#x}")


def _device_memory(device_memory):
    """The simulated device's capacity in bytes (a size string or bytes), from 1 byte to 1 EiB."""
    device_memory = _parse_size(device_memory, "device_memory")
    if device_memory <= 0:
        raise ValueError("device_memory must be more than 0 bytes")
    if device_memory > MAX_DEVICE_MEMORY:
        raise ValueError("device_memory must be at most 1 EiB")
    return device_memory


def _check_common(device_memory, on_oom, rounding):
    device_memory = _device_memory(device_memory)
    if on_oom not in ("continue", "stop"):
        raise ValueError(f"on_oom must be 'continue' or 'stop', not {on_oom!r}")
    _normal_rounding(rounding)
    return device_memory


def replay(trace, conf="", device_memory="80GiB", rounding="npu", fraction=None, on_oom="continue",
           huge1g_memory=None, device=None, timeline_points=2048, progress=None, label=None):
    """Replays a trace under one configuration; returns a :class:`ReplayResult`.

    trace: a snapshot pickle's path, a loaded snapshot dict, or a :class:`Trace`.
    conf: ``PYTORCH_NPU_ALLOC_CONF`` text (a malformed one raises ValueError with torch_npu's message).
    device_memory: the simulated device's capacity ("80GiB" or bytes).
    rounding: "npu" (torch_npu pads every request by 32 bytes) or "cuda" (no pad), to compare with the
        allocator that recorded a GPU trace.
    fraction: per-process memory fraction in (0, 1] (None: not set).
    on_oom: "continue" (skip the allocation and its free) or "stop".
    huge1g_memory: the device's pool of 1 GiB pages (None: 3/4 of the device for page_size:1g).
    device: which device's events (None: the only one).
    timeline_points: at most this many samples in ``result.timeline`` (0: none; at most 2**22).
    progress: optional callable(done, total) called between chunks of events.
    """
    device_memory = _check_common(device_memory, on_oom, rounding)
    _check_timeline_points(timeline_points)
    t0 = time.perf_counter()
    tr = _as_trace(trace)
    events = tr.device_events(device)
    setting = Setting(conf, label=label, fraction=fraction, huge1g_memory=huge1g_memory)
    res = _run(events, tr.name, setting, rounding, device_memory, on_oom, timeline_points, progress)
    res.load_seconds = time.perf_counter() - t0 - (res.wall_seconds or 0.0)
    return res


class Comparison:
    """Results of several configurations on a trace: iterate it, index it, print it, ``to_dict()`` it."""

    def __init__(self, results):
        self.results = list(results)

    def __iter__(self):
        return iter(self.results)

    def __len__(self):
        return len(self.results)

    def __getitem__(self, i):
        if isinstance(i, str):
            for r in self.results:
                if r.label == i:
                    return r
            raise KeyError(i)
        return self.results[i]

    def to_dict(self):
        """``{"results": [ReplayResult.to_dict(), ...], "least_waste": [{"trace", "device", "label",
        "peak_reserved"}, ...]}`` (one winner per trace and device, see :meth:`least_waste`): what the CLI's
        ``--json`` writes."""
        return {"results": [r.to_dict() for r in self.results],
                "least_waste": [{"trace": trace, "device": device, "label": r.label, "peak_reserved": r.peak_reserved}
                                for (trace, device), r in self.least_waste().items()]}

    def rows(self):
        """The table as a list of dicts (one per configuration, plus the recorded run per trace/device), every
        one with the same keys (a ``csv.DictWriter`` takes them as they are): ``trace``, ``device``,
        ``setting``, ``rounding``, the table's columns in bytes, counts and seconds (None where the table shows
        "-"), ``available`` and ``error``."""
        out = []
        seen = set()
        for r in self.results:
            key = (r.trace, r.device)
            if key not in seen and r.recorded is not None:
                seen.add(key)
                rec = r.recorded
                out.append({"trace": r.trace, "device": r.device, "setting": "(recorded run)", "rounding": "",
                            "peak_requested": rec.peak_requested, "peak_allocated": None, "peak_active": None,
                            "peak_reserved": rec.peak_reserved, "final_reserved": rec.final_reserved,
                            "fragmentation": None, "device_allocs": _recorded_device_allocs(rec),
                            "device_frees": rec.segment_frees, "retries": None, "ooms": rec.ooms, "stopped": False,
                            "wall_seconds": None, "events_per_second": None, "available": True, "error": None})
            out.append({"trace": r.trace, "device": r.device, "setting": r.label, "rounding": r.rounding,
                        "peak_requested": r.peak_requested, "peak_allocated": r.peak_allocated,
                        "peak_active": r.peak_active, "peak_reserved": r.peak_reserved,
                        "final_reserved": r.final_reserved, "fragmentation": r.fragmentation,
                        "device_allocs": r.device_allocs, "device_frees": r.device_frees, "retries": r.retries,
                        "ooms": r.ooms, "stopped": r.stopped, "wall_seconds": r.wall_seconds,
                        "events_per_second": r.events_per_second, "available": r.available, "error": r.error})
        return out

    def least_waste(self):
        """The setting that reserved the least device memory at its peak, per trace and device: a dict
        ``{(trace, device): ReplayResult}``.  See :func:`least_waste`."""
        groups = {}
        for r in self.results:
            groups.setdefault((r.trace, r.device), []).append(r)
        return {key: winner for key, rs in groups.items() if (winner := _least_waste(rs)[0]) is not None}

    def format(self):
        """The plain-text table :func:`format_table` makes of the results (also ``str()`` of the comparison):
        sizes in GiB (MiB for a trace whose peaks stay below 1 GiB), a row per configuration under the recorded
        run's, a least-waste line per trace and device."""
        return format_table(self.results)

    __str__ = format

    def __repr__(self):
        return self.format()


def _recorded_device_allocs(rec, text=False):
    """The recorded run's device allocations, those before recording included (as the replay's count its
    reconstruction's); unknown before recording (expandable segments): None, or in text the count while
    recording followed by "+"."""
    if rec.initial_segments is None:
        return f"{rec.segment_allocs}+" if text else None
    n = rec.initial_segments + rec.segment_allocs
    return str(n) if text else n


def _table_unit(rs):
    """("GiB", GiB) for a trace whose peaks reach 1 GiB, else ("MiB", MiB): a small trace's figures would all
    read 0.00 in GiB."""
    peaks = [r.peak_reserved or 0 for r in rs] + [rs[0].recorded.peak_reserved if rs[0].recorded else 0]
    return ("GiB", GiB) if max(peaks) >= GiB else ("MiB", MiB)


def _is_default(r, shared_fraction):
    """The default settings: no text, and no fraction but the one every result shares (the CLI's --fraction,
    which applies to every row, the default's included)."""
    return r.conf == "" and r.fraction == shared_fraction


def _least_waste(rs):
    """(winner, default) among one trace's results, or (None, None) when none ranks.

    Ranked: the results that ran and had no OOM.  When some used NPU rounding, only those: a CUDA-rounded
    row shows what the recording allocator did, not a setting to choose.  The least peak reserved wins;
    on a tie the default setting, else the first in order.  ``default`` is the default setting's result
    under the same rounding (None when it was not run or did not rank)."""
    ranked = [r for r in rs if r.available and not r.ooms and r.peak_reserved is not None]
    if any(r.rounding == "npu" for r in ranked):
        ranked = [r for r in ranked if r.rounding == "npu"]
    if not ranked:
        return None, None
    least = min(r.peak_reserved for r in ranked)
    tied = [r for r in ranked if r.peak_reserved == least]
    fractions = {r.fraction for r in rs}
    shared_fraction = next(iter(fractions)) if len(fractions) == 1 else None
    default = next((r for r in ranked if _is_default(r, shared_fraction)), None)
    winner = default if default in tied else tied[0]
    return winner, default


def least_waste(results):
    """The result that wastes the least of one trace's results on one device (a list, or a :class:`Comparison`
    of one trace and device: :meth:`Comparison.least_waste` takes several), or None.

    Wasting least means reserving the least device memory at the peak: the requests are the same under
    every setting, so what a setting reserves beyond them is its waste.  Results with an OOM (or not
    available) are not ranked; when some used NPU rounding, CUDA-rounded ones are not either.  A tie goes
    to the default setting."""
    results = list(results)
    if len({(r.trace, r.device) for r in results}) > 1:
        raise ValueError("least_waste: the results are of several traces or devices; use Comparison.least_waste()")
    return _least_waste(results)[0]


def _verdict_line(rs):
    winner, default = _least_waste(rs)
    if winner is None:
        return "least waste: no setting ran without an OOM"
    line = (f"least waste: {winner.label}, peak reserved {format_size(winner.peak_reserved)} "
            f"({format_size(winner.peak_reserved - winner.peak_requested)} over the peak requested)")
    if default is not None and default is not winner:
        saved = default.peak_reserved - winner.peak_reserved
        line += (f"; {format_size(saved)} ({saved / default.peak_reserved:.1%}) less than the default "
                 f"({format_size(default.peak_reserved)})")
    elif default is winner and len(rs) > 1:
        line += "; no setting reserves less than the default"
    if any(r.available and r.ooms for r in rs):
        line += "; settings with OOMs are not ranked"
    return line


def format_table(results):
    """A plain-text table: one row per configuration, the recorded run's reservations first per trace."""
    cols = ["setting", "round", "peak req", "peak alloc", "peak active", "peak resv", "final resv", "frag",
            "dev allocs", "dev frees", "retries", "OOMs", "wall ms", "Mev/s"]
    rows = []
    notes = []
    groups = []
    for r in results:
        key = (r.trace, r.device)
        if not groups or groups[-1][0] != key:
            groups.append((key, []))
        groups[-1][1].append(r)
    lines = []
    for (trace, device), rs in groups:
        rows = []
        oom_lines = []
        unit, scale = _table_unit(rs)
        fmt = lambda n: "-" if n is None else f"{n / scale:,.2f}"  # noqa: E731
        rec = rs[0].recorded
        if rec is not None:
            rows.append(["(recorded run)", "", fmt(rec.peak_requested), "-", "-", fmt(rec.peak_reserved),
                         fmt(rec.final_reserved), "-", _recorded_device_allocs(rec, text=True),
                         str(rec.segment_frees), "-",
                         str(rec.ooms), "-", "-"])
        for r in rs:
            if not r.available:
                rows.append([r.label, r.rounding, "not available"] + [""] * (len(cols) - 3))
                notes.append(f"{r.label}: {r.error}")
                continue
            notes.extend(_idle_setting_notes(r))
            ooms = str(r.ooms) + (" stop" if r.stopped else "")
            rows.append([r.label, r.rounding, fmt(r.peak_requested), fmt(r.peak_allocated),
                         fmt(r.peak_active), fmt(r.peak_reserved), fmt(r.final_reserved),
                         f"{r.fragmentation:.1%}", str(r.device_allocs), str(r.device_frees), str(r.retries), ooms,
                         f"{r.wall_seconds * 1e3:.1f}", f"{r.events_per_second / 1e6:.1f}"])
            if r.oom_events:
                more = r.ooms - 1  # oom_events holds the first 64 only
                oom_lines.append("first " + describe_oom(r, r.oom_events[0]) + (f" ({more} more)" if more else ""))
        r0 = rs[0]
        lines.append(f"{trace} (device {device}): {r0.trace_events} events, reconstructed "
                     f"{r0.reconstructed_count} allocations alive before recording "
                     f"({format_size(r0.reconstructed_bytes)}); device memory {format_size(r0.device_memory)}; "
                     f"sizes in {unit}")
        widths = [max(len(cols[i]), *(len(row[i]) for row in rows)) for i in range(len(cols))]
        if any(row[2] == "not available" for row in rows):
            widths[2] = max(widths[2], len("not available"))
        fmt_row = lambda row: "  ".join(  # noqa: E731
            (c.ljust(widths[i]) if i < 2 else c.rjust(widths[i])) if not (row[2] == "not available" and i == 2)
            else c.ljust(widths[i]) for i, c in enumerate(row)).rstrip()
        lines.append(fmt_row(cols))
        lines.append("  ".join("-" * w for w in widths))
        lines.extend(fmt_row(row) for row in rows)
        lines.extend(oom_lines)
        lines.append(_verdict_line(rs))
        lines.append("")
    for n in dict.fromkeys(notes):
        lines.append(f"note: {n}")
    return "\n".join(lines).rstrip()


def compare(trace, confs=("",), device_memory="80GiB", rounding="npu", fraction=None, on_oom="continue",
            device=None, timeline_points=2048, progress=None):
    """Replays a trace under each configuration; returns a :class:`Comparison` (printable as a table).

    confs: settings texts, or dicts / :class:`Setting` objects with ``conf``, ``label``, ``fraction``,
    ``huge1g_memory``, ``rounding`` (a single text or Setting is one configuration).  ``fraction`` applies to
    the configurations that set none.  Every configuration is checked before the trace is loaded or anything
    replayed (ValueError with torch_npu's message for a settings text it refuses).  With device=None every
    device that has events is replayed.
    """
    device_memory = _check_common(device_memory, on_oom, rounding)
    _check_timeline_points(timeline_points)
    if isinstance(confs, (str, Setting)) or confs is None:
        confs = [confs]  # one setting (a str is not a list of one-letter settings)
    settings = []
    for c in confs:
        s = Setting.of(c)
        if s.fraction is None and fraction is not None:
            s = Setting(s.conf, label=s.label, fraction=fraction, huge1g_memory=s.huge1g_memory, rounding=s.rounding)
        _check_setting(s, device_memory, rounding)  # every setting before any replay
        settings.append(s)
    tr = _as_trace(trace)
    devices = sorted(tr.devices) if device is None else [device]
    results = []
    for dev in devices:
        events = tr.device_events(dev)
        for s in settings:
            results.append(_run(events, tr.name, s, rounding, device_memory, on_oom, timeline_points, progress))
    return Comparison(results)


# ---------------------------------------------------------------------------------------------------------------
# Plotting and export


def plot_timeline(results, ax=None, recorded=True, allocated="first", title=None):
    """Draws reserved bytes over the replay for each result (solid lines) and allocated bytes (a grey area for
    the first result; ``allocated="all"``: a dashed line per result; ``"none"``) on a matplotlib axis (a new
    figure's when ax is None), with the recorded run's reservations as a dotted black line; returns the axis.

    Each point is the largest value over a bucket of events (at most ``timeline_points`` buckets per replay),
    so peaks are never lost.
    """
    if isinstance(results, ReplayResult):
        results = [results]
    if allocated not in ("first", "all", "none"):
        raise ValueError(f"allocated must be 'first', 'all' or 'none', not {allocated!r}")
    results = [r for r in results if r.available and r.timeline and r.timeline[0]]
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=(11, 5))
    drawn = set()
    for i, r in enumerate(results):
        ev, al, re = r.timeline
        color = f"C{i % 10}"
        if allocated == "all" or (allocated == "first" and i == 0):
            gib = [x / GiB for x in al]
            if allocated == "first":
                ax.fill_between(ev, gib, step="post", color="0.8", lw=0, label=f"allocated ({r.label})")
            else:
                ax.step(ev, gib, where="post", color=color, lw=0.9, ls="--", alpha=0.8,
                        label=f"{r.label} allocated")
        name = r.label if r.rounding in r.label else f"{r.label} ({r.rounding})"
        ax.step(ev, [x / GiB for x in re], where="post", color=color, lw=1.6, label=f"{name} reserved")
        key = (r.trace, r.device)
        if recorded and r.recorded is not None and key not in drawn:
            drawn.add(key)
            tev, tre = r.recorded.timeline
            ax.step(tev, [x / GiB for x in tre], where="post", color="black", lw=1.2, ls=":",
                    label="recorded run reserved")
    if results and results[0].reconstructed_count:
        ax.axvline(results[0].reconstructed_count, color="0.5", lw=0.8, ls="-.")
        ax.annotate(" trace starts", (results[0].reconstructed_count, 0), xycoords=("data", "axes fraction"),
                    fontsize="x-small", color="0.4", va="bottom")
    ax.set_xlabel("event (the reconstructed allocations alive before recording first)")
    ax.set_ylabel("GiB")
    if title is None and results:
        title = f"{results[0].trace} (device {results[0].device}): reserved per setting vs allocated"
    if title:
        ax.set_title(title, fontsize="medium")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return ax


_EXPORT_MAGIC = b"NPUREPL1"


def export_events(trace, path, device=None):
    """Writes a device's replay events (reconstruction included) as the binary file benchmarks/bench_replay.c
    reads: b"NPUREPL1", u64 count, u64 reconstructed, u8 action[count] padded to 8 bytes, then u64 addr[count],
    size[count], stream[count], little-endian.  Actions: 0 alloc, 1 free, 2 a free whose completion is the
    later 3 of the same address (npualloc_replay.h).  Returns the number of events."""
    ev = _as_trace(trace).device_events(device)
    n = len(ev)
    with open(path, "wb") as f:
        f.write(_EXPORT_MAGIC + struct.pack("<QQ", n, ev.prefix))
        f.write(ev.action + bytes((-n) % 8))
        for arr in (ev.addr, ev.size, ev.stream):
            a = array("Q", arr)
            if sys.byteorder != "little":
                a.byteswap()
            f.write(a.tobytes())
    return n

