"""The memory history with Python stacks: _record_memory_history's levels, the frames of blocks,
segments and trace entries, the ring buffer, disabling, OOM entries and _dump_snapshot's plain
pickle (torch.cuda.memory semantics; the torch-viewer check is in test_history_viz.py).

The allocator follows torch exactly where it keeps contexts: a free's trace entries fall back to
the block's allocation stack, a segment free to the segment's, a segment keeps its stack only
until its front block is split off, and empty_cache records its own stack.
"""
import inspect
import io
import json
import os
import pickle
import stat
import sys
import threading
import time

import pytest

import npualloc
from conftest_memory import GiB, MiB, mem  # noqa: F401

memory = npualloc.memory
alloc = npualloc.caching_allocator_alloc
free = npualloc.caching_allocator_delete

WHOLE_SEGMENT = 20 * MiB - 32  # rounds to exactly one 20 MiB segment: nothing is split off


@pytest.fixture
def hist(mem):
    """A fresh runtime; whatever history a test starts is stopped at the end."""
    yield mem
    memory._record_memory_history(None)


def snap_json():
    return json.dumps(memory._snapshot())


def line_of(fn, text):
    """The line number of the first line of fn's source that contains text."""
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


def block_at(snap, ptr):
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["address"] == ptr:
                return seg, b
    raise AssertionError(f"no block at {ptr:#x}")


def entries(snap, device=0):
    return snap["device_traces"][device]


# ---- the context levels, as torch's test_memory_plots_free_stack / free_segment_stack ----

def _free_stack(context, api):
    memory._record_memory_history(context=context)
    x = None

    def thealloc():
        nonlocal x
        x = alloc(3 * 4 * 4) if api == "ptr" else npualloc.empty(3 * 4 * 4)

    def thefree():
        nonlocal x
        if api == "ptr":
            free(x)
        x = None  # a Buffer is freed when its last reference goes

    thealloc()
    thefree()
    ss = snap_json()
    assert ("thefree" in ss) == (context == "all")
    assert ("thealloc" in ss) == (context != "state")


@pytest.mark.parametrize("api", ["ptr", "buffer"])
@pytest.mark.parametrize("context", ["alloc", "all"])
def test_free_stack(hist, context, api):
    _free_stack(context, api)


@pytest.mark.parametrize("api", ["ptr", "buffer"])
def test_free_stack_state(hist, api):
    # torch keeps no allocation stack once the block is freed, and the segment's own stack stays
    # with the remainder block that the freed front merges away
    _free_stack("state", api)


def _free_segment_stack(context):
    memory._record_memory_history(context=context)
    x = alloc(3 * 4 * 4)
    free(x)
    npualloc.empty_cache()
    ss = snap_json()
    assert ("empty_cache" in ss) == (context == "all")
    assert [e["action"] for e in entries(memory._snapshot())][-2:] == ["segment_free", "snapshot"]


@pytest.mark.parametrize("context", ["alloc", "state"])
def test_free_segment_stack(hist, context):
    _free_segment_stack(context)


def test_free_segment_stack_all(hist):
    _free_segment_stack("all")


# ---- frames ----

def test_frames_are_python_frames_innermost_first(hist):
    memory._record_memory_history(stacks="python")

    def inner():
        return alloc(100)

    def outer():
        return inner()

    p = outer()
    snap = memory._snapshot()
    _, blk = block_at(snap, p)
    frames = blk["frames"]
    assert all(list(f) == ["name", "filename", "line"] for f in frames)
    assert all(type(f["name"]) is str and type(f["filename"]) is str and type(f["line"]) is int for f in frames)
    assert frames[0] == {"name": "inner", "filename": __file__, "line": line_of(inner, "alloc(100)")}
    assert frames[1] == {"name": "outer", "filename": __file__, "line": line_of(outer, "inner()")}
    assert frames[2]["name"] == "test_frames_are_python_frames_innermost_first"
    assert len(frames) > 3  # ... down to the outermost frame (pytest's)
    assert frames[-1]["line"] >= 0
    trace = entries(snap)
    assert [e["action"] for e in trace] == ["segment_alloc", "alloc"]
    assert all(e["frames"] == frames for e in trace)
    free(p)


