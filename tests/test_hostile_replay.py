"""Hostile snapshots for the replay lab's loader (npualloc.replay): property-based (hypothesis).

load_trace() on any bytes either returns plain data or raises TraceError (UnsafeTraceError for a pickle
that names a global: nothing in it runs); Trace() on any loaded value either builds a trace or raises
TraceError; replay() of a trace that loaded gives a consistent result.  Never another exception, never
a crash.  The C engine under the loader is fuzzed by fuzz/fuzz_replay.c.
"""
import json
import os
import pickle
import tempfile

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis.configuration import set_hypothesis_home_dir  # noqa: E402

# hypothesis keeps caches in ./.hypothesis: put them with the other build products
set_hypothesis_home_dir(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build",
                                     "hypothesis"))
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from npualloc import replay  # noqa: E402

SETTINGS = settings(max_examples=int(os.environ.get("NPUALLOC_HYPOTHESIS_EXAMPLES", "300")), deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

MiB = 1 << 20


def valid_snapshot():
    """A small, real-looking snapshot: two devices, allocs and frees, a segment with a live block."""
    traces = [[], []]
    addr = 0x7F0000000000
    for i in range(12):
        traces[0].append({"action": "alloc", "addr": addr + i * MiB, "size": 1000 * (i + 1), "stream": 0})
        if i % 3:
            traces[0].append({"action": "free_requested", "addr": addr + i * MiB, "size": 1000 * (i + 1),
                              "stream": 0})
            traces[0].append({"action": "free_completed", "addr": addr + i * MiB, "size": 1000 * (i + 1),
                              "stream": 0})
    traces[0].append({"action": "segment_alloc", "addr": addr, "size": 20 * MiB, "stream": 0})
    traces[1].append({"action": "alloc", "addr": 0x9000, "size": 5 * MiB, "stream": 7})
    segments = [{"device": 0, "address": addr, "total_size": 20 * MiB, "allocated_size": 4096, "stream": 0,
                 "blocks": [{"address": addr + 64 * MiB, "size": 4096, "requested_size": 4000,
                             "state": "active_allocated"}]}]
    return {"segments": segments, "device_traces": traces, "allocator_settings": {"expandable_segments": False}}


def load_bytes(data):
    """load_trace() of a temporary file holding data."""
    fd, path = tempfile.mkstemp(suffix=".pickle")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return replay.load_trace(path)
    finally:
        os.unlink(path)


def check_result(r):
    assert r.events >= 0
    assert r.peak_allocated <= r.peak_reserved
    assert r.final_allocated <= r.final_reserved <= r.peak_reserved
    assert 0.0 <= r.fragmentation <= 1.0
    assert r.allocs >= r.live_allocations
    # what the CLI prints and writes of it: the table, the repr, strict JSON
    replay.format_table([r])
    repr(r)
    json.dumps(replay.Comparison([r]).to_dict(), allow_nan=False)


def load_trace_and_replay(value):
    """Trace() of a loaded value, then replay every device; returns the results or raises TraceError."""
    tr = replay.Trace(value, name="fuzzed")
    results = []
    for dev in sorted(tr.devices):
        r = replay.replay(tr, device=dev, device_memory="4GiB", timeline_points=64)
        check_result(r)
        results.append(r)
    return results


@SETTINGS
@given(st.binary(max_size=4096))
def test_arbitrary_bytes_load_or_raise_trace_error(data):
    try:
        value = load_bytes(data)
    except replay.TraceError:
        return
    try:
        load_trace_and_replay(value)
    except replay.TraceError:
        pass


@st.composite
def mutated_pickle(draw):
    proto = draw(st.integers(min_value=0, max_value=pickle.HIGHEST_PROTOCOL))
    data = bytearray(pickle.dumps(valid_snapshot(), protocol=proto))
    for _ in range(draw(st.integers(min_value=1, max_value=8))):
        kind = draw(st.sampled_from(["flip", "set", "cut", "insert", "delete"]))
        if not data:
            break
        at = draw(st.integers(min_value=0, max_value=len(data) - 1))
        if kind == "flip":
            data[at] ^= 1 << draw(st.integers(min_value=0, max_value=7))
        elif kind == "set":
            data[at] = draw(st.integers(min_value=0, max_value=255))
        elif kind == "cut":
            del data[at:]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        else:
            del data[at:at + draw(st.integers(min_value=1, max_value=16))]
    return bytes(data)


@SETTINGS
@given(mutated_pickle())
def test_mutated_snapshot_pickles_load_or_raise_trace_error(data):
    try:
        value = load_bytes(data)
    except replay.TraceError:
        return
    try:
        load_trace_and_replay(value)
    except replay.TraceError:
        pass


# Snapshot-shaped values whose fields hold anything plain data can hold.
leaf = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                 st.floats(allow_nan=True), st.text(max_size=8), st.binary(max_size=8),
                 st.sampled_from(["alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
                                  "segment_map", "segment_unmap", "oom", "snapshot", "active_allocated",
                                  "active_pending_free", "inactive"]))
anything = st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(st.text(max_size=8), inner, max_size=4),
                                                      st.tuples(inner, inner)), max_leaves=12)
