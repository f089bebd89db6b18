"""Streams, events, current streams, record_stream / erase_stream and the states of freed blocks."""
import threading
import time

import pytest

import npualloc
from conftest import held
from conftest_memory import MiB, block_of, check_all, layout, mem, run_python, segment_of  # noqa: F401

alloc = npualloc.caching_allocator_alloc
free = npualloc.caching_allocator_delete

SLEEP = 0.3


# ---- Stream, Event, current streams ----

def test_stream_basics(mem):
    s = npualloc.Stream()
    t = npualloc.Stream(device=1)
    assert s.device == 0 and t.device == 1 and s.npu_stream != 0 and t.npu_stream != s.npu_stream
    assert repr(s) == f"<npualloc.Stream device=npu:0 npu_stream={s.npu_stream:#x}>"
    assert s == npualloc.Stream._wrap(s.npu_stream, 0) and s != t and len({s, t, s}) == 2
    d = npualloc.default_stream()
    assert d.npu_stream == 0 and d.device == 0 and npualloc.default_stream(1).device == 1
    assert npualloc.current_stream() == d and npualloc.current_stream(1) == npualloc.default_stream(1)
    assert s.query()
    gate = held(s.npu_stream)
    assert not s.query()
    gate.set()
    s.synchronize()
    assert s.query()
    t.synchronize()
    assert npualloc.current_device() == 0


def test_device_minus_one_is_the_current_device_and_an_index_out_of_range_is_refused(mem):
    """torch_npu's stream calls read -1 as the current device (getCurrentNPUStream) and refuse an index out of
    range (check_npu); these used to make a Stream of "device -1" (unusable) or of a device that does not
    exist."""
    npualloc.set_device(1)
    assert npualloc.current_stream(-1) == npualloc.current_stream(1) == npualloc.default_stream(-1)
    assert npualloc.default_stream(-1).device == 1
    s = npualloc.Stream(device=-1)
    assert s.device == 1 and s.query()
    s.synchronize()
    for call in (npualloc.current_stream, npualloc.default_stream):
        for bad in (2, 99, -7):
            with pytest.raises(RuntimeError, match=rf"^Invalid device_index : {bad}, valid device_index range "
                                                   r"is \[0, 2\)$"):
                call(bad)


def test_stream_and_event_arguments_are_torch_npus(mem):
    """A Stream takes a device and an int priority, an Event int-like flags: torch_npu's constructors refuse
    other types and unknown keywords (they used to be accepted and ignored)."""
    assert npualloc.Stream(priority=-1).priority == -1 and npualloc.Stream(0, True).priority == 1
    for bad in ("x", 1.5, None):
        with pytest.raises(TypeError):
            npualloc.Stream(priority=bad)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        npualloc.Stream(bogus=1)
    assert npualloc.Event(enable_timing=1).enable_timing is True
    for flag in ("enable_timing", "blocking", "interprocess"):
        with pytest.raises(TypeError):
            npualloc.Event(**{flag: "x"})


def test_stream_context_and_set_stream(mem):
    s = npualloc.Stream()
    s1 = npualloc.Stream(1)
    with npualloc.stream(s):
        assert npualloc.current_stream() is s
        with npualloc.stream(None):
            assert npualloc.current_stream() is s
        with npualloc.stream(s1):                # another device: it becomes current too
            assert npualloc.current_device() == 1 and npualloc.current_stream() is s1
            assert npualloc.current_stream(0) is s
        assert npualloc.current_device() == 0 and npualloc.current_stream(1).npu_stream == 0
        assert npualloc.current_stream() is s
    assert npualloc.current_stream().npu_stream == 0
    npualloc.set_stream(s1)
    assert npualloc.current_device() == 1 and npualloc.current_stream() is s1
    npualloc.set_stream(None)
    assert npualloc.current_stream() is s1
    npualloc.set_stream(npualloc.default_stream(1))
    assert npualloc.current_stream().npu_stream == 0


def test_current_stream_is_per_thread(mem):
    s = npualloc.Stream()
    seen = []
    with npualloc.stream(s):
        t = threading.Thread(target=lambda: seen.append(npualloc.current_stream().npu_stream))
        t.start()
        t.join()
        assert npualloc.current_stream() is s
    assert seen == [0]