def test_stacks_all_records_the_python_frames(hist):
    memory._record_memory_history(stacks="all")  # no C++ frames exist here: the same frames

    def where():
        return alloc(100)

    p = where()
    assert block_at(memory._snapshot(), p)[1]["frames"][0]["name"] == "where"
    free(p)


def test_segment_frames(hist):
    memory._record_memory_history()

    def grow():
        return alloc(WHOLE_SEGMENT)

    p = grow()
    seg, blk = block_at(memory._snapshot(), p)
    assert seg["total_size"] == 20 * MiB and len(seg["blocks"]) == 1
    assert seg["frames"] == blk["frames"] and seg["frames"][0]["name"] == "grow"
    free(p)
    seg = memory._snapshot()["segments"][0]  # cached, inactive: the block's stack is gone
    assert seg["blocks"][0]["frames"] == [] and seg["frames"][0]["name"] == "grow"


def test_split_segment_loses_its_frames_as_torch(hist):
    memory._record_memory_history()

    def small():
        return alloc(100)

    p = small()
    seg, blk = block_at(memory._snapshot(), p)
    assert blk["frames"][0]["name"] == "small"
    assert seg["frames"] == []  # torch: the segment's stack stays with the split-off remainder
    free(p)


def test_buffer_frames(hist):
    memory._record_memory_history()

    def make():
        return npualloc.empty(1000)

    def drop(b):
        b.free()

    b = make()
    ptr = b.ptr
    assert block_at(memory._snapshot(), ptr)[1]["frames"][0]["name"] == "make"
    drop(b)
    trace = entries(memory._snapshot())
    assert [(e["action"], e["frames"][0]["name"]) for e in trace if e["action"].startswith("free")] == [
        ("free_requested", "drop"), ("free_completed", "drop")]


def test_frames_of_another_thread(hist):
    memory._record_memory_history()
    out = []

    def worker():
        out.append(alloc(100))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    frames = block_at(memory._snapshot(), out[0])[1]["frames"]
    assert frames[0]["name"] == "worker"
    assert "test_frames_of_another_thread" not in json.dumps(frames)  # that thread's own stack
    free(out[0])


def test_deep_stack(hist):
    memory._record_memory_history()

    def down(k):
        return alloc(100) if k == 0 else down(k - 1)

    p = down(300)  # more frames than the gathering buffer starts with
    frames = block_at(memory._snapshot(), p)[1]["frames"]
    assert [f["name"] for f in frames[:301]] == ["down"] * 301
    assert frames[301]["name"] == "test_deep_stack"
    free(p)


def test_threads_allocating_while_snapshots_are_taken(hist):
    memory._record_memory_history(max_entries=1000)
    errors = []

    def worker(i):
        try:
            for k in range(200):
                if i == 0 and k % 20 == 0:
                    memory._snapshot()
                free(alloc(100 + k))
        except BaseException as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    trace = entries(memory._snapshot())
    assert len(trace) == 1000
    assert {e["frames"][0]["name"] for e in trace if e["action"] == "alloc"} == {"worker"}


def test_one_stack_is_shared(hist):
    memory._record_memory_history()
    ptrs = [alloc(100) for _ in range(3)]  # one line, one stack
    snap = memory._snapshot()
    frames = [block_at(snap, p)[1]["frames"] for p in ptrs]
    assert frames[0] == frames[1] == frames[2]
    assert frames[0] is frames[1] is frames[2]  # as torch's py_symbolize: one list per stack
    for p in ptrs:
        free(p)


# ---- what each level keeps ----

def _actions_with_frames(trace):
    return [(e["action"], e["frames"][0]["name"] if "frames" in e else None) for e in trace]