KEYS = ["action", "addr", "size", "stream", "address", "total_size", "allocated_size", "requested_size", "state",
        "blocks", "device"]
entry = st.dictionaries(st.sampled_from(KEYS), st.one_of(anything, st.integers(min_value=0, max_value=2**64 + 5)),
                        max_size=6)
snapshot_like = st.fixed_dictionaries(
    {},
    optional={"segments": st.one_of(st.lists(entry, max_size=4), anything),
              "device_traces": st.one_of(st.lists(st.lists(entry, max_size=12), max_size=3), anything),
              "allocator_settings": anything})


@SETTINGS
@given(snapshot_like)
def test_snapshot_shaped_values_trace_or_raise_trace_error(value):
    try:
        load_trace_and_replay(value)
    except replay.TraceError:
        pass
    # the same value through a pickle file
    try:
        data = pickle.dumps(value)
    except (pickle.PicklingError, RecursionError):
        return
    try:
        loaded = load_bytes(data)
    except replay.TraceError:
        return
    try:
        load_trace_and_replay(loaded)
    except replay.TraceError:
        pass


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


@pytest.mark.parametrize("payload", [
    pickle.dumps(_Evil()),
    pickle.dumps({"segments": [], "device_traces": [[_Evil()]]}),
    b"cos\nsystem\n(S'true'\ntR.",
    b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x94\x8c\x06system\x94\x93\x94.",
    b"\x80\x02cbuiltins\neval\nq\x00X\x04\x00\x00\x001+1qq\x01\x85q\x02Rq\x03.",
])
def test_pickles_naming_globals_are_refused_before_anything_runs(payload):
    with pytest.raises(replay.UnsafeTraceError):
        load_bytes(payload)


def test_memo_index_bomb_is_a_trace_error():
    # EMPTY_DICT, LONG_BINPUT 2**32-1, STOP: the unpickler asks for a 32 GiB memo and fails (MemoryError);
    # with 2**28 it would really take 4 GiB
    with pytest.raises(replay.TraceError):
        load_bytes(b"}r\xff\xff\xff\xff.")
    # BINBYTES8 of 2**56 bytes in a 10-byte file: the unpickler allocates the bytes before reading them
    with pytest.raises(replay.TraceError):
        load_bytes(b"\x8e\x00\x00\x00\x00\x00\x00\x00\x01.")


def test_unhashable_action_is_a_trace_error():
    with pytest.raises(replay.TraceError):
        replay.Trace({"device_traces": [[{"action": {}, "addr": 1, "size": 1}]]})


def test_deep_nesting_and_truncation_are_trace_errors():
    def load_and_trace(data):
        load_trace_and_replay(load_bytes(data))

    many = b"\x80\x02" + b"]" * 200000 + b"."  # 200000 empty lists on the stack
    with pytest.raises(replay.TraceError):
        load_and_trace(many)
    nested = b"(" * 100000 + b"l" * 100000 + b"."  # lists nested 100000 deep
    with pytest.raises(replay.TraceError):
        load_and_trace(nested)
    nested_dict = b"\x80\x02}X\x0d\x00\x00\x00device_traces" + b"(" * 50000 + b"l" * 50000 + b"s."
    with pytest.raises(replay.TraceError):
        load_and_trace(nested_dict)
    good = pickle.dumps(valid_snapshot())
    for cut in (1, 2, len(good) // 2, len(good) - 1):
        with pytest.raises(replay.TraceError):
            load_bytes(good[:cut])
    with pytest.raises(replay.TraceError):
        load_bytes(b"")
    assert load_trace_and_replay(load_bytes(good))


def test_trace_rejects_non_snapshots_with_trace_error():
    for value in (None, 5, "x", b"x", [], [1, 2], {}, {"device_traces": 5}, {"device_traces": [5]},
                  {"device_traces": [[]], "segments": 5}, {"device_traces": [[{"action": "alloc"}]]},
                  {"device_traces": [[{"action": "alloc", "addr": -1, "size": 5}]]},
                  {"device_traces": [[{"action": "alloc", "addr": 1, "size": 2**64}]]},
                  {"device_traces": [[5]]}):
        with pytest.raises(replay.TraceError):
            load_trace_and_replay(value)
    with pytest.raises(replay.TraceError):
        replay.Trace.load("/nonexistent/x.pickle")
    with pytest.raises(replay.TraceError):
        replay.Trace.load(tempfile.gettempdir())


def test_settings_that_nest_too_deep_or_hold_themselves_are_trace_errors():
    # to_dict() and json.dump recurse once per level: such settings broke them (RecursionError) after loading
    def trace(settings):
        return replay.Trace({"device_traces": [[{"action": "alloc", "addr": 1, "size": 1}]],
                             "allocator_settings": settings})

    loop = []
    loop.append(loop)
    deep = 1
    for _ in range(40):
        deep = [deep]
    for settings in ({"x": loop}, {"x": deep}):
        with pytest.raises(replay.TraceError, match="'allocator_settings' nests more than 32 levels deep"):
            trace(settings)
    fine = 1
    for _ in range(31):  # with the dict itself, 32 levels
        fine = [fine]
    assert json.dumps(replay.replay(trace({"x": fine})).to_dict())