def test_stream_collected_by_its_own_callback_is_destroyed(mem):
    from npualloc import acl
    s = npualloc.Stream()
    handle = s.npu_stream
    # the callback's user_data holds the last reference: the Stream is collected on its own worker
    assert acl.rt.launch_callback(lambda user_data: None, s, acl.ACL_CALLBACK_BLOCK, handle) == 0
    del s
    deadline = time.monotonic() + 10
    while acl.rt.synchronize_stream(handle) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert acl.rt.synchronize_stream(handle) == acl.ACL_ERROR_INVALID_PARAM   # the handle is gone


STREAM_COLLECTED_IN_ANOTHER_STREAMS_CALLBACK = """
import faulthandler, threading
import npualloc
from npualloc import acl
faulthandler.dump_traceback_later(20, exit=True)  # a deadlock fails the test instead of hanging it
a, b = npualloc.Stream(), npualloc.Stream()
holder, gate = [a], threading.Event()

def last_reference_goes(_):
    gate.wait()
    holder.clear()  # a is collected here, on b's worker

assert acl.rt.launch_callback(last_reference_goes, None, acl.ACL_CALLBACK_BLOCK, b.npu_stream) == 0
a.wait_stream(b)  # a's later work waits for b's work so far, the callback included
npualloc._sleep(0.01, a.npu_stream)
del a
gate.set()
b.synchronize()
print("done")
"""