def _alloc_free(context):
    memory._record_memory_history(context=context)

    def a():
        return alloc(1000)

    def f(p):
        free(p)

    p = a()
    blk = block_at(memory._snapshot(), p)[1]
    f(p)
    return blk, entries(memory._snapshot())


def test_context_none(hist):
    blk, trace = _alloc_free(None)
    assert blk["frames"] == []
    assert _actions_with_frames(trace) == [("segment_alloc", None), ("alloc", None), ("snapshot", None),
                                           ("free_requested", None), ("free_completed", None)]


def test_context_state(hist):
    blk, trace = _alloc_free("state")
    assert blk["frames"][0]["name"] == "a"
    assert all("frames" not in e for e in trace)  # trace entries keep no stack below "alloc"


def test_context_alloc_frees_show_the_allocation(hist):
    blk, trace = _alloc_free("alloc")
    assert blk["frames"][0]["name"] == "a"
    # torch: a free gathers no stack below "all", and its entries fall back to the block's
    assert _actions_with_frames(trace) == [("segment_alloc", "a"), ("alloc", "a"), ("snapshot", None),
                                           ("free_requested", "a"), ("free_completed", "a")]


def test_context_alloc_allocations(hist):
    _, trace = _alloc_free("alloc")
    assert _actions_with_frames(trace)[:3] == [("segment_alloc", "a"), ("alloc", "a"), ("snapshot", None)]
    assert all("frames" not in e or e["frames"][0]["name"] != "f" for e in trace)  # the free's stack: never


def test_context_all(hist):
    blk, trace = _alloc_free("all")
    assert blk["frames"][0]["name"] == "a"
    assert _actions_with_frames(trace) == [("segment_alloc", "a"), ("alloc", "a"), ("snapshot", None),
                                           ("free_requested", "f"), ("free_completed", "f")]


# ---- the ring buffer, "state", disabling ----

def test_ring_buffer_keeps_the_last_entries(hist):
    keep = alloc(100)  # the small segment exists: the loop adds no segment entries
    memory._record_memory_history(max_entries=5)
    for i in range(1, 11):
        free(alloc(i * 1000))
    trace = entries(memory._snapshot())
    assert [(e["action"], e["size"]) for e in trace] == [
        ("free_requested", 9000), ("free_completed", 9000), ("alloc", 10000), ("free_requested", 10000),
        ("free_completed", 10000)]
    times = [e["time_us"] for e in trace]
    assert times == sorted(times)  # oldest first
    trace = entries(memory._snapshot())  # the previous snapshot's entry is the newest now
    assert trace[-1]["action"] == "snapshot" and len(trace) == 5
    free(keep)


def test_enabled_state_keeps_one_entry(hist):
    memory._record_memory_history("state", max_entries=1000)

    def a():
        return alloc(100)

    p = a()
    q = a()
    snap = memory._snapshot()
    assert [e["action"] for e in entries(snap)] == ["alloc"]
    assert block_at(snap, p)[1]["frames"][0]["name"] == "a"
    for x in (p, q):
        free(x)


def test_disabling_clears_the_history(hist):
    memory._record_memory_history()

    def a():
        return alloc(100)

    p = a()
    memory._record_memory_history(None)
    q = a()
    snap = memory._snapshot()
    assert snap["device_traces"] == [[], []]
    assert block_at(snap, q)[1]["frames"] == []  # nothing gathered any more
    assert block_at(snap, p)[1]["frames"][0]["name"] == "a"  # as torch: a live block keeps its stack
    memory._record_memory_history()  # a new start has an empty history
    assert entries(memory._snapshot()) == []
    free(p)
    free(q)


def test_restart_stops_the_history(hist):
    memory._record_memory_history()
    hist()  # _C.shutdown() and a new runtime
    p = alloc(100)
    snap = memory._snapshot()
    assert snap["device_traces"] == [[], []] and block_at(snap, p)[1]["frames"] == []
    free(p)


def test_oom_entry(hist):
    memory._record_memory_history()

    def too_big():
        return alloc(2 * GiB)

    with pytest.raises(npualloc.OutOfMemoryError):
        too_big()
    oom = entries(memory._snapshot())[-1]
    assert list(oom) == ["action", "device_free", "size", "stream", "time_us", "compile_context", "user_metadata",
                         "frames"]
    assert oom["action"] == "oom" and oom["size"] == 2 * GiB + 512 and oom["device_free"] == GiB
    assert oom["frames"][0]["name"] == "too_big"


def test_history_of_each_device(hist):
    memory._record_memory_history()
    p = alloc(100, device=1)
    snap = memory._snapshot()
    assert entries(snap, 0) == [] and [e["action"] for e in entries(snap, 1)] == ["segment_alloc", "alloc"]
    free(p)


# ---- arguments ----

def test_argument_errors(hist):
    with pytest.raises(RuntimeError, match=r"^expected state to be 'state', 'all', or None$"):
        memory._record_memory_history("yes")
    with pytest.raises(RuntimeError, match=r"^expected context to be 'state', 'alloc', 'all', or None$"):
        memory._record_memory_history(context="some")
    with pytest.raises(RuntimeError, match=r"^expected stacks to be 'python', or 'all'$"):
        memory._record_memory_history(stacks="cpp")
    for kwargs in (dict(enabled=1), dict(context=2), dict(stacks=None), dict(max_entries="3"),
                   dict(max_entries=-1), dict(max_entries=2**64), dict(max_entries=5.0), dict(bogus=1)):
        with pytest.raises(TypeError):
            memory._record_memory_history(**kwargs)
    assert list(inspect.signature(memory._record_memory_history).parameters) == [
        "enabled", "context", "stacks", "max_entries", "device", "clear_history", "compile_context",
        "global_record_annotations", "skip_actions"]


def test_bools_and_counts_convert_as_torchs_pybind11_binding_converts_them(hist):
    # pybind11: a bool parameter takes None (False) and anything with __bool__ by its truth, not a str;
    # a size_t or int64 takes an int (a bool is one) or an __index__ in range, not a float or a str.
    memory._record_memory_history(max_entries=True, clear_history=1, compile_context=None,
                                  global_record_annotations=0)
    p = alloc(100)
    q = alloc(100)
    assert [e["action"] for e in entries(memory._snapshot())] == ["alloc"]   # max_entries=True: 1 entry
    memory._record_memory_history(max_entries=3, clear_history=1.5)        # a float has __bool__: True
    assert entries(memory._snapshot()) == []
    memory._record_memory_history(True, record_context=None, trace_alloc_max_entries=True,
                                  trace_alloc_record_context=1, clear_history=0)
    free(q)
    snap = memory._snapshot()
    assert [e["action"] for e in entries(snap)] == ["free_completed"] and "frames" in entries(snap)[0]
    for legacy in (dict(trace_alloc_max_entries=2**63), dict(trace_alloc_max_entries=1.0),
                   dict(record_context="yes"), dict(clear_history=[1])):
        with pytest.raises(TypeError):
            memory._record_memory_history(True, **legacy)
    free(p)


def test_newer_keywords_are_checked_as_torch_checks_them(hist):
    for kwargs in (dict(compile_context="yes"), dict(global_record_annotations=[]),
                   dict(skip_actions="alloc"), dict(skip_actions=[1]), dict(skip_actions={"alloc"}),
                   dict(record_pinned_host_memory=True), dict(record_cuda=True)):
        with pytest.raises(TypeError):
            memory._record_memory_history(**kwargs)
        with pytest.raises(TypeError):
            memory._record_memory_history(True, **kwargs)
    for form in ((), (True,)):
        with pytest.raises(RuntimeError, match=r"^Unknown TraceEntry action: free$"):
            memory._record_memory_history(*form, skip_actions=["alloc", "free"])
    # the option checks come first, as in torch's binding
    with pytest.raises(RuntimeError, match=r"^expected state to be"):
        memory._record_memory_history("yes", skip_actions=["free"])
    # a rejected call changes nothing
    assert memory._snapshot()["device_traces"] == [[], []]
    p = alloc(100)
    assert memory._snapshot()["device_traces"] == [[], []]
    free(p)