def test_stream_collected_in_a_callback_of_a_stream_it_waits_for_does_not_deadlock():
    # Destroying a on b's worker waited for a's queued work, which waited for b's callback: the caller.
    r = run_python(STREAM_COLLECTED_IN_ANOTHER_STREAMS_CALLBACK, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "done", r.stderr[-2000:]


def test_events(mem):
    s1, s2 = npualloc.Stream(), npualloc.Stream()
    e = npualloc.Event()
    assert e.query() and repr(e) == "<npualloc.Event uninitialized>"
    gate = held(s1.npu_stream)
    e.record(s1)
    assert not e.query()
    s2.wait_event(e)                     # s2's later work waits for s1's held work
    assert not s2.query()
    gate.set()
    e.synchronize()
    assert e.query()
    s2.synchronize()
    start, end = npualloc.Event(enable_timing=True), npualloc.Event(enable_timing=True)
    start.record(s1)
    npualloc._sleep(0.05, s1.npu_stream)
    end.record(s1)
    end.synchronize()
    assert 45 <= start.elapsed_time(end) < 1000
    with pytest.raises(RuntimeError, match="enable_timing=True"):
        e.elapsed_time(end)
    gate = held(s1.npu_stream)
    s2.wait_stream(s1)
    assert not s2.query()
    gate.set()
    ev = s2.record_event()
    ev.synchronize()
    assert s1.query() and ev.query()
    with npualloc.stream(s1):
        f = npualloc.Event()
        f.record()                        # the current stream
        f.wait()
        f.synchronize()


def test_elapsed_time_waits_for_both_events_and_needs_both_recorded(mem, monkeypatch):
    """torch_npu's NPUEvent::elapsed_time: both events created (recorded), else its RuntimeError; then it
    synchronizes both before it measures (npualloc raised 507004 for events still to complete, and 507000 for
    events never recorded, after creating handles for them)."""
    monkeypatch.setenv("TORCH_NPU_COMPACT_ERROR_OUTPUT", "1")
    s = npualloc.Stream()
    start, end = npualloc.Event(enable_timing=True), npualloc.Event(enable_timing=True)
    with pytest.raises(RuntimeError) as err:
        start.elapsed_time(end)
    assert str(err.value) == "Both events must be recorded before calculating elapsed time."
    assert start.npu_event == 0 and end.npu_event == 0       # nothing created on the way
    start.record(s)
    with pytest.raises(RuntimeError, match=r"^Both events must be recorded"):
        start.elapsed_time(end)
    npualloc._sleep(0.1, s.npu_stream)
    end.record(s)
    assert not end.query()
    assert 95 <= start.elapsed_time(end) < 2000                # waited for `end`
    assert end.query()


def test_an_event_belongs_to_the_device_of_its_first_record(mem, monkeypatch):
    monkeypatch.setenv("TORCH_NPU_COMPACT_ERROR_OUTPUT", "1")
    e = npualloc.Event()
    e.record(npualloc.Stream(0))
    with pytest.raises(RuntimeError) as err:
        e.record(npualloc.Stream(1))
    assert str(err.value) == "Event device 0 does not match recording stream's device 1."
    e.record(npualloc.Stream(0))                               # its own device's streams still record it
    e.synchronize()


def test_two_threads_recording_a_new_event_make_one_handle(mem, monkeypatch):
    """Event.record checks and creates the handle under the event's lock: two threads recording a new event
    each made one (a slow creation widens the window here), and the first handle leaked with its record."""
    created = []
    real = npualloc.streams._M._event_create

    def slow_create():
        handle = real()
        created.append(handle)
        time.sleep(0.05)
        return handle
    monkeypatch.setattr(npualloc.streams._M, "_event_create", slow_create)
    ev = npualloc.Event()
    barrier = threading.Barrier(2)

    def record(stream):
        barrier.wait()
        ev.record(stream)
    threads = [threading.Thread(target=record, args=(s,)) for s in (npualloc.Stream(), npualloc.Stream())]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert created == [ev.npu_event]
    ev.synchronize()


def test_waiting_for_an_event_never_recorded_does_nothing(mem):
    """torch_npu's block() does nothing for an event not created yet (npualloc created one and queued a wait)."""
    s, e = npualloc.Stream(), npualloc.Event()
    s.wait_event(e)
    e.wait(s)
    assert e.npu_event == 0 and s.query()


def test_stale_objects_after_a_restart_are_left_alone(mem):
    s = npualloc.Stream()
    e = s.record_event()
    b = npualloc.empty(1000)
    old_ptr, old_stream = b.ptr, s.npu_stream
    mem()                                 # shutdown + configure: the new runtime reuses addresses
    t = npualloc.Stream()
    p = alloc(1000)
    assert p == old_ptr                   # what makes stale objects dangerous
    assert t.npu_stream != old_stream     # (stream handles are never reused)
    del s, e, b                           # must not destroy t's stream nor free p's block
    t.synchronize()
    assert npualloc.memory_allocated() == 1536
    assert npualloc.current_stream().npu_stream == 0
    free(p)
    check_all()


# ---- record_stream, erase_stream and block states ----

def test_allocator_synchronizing_leaves_a_failed_task_error_to_the_stream(mem):
    """empty_cache (and a no-caching free, and _set_allocator_settings) wait for the device's streams; a failed
    task's error stays for the application's synchronize instead of being consumed on the way."""
    rt = npualloc.acl.rt
    s = npualloc.Stream()
    src, ret = rt.malloc(4096, 0)
    assert ret == 0
    dst, ret = rt.malloc(4096, 0)
    assert ret == 0
    # The copy is valid when queued and runs only after src was freed: it fails on the stream.
    gate = held(s.npu_stream)
    assert rt.memcpy_async(dst, 4096, src, 4096, npualloc.acl.ACL_MEMCPY_DEVICE_TO_DEVICE, s.npu_stream) == 0
    assert rt.free(src) == 0
    gate.set()
    free(alloc(MiB))
    npualloc.empty_cache()
    with pytest.raises(RuntimeError, match="error code is 507053"):
        s.synchronize()
    s.synchronize()  # reported once
    assert rt.free(dst) == 0


def test_record_stream_delays_reuse_until_the_stream_finished(mem):
    side = npualloc.Stream()
    p = alloc(1)
    npualloc.record_stream(p, side)
    gate = held(side.npu_stream)
    free(p)
    assert block_of(p)["state"] == "active_pending_free"
    st = npualloc.memory_stats()
    assert st["allocated_bytes.all.current"] == 0 and st["active_bytes.all.current"] == 512
    assert segment_of(p)["allocated_size"] == 0 and segment_of(p)["active_size"] == 512
    others = [alloc(1) for _ in range(3)]
    assert all(o != p for o in others)  # not reused while `side` has not passed the free
    gate.set()
    side.synchronize()
    assert alloc(1) == p  # reused once it did
    assert block_of(p)["state"] == "active_allocated"
    free(p)
    for o in others:
        free(o)
    check_all()


def test_record_stream_states_and_synchronize(mem):
    side = npualloc.Stream()
    p = alloc(MiB + 1)
    q = alloc(MiB + 1)
    npualloc.record_stream(p, side.npu_stream)          # an int handle works too
    gate = held(side.npu_stream)
    free(p)
    assert layout(p) == [(MiB + 512, "active_pending_free"), (MiB + 512, "active_allocated"),
                         (18 * MiB - 1024, "inactive")]
    gate.set()
    npualloc.empty_cache()                              # synchronizes, completes the free, keeps the segment
    assert layout(p) == [(MiB + 512, "inactive"), (MiB + 512, "active_allocated"), (18 * MiB - 1024, "inactive")]
    free(q)
    assert layout(p) == [(20 * MiB, "inactive")]
    with pytest.raises(RuntimeError, match="invalid device pointer"):
        npualloc.record_stream(p, side)
    r = alloc(1)
    with pytest.raises(RuntimeError, match="not a live stream"):
        npualloc.record_stream(r, 0x5300000099000001)
    with pytest.raises(TypeError, match="Invalid type for stream argument"):
        npualloc.record_stream(r, "side")
    free(r)


def test_record_stream_on_the_own_stream_still_waits(mem):
    # torch_npu records the block's own stream too: the free waits for an event on it.
    p = alloc(1)
    npualloc.record_stream(p, npualloc.current_stream())
    gate = held(0)
    free(p)
    assert block_of(p)["state"] == "active_pending_free"
    q = alloc(1)
    assert q != p
    gate.set()
    npualloc.synchronize()
    assert alloc(1) == p


def held_default_stream(device):
    """held() on the default stream of `device` (handle 0 of whichever device is current)."""
    npualloc.set_device(device)
    try:
        return held(0)
    finally:
        npualloc.set_device(0)


def test_record_stream_with_another_devices_default_stream(mem):
    # torch_npu records the event on the stream given, whatever its device.  Every default stream
    # has the handle 0, so the device must come with it: device 1's is not the block's own.
    gate = held_default_stream(1)
    p = alloc(1)
    npualloc.record_stream(p, npualloc.default_stream(1))
    free(p)
    assert block_of(p)["state"] == "active_pending_free"
    q = alloc(1)
    assert q != p                                # device 1's default stream has not passed the free
    gate.set()
    npualloc.synchronize(1)
    assert alloc(1) == p
    free(p)
    # The other way round: device 0's default stream busy, device 1's idle default recorded.
    gate = held_default_stream(0)
    p2 = alloc(1)
    buf = npualloc.empty(1)
    buf.record_stream(npualloc.default_stream(1))  # the Buffer's record_stream too
    npualloc.record_stream(p2, npualloc.default_stream(1))
    free(p2)
    p3 = alloc(1)
    assert p3 == p2                              # device 1's default stream had nothing queued
    gate.set()
    npualloc.synchronize()
    buf.free()
    free(p3)
    free(q)
    check_all()


def test_a_free_waiting_for_a_stream_stays_pending_when_that_streams_callback_empties_the_cache(mem):
    # A callback of `side` cannot wait for `side`: the free that waits for `side`'s memset (queued after
    # the callback) must stay pending through the callback's empty_cache and allocation.
    from npualloc import acl
    n = 8 * MiB
    side = npualloc.Stream()
    p = alloc(n)
    npualloc.record_stream(p, side)
    gate = threading.Event()
    seen = {}

    def callback(_):
        gate.wait(60)
        npualloc.empty_cache()
        q = alloc(n)
        acl.rt.memset(q, n, 0, n)
        seen["q"] = q
        seen["state"] = block_of(p)["state"]

    assert acl.rt.launch_callback(callback, None, acl.ACL_CALLBACK_BLOCK, side.npu_stream) == 0
    assert acl.rt.memset_async(p, n, 0x5A, n, side.npu_stream) == 0   # side still uses p after the callback
    free(p)
    gate.set()
    side.synchronize()
    assert seen["state"] == "active_pending_free" and seen["q"] != p
    assert acl.util.ptr_to_bytes(seen["q"], 4) == bytes(4)           # not overwritten by p's memset
    assert alloc(n) == p                                               # side passed the memset: reused now
    free(p)
    free(seen["q"])
    check_all()


def test_settings_change_while_a_queued_callback_reads_the_settings():
    # _set_allocator_settings waits for the streams; a callback queued there that takes a snapshot (which
    # reads the settings) and a fork from another thread meanwhile must both get through.
    code = """
import os, threading
import npualloc
from npualloc import acl
p = npualloc.caching_allocator_alloc(1000)
s = npualloc.Stream()
gate = threading.Event()
done = []
def callback(_):
    gate.wait(30)
    done.append(len(npualloc.memory._snapshot()["segments"]))
assert acl.rt.launch_callback(callback, None, acl.ACL_CALLBACK_BLOCK, s.npu_stream) == 0
def open_gate_and_fork():
    gate.set()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
t = threading.Timer(0.3, open_gate_and_fork)
t.start()
npualloc.memory._set_allocator_settings("expandable_segments:False")
t.join()
s.synchronize()
print(done)
"""
    r = run_python(code, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[1]"


def test_erase_stream_with_another_devices_default_stream(mem):
    p = alloc(1)
    npualloc.record_stream(p, npualloc.default_stream(1))
    npualloc.erase_stream(p, npualloc.default_stream(1))   # the block's stream is current: erased
    gate = held_default_stream(1)
    free(p)
    assert block_of(p)["state"] == "inactive"
    gate.set()
    npualloc.synchronize(1)
    check_all()


def test_a_free_deferred_by_a_pool_context_is_pending_in_the_snapshot(mem):
    # Inside use_mem_pool (a capture for torch) a freed block with stream uses waits with its
    # events not yet recorded: still active, so torch's snapshot shows it active_pending_free.
    side = npualloc.Stream()
    pool = npualloc.MemPool()
    with npualloc.use_mem_pool(pool):
        p = alloc(4096)
        q = alloc(4096)
        npualloc.record_stream(p, side)
        free(p)
        assert block_of(p)["state"] == "active_pending_free"
        seg = segment_of(p)
        assert seg["allocated_size"] == 4608 and seg["active_size"] == 9216 and seg["requested_size"] == 8192
        assert npualloc.memory_stats()["active_bytes.all.current"] == 9216
    free(q)
    npualloc.synchronize()
    del pool
    check_all()


def test_streams_recorded_during_a_capture_are_not_waited_for_by_its_deferred_free(mem):
    # torch's insert_events_deferred_until_no_capture waits only for streams recorded before the capture
    # (remove_graph_stream_uses): work recorded during it was captured, not run.  With none left the
    # free completes at the next allocation; a stream recorded before the capture is still waited for.
    side, early = npualloc.Stream(), npualloc.Stream()
    gate = threading.Event()
    from npualloc import acl

    def hold(_):
        gate.wait(60)

    a, b = alloc(3 * MiB), alloc(3 * MiB)
    npualloc.record_stream(b, early)
    pool = npualloc.MemPool()
    with npualloc.use_mem_pool(pool):
        npualloc.record_stream(a, side)
        npualloc.record_stream(b, side)
        free(a)
        free(b)
        assert block_of(a)["state"] == block_of(b)["state"] == "active_pending_free"
    for s in (side, early):                     # both streams busy until the gate opens
        assert acl.rt.launch_callback(hold, None, acl.ACL_CALLBACK_BLOCK, s.npu_stream) == 0
    c = alloc(3 * MiB)                          # processes the deferred frees
    assert c == a                               # `side` is not waited for
    assert block_of(b)["state"] == "active_pending_free"   # `early` is
    gate.set()
    npualloc.synchronize()
    assert alloc(3 * MiB) == b
    free(b)
    free(c)
    del pool
    check_all()


def test_a_free_does_not_wait_for_a_recorded_stream_destroyed_before_it(mem):
    # The stream's work all ran before it went: nothing can still use the block there, so the free
    # completes at once and its reserved event goes (memory._check counts them).
    from npualloc import acl
    p = alloc(3 * MiB)
    s, ret = acl.rt.create_stream()
    assert ret == 0
    npualloc.record_stream(p, s)
    assert acl.rt.memset_async(p, 3 * MiB, 7, 3 * MiB, s) == 0
    assert acl.rt.destroy_stream(s) == 0          # after its queued memset
    free(p)
    assert block_of(p)["state"] == "inactive"
    assert acl.util.ptr_to_bytes(p, 2) == b"\x07\x07"
    assert alloc(3 * MiB) == p
    free(p)
    check_all()


def test_erase_stream_only_from_the_blocks_current_stream(mem):
    own, side = npualloc.Stream(), npualloc.Stream()
    p = alloc(1, stream=own)
    npualloc.record_stream(p, side)
    npualloc.erase_stream(p, side)              # own is not the current stream: nothing happens
    npualloc._sleep(SLEEP, side.npu_stream)
    free(p)
    assert block_of(p)["state"] == "active_pending_free"
    side.synchronize()
    assert alloc(1, stream=own) == p            # (the next allocation completes the free)
    npualloc.record_stream(p, side)
    with npualloc.stream(own):
        npualloc.erase_stream(p, side)          # now it is erased
    npualloc._sleep(SLEEP, side.npu_stream)
    free(p)
    assert block_of(p)["state"] == "inactive"
    with pytest.raises(TypeError, match="^stream should be torch_npu.npu.Stream, could not be <class 'int'>$"):
        npualloc.erase_stream(p, side.npu_stream)
    with pytest.raises(RuntimeError, match="invalid device pointer"):
        npualloc.erase_stream(p, side)
    side.synchronize()
    check_all()


def test_snapshot_states(mem):
    side = npualloc.Stream()
    a = alloc(1)
    b = alloc(1)
    c = alloc(1)
    npualloc.record_stream(b, side)
    npualloc._sleep(SLEEP, side.npu_stream)
    free(b)
    free(c)
    seg = segment_of(a)
    assert [(x["address"], x["size"], x["requested_size"], x["state"]) for x in seg["blocks"]] == [
        (a, 512, 1, "active_allocated"), (b, 512, 1, "active_pending_free"),
        (c, 2 * MiB - 1024, 1, "inactive")]           # requested_size is stale once free (torch)
    assert (seg["allocated_size"], seg["active_size"], seg["requested_size"]) == (512, 1024, 2)
    side.synchronize()
    free(a)
    alloc(600)                                           # completes b's free; merges everything
    seg = segment_of(a)
    assert [x["state"] for x in seg["blocks"]] == ["active_allocated", "inactive"]


def test_a_fork_child_gets_the_python_objects_locks_anew():
    """Event, Graph and MemPool take a lock of their own: a child forked while another thread held one kept it
    held for ever (32 of 40 children hung recording an event another thread kept recording)."""
    p = run_python("""
import os, signal, threading
import npualloc
ev, graph, pool = npualloc.Event(), npualloc.Graph(), npualloc.MemPool()
s = npualloc.Stream()
stop = threading.Event()

def record():
    while not stop.is_set():
        ev.record(s)
t = threading.Thread(target=record)
t.start()
hung = 0
for _ in range(20):
    graph._exec_lock.acquire()            # held across the fork by this thread, as another could
    pid = os.fork()
    if pid == 0:
        signal.alarm(10)
        ev.record(npualloc.Stream())
        ev.synchronize()
        assert not graph._exec_lock.locked() and not pool._release_lock.locked()
        os._exit(0)
    graph._exec_lock.release()
    _, status = os.waitpid(pid, 0)
    hung += status != 0
stop.set()
t.join()
print("hung", hung)
""", timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "hung 0", (p.stdout, p.stderr[-2000:])