def test_entries_carry_torchs_compile_context_and_user_metadata(hist):
    memory._record_memory_history()
    p = alloc(100)
    assert memory._get_memory_metadata() == ""
    memory._set_memory_metadata("step 1 \u00e9")
    assert memory._get_memory_metadata() == "step 1 \u00e9"
    free(p)
    memory._set_memory_metadata("")
    q = alloc(100)
    got = [(e["action"], e["compile_context"], e["user_metadata"]) for e in entries(memory._snapshot())]
    assert got == [("segment_alloc", "N/A", ""), ("alloc", "N/A", ""), ("free_requested", "N/A", "step 1 \u00e9"),
                   ("free_completed", "N/A", "step 1 \u00e9"), ("alloc", "N/A", "")]
    with pytest.raises(TypeError, match="argument 'metadata' must be str, not bytes"):
        memory._set_memory_metadata(b"x")
    assert memory._get_memory_metadata() == ""
    npualloc.set_device(1)
    memory._set_memory_metadata("on 1")              # per device, as torch's
    npualloc.set_device(0)
    assert memory._get_memory_metadata() == ""
    r = alloc(100, device=1)
    assert [(e["action"], e["user_metadata"]) for e in entries(memory._snapshot(), 1)] == [
        ("snapshot", ""), ("segment_alloc", "on 1"), ("alloc", "on 1")]   # (the first snapshot's entry)
    free(q)
    free(r)


def test_skip_actions_are_not_recorded(hist):
    memory._record_memory_history(skip_actions=["free_requested", "segment_alloc", "snapshot"])
    p = alloc(100)
    free(p)
    memory._snapshot()
    assert [e["action"] for e in entries(memory._snapshot())] == ["alloc", "free_completed"]
    # each call sets the list anew: none skipped now (the history so far is kept)
    memory._record_memory_history(skip_actions=None)
    p = alloc(100)
    assert [e["action"] for e in entries(memory._snapshot())] == ["alloc", "free_completed", "alloc"]
    memory._record_memory_history(True, trace_alloc_max_entries=100, skip_actions=["alloc"])  # legacy form
    free(p)
    alloc_again = alloc(100)
    assert [e["action"] for e in entries(memory._snapshot())][-3:] == ["snapshot", "free_requested",
                                                                       "free_completed"]
    free(alloc_again)


def test_history_is_kept_unless_cleared(hist):
    memory._record_memory_history()
    p = alloc(100)
    memory._record_memory_history(context=None)  # as torch >= 2.3: changing options keeps the history
    q = alloc(200)
    assert [(e["action"], e["size"]) for e in entries(memory._snapshot())] == [
        ("segment_alloc", 2 * MiB), ("alloc", 100), ("alloc", 200)]
    memory._record_memory_history(max_entries=2)  # a smaller ring keeps the newest entries
    assert [(e["action"], e["size"]) for e in entries(memory._snapshot())] == [("alloc", 200), ("snapshot", 1024)]
    free(p)
    assert [e["action"] for e in entries(memory._snapshot())] == ["free_requested", "free_completed"]
    memory._record_memory_history(clear_history=True)
    assert entries(memory._snapshot()) == []
    free(q)
    memory._record_memory_history(True, trace_alloc_max_entries=10, clear_history=True)  # legacy form too
    assert entries(memory._snapshot()) == []
    memory._record_memory_history(None)
    memory._record_memory_history()  # stopping cleared it
    assert entries(memory._snapshot()) == []


def test_history_kept_across_a_wrapped_ring_stays_in_order(hist):
    memory._record_memory_history(max_entries=5)
    ptrs = [alloc(1000 + 512 * i) for i in range(7)]  # segment_alloc and 7 allocs wrap the ring of 5
    memory._record_memory_history(max_entries=3)
    assert [(e["action"], e["size"]) for e in entries(memory._snapshot())] == [
        ("alloc", 1000 + 512 * 4), ("alloc", 1000 + 512 * 5), ("alloc", 1000 + 512 * 6)]
    active = memory.memory_stats()["active_bytes.all.current"]  # the snapshot entry's size
    memory._record_memory_history(max_entries=10)
    for p in ptrs[:2]:
        free(p)
    assert [(e["action"], e["size"]) for e in entries(memory._snapshot())] == [
        ("alloc", 1000 + 512 * 5), ("alloc", 1000 + 512 * 6), ("snapshot", active),
        ("free_requested", 1000), ("free_completed", 1000), ("free_requested", 1512), ("free_completed", 1512)]
    for p in ptrs[2:]:
        free(p)


def test_compile_context_and_global_annotations_are_accepted(hist):
    """Nothing here compiles regions or records annotations: the flags record the same history."""
    memory._record_memory_history(compile_context=True, global_record_annotations=True)
    p = alloc(100)
    snap = memory._snapshot()
    assert [e["action"] for e in entries(snap)] == ["segment_alloc", "alloc"]
    assert snap["external_annotations"] == []
    free(p)


def test_signature_follows_torch():
    torch_memory = pytest.importorskip("torch.cuda.memory")
    ours = inspect.signature(memory._record_memory_history).parameters
    theirs = inspect.signature(torch_memory._record_memory_history_impl).parameters
    assert list(ours) == list(theirs)
    assert [p.default for p in ours.values()] == [p.default for p in theirs.values()]
    legacy = inspect.signature(memory._record_memory_history_legacy).parameters
    assert list(legacy) == list(inspect.signature(torch_memory._record_memory_history_legacy).parameters)


def test_legacy_bool_form(hist):
    def a():
        return alloc(100)

    memory._record_memory_history(True)  # record_context=True: STATE, one entry
    p = a()
    snap = memory._snapshot()
    assert block_at(snap, p)[1]["frames"][0]["name"] == "a"
    assert [("frames" in e, e["action"]) for e in entries(snap)] == [(False, "alloc")]
    memory._record_memory_history(True, trace_alloc_max_entries=10, trace_alloc_record_context=True)  # ALLOC
    q = a()
    assert [("frames" in e, e["action"]) for e in entries(memory._snapshot())] == [
        (False, "snapshot"), (True, "alloc")]  # the ring of 1 so far is kept, as torch >= 2.3
    memory._record_memory_history(True, record_context=False, trace_alloc_max_entries=10,
                                  clear_history=True)  # NEVER
    r = a()
    snap = memory._snapshot()
    assert block_at(snap, r)[1]["frames"] == [] and [e["action"] for e in entries(snap)] == ["alloc"]
    memory._record_memory_history(False)
    assert memory._snapshot()["device_traces"] == [[], []]
    with pytest.raises(TypeError):
        memory._record_memory_history(True, record_context="1")
    for x in (p, q, r):
        free(x)


# ---- _dump_snapshot ----

class _NoGlobals(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"global {module}.{name} refused")


def _plain_types(obj, seen):
    seen.add(type(obj))
    if isinstance(obj, dict):
        for k, v in obj.items():
            assert type(k) is str
            _plain_types(v, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _plain_types(v, seen)
    return seen


def test_dump_snapshot_is_plain(hist, tmp_path):
    memory._record_memory_history()

    def a():
        return alloc(1000), npualloc.empty(5 * MiB)

    p, buf = a()
    with pytest.raises(npualloc.OutOfMemoryError):
        alloc(2 * GiB)
    path = tmp_path / "snap.pickle"
    memory._dump_snapshot(str(path))
    data = _NoGlobals(io.BytesIO(path.read_bytes())).load()
    assert _plain_types(data, set()) <= {dict, list, tuple, int, float, str, bool}
    assert "a" in {f["name"] for seg in data["segments"] for b in seg["blocks"] for f in b["frames"]}
    assert {e["action"] for e in data["device_traces"][0]} >= {"segment_alloc", "alloc", "oom"}
    expect = memory._snapshot()
    for trace in expect["device_traces"]:  # less the dump's own "snapshot" entries
        assert trace[-1]["action"] == "snapshot"
        del trace[-1]
    assert data == expect
    free(p)
    buf.free()


def test_snapshot_takes_torchs_augment_with_fx_traces(hist, tmp_path):
    memory._record_memory_history()
    p = alloc(1000)
    plain, augmented = memory._snapshot(), memory._snapshot(augment_with_fx_traces=True)
    for snap in (plain, augmented):  # less the snapshots' own entries
        snap["device_traces"] = [[e for e in t if e["action"] != "snapshot"] for t in snap["device_traces"]]
    assert augmented == plain and plain["device_traces"][0]  # no FX-generated frames here: nothing to add
    memory._dump_snapshot(str(tmp_path / "s.pickle"), augment_with_fx_traces=True)
    assert "segments" in _NoGlobals(io.BytesIO((tmp_path / "s.pickle").read_bytes())).load()
    free(p)


def test_history_off_keeps_no_frames(hist):
    p = alloc(100)
    assert block_at(memory._snapshot(), p)[1]["frames"] == []
    free(p)


def test_expandable_segments_record_segment_map_and_unmap(hist):
    hist(alloc_conf="expandable_segments:True")
    memory._record_memory_history("all")
    a = npualloc.caching_allocator_alloc(30 * MiB)  # two 20 MiB pages of the large pool's range
    npualloc.caching_allocator_delete(a)
    npualloc.empty_cache()
    acts = [(e["action"], e["size"]) for e in entries(memory._snapshot())]
    # entries carry the requested size, as torch's; the 32 MiB block needs two 20 MiB pages
    assert acts == [("segment_map", 40 * MiB), ("alloc", 30 * MiB), ("free_requested", 30 * MiB),
                    ("free_completed", 30 * MiB), ("segment_unmap", 40 * MiB)]


def test_dump_snapshot_file_mode_follows_umask(hist, tmp_path):
    """torch writes with open(filename, "wb"): mode 0666 less the umask, not a private 0600."""
    old = os.umask(0o022)
    try:
        path = tmp_path / "mode.pickle"
        memory._dump_snapshot(str(path))
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
        os.umask(0o002)
        path2 = tmp_path / "mode2.pickle"
        memory._dump_snapshot(str(path2))
        assert stat.S_IMODE(path2.stat().st_mode) == 0o664
    finally:
        os.umask(old)


def test_dump_snapshot_truncates_an_existing_file(hist, tmp_path):
    path = tmp_path / "old.pickle"
    path.write_bytes(b"x" * (1 << 20))
    memory._dump_snapshot(str(path))
    assert _NoGlobals(io.BytesIO(path.read_bytes())).load().keys() >= {"segments", "device_traces"}


def test_concurrent_history_calls_leave_the_python_level_as_the_allocator_records(mem):
    """Two threads turning the history on and off: whichever C call ended last, the level the binding
    gathers stacks for is the level the allocator records at (it was the level of whichever thread set it
    last, so allocations were recorded without frames).  A third thread keeps a GIL-releasing call in
    flight, so that the history calls release the GIL too."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        mismatches = []
        for it in range(25):
            stop = threading.Event()

            def loop(fn):
                while not stop.is_set():
                    fn()
            threads = [threading.Thread(target=loop, args=(f,)) for f in (
                lambda: memory._record_memory_history("all", context="all", stacks="python"),
                lambda: memory._record_memory_history(None),
                npualloc.empty_cache)]
            for t in threads:
                t.start()
            time.sleep(0.04)
            stop.set()
            for t in threads:
                t.join()
            p = alloc(MiB)
            entry = next((e for e in memory._snapshot()["device_traces"][0]
                          if e["action"] == "alloc" and e["addr"] == p), None)
            free(p)
            if entry is not None and not entry.get("frames"):
                mismatches.append(it)
            memory._record_memory_history(None)
        assert mismatches == []
    finally:
        sys.setswitchinterval(old)
