"""Streams, events and callbacks through acl.rt: asynchronous copies in stream order behind
npualloc._sleep, cross-stream waits, callbacks, elapsed time and the errors of each call."""
import ctypes
import gc
import mmap
import os
import signal
import subprocess
import sys
import threading
import time
import weakref

import pytest

import npualloc
from npualloc import acl
from conftest import ROOT, held, run_python

rt = acl.rt
pytestmark = pytest.mark.usefixtures("dev0")

N = 4096


def malloc(size=N, fill=None):
    ptr, ret = rt.malloc(size, 0)
    assert ret == 0
    if fill is not None:
        assert rt.memset(ptr, size, fill, size) == 0
    return ptr


def stream():
    s, ret = rt.create_stream()
    assert ret == 0 and s != 0
    return s


def event():
    e, ret = rt.create_event()
    assert ret == 0 and e != 0
    return e


def read(ptr, n=N):
    return acl.util.ptr_to_bytes(ptr, n)


def test_stream_lifecycle():
    s = stream()
    assert rt.synchronize_stream(s) == 0
    assert rt.destroy_stream(s) == 0
    assert rt.destroy_stream(s) == acl.ACL_ERROR_INVALID_PARAM
    assert rt.synchronize_stream(s) == acl.ACL_ERROR_INVALID_PARAM
    assert rt.destroy_stream(0) == acl.ACL_ERROR_INVALID_PARAM  # the default stream stays
    assert rt.synchronize_stream(0) == 0
    for forged in (12345, -1, 2**64, event()):
        assert rt.synchronize_stream(forged) == acl.ACL_ERROR_INVALID_PARAM, forged
        assert rt.destroy_stream(forged) == acl.ACL_ERROR_INVALID_PARAM, forged


def test_async_memcpy_waits_behind_sleep():
    src, dst = malloc(fill=0x11), malloc(fill=0)
    s, e = stream(), event()
    gate = held(s)
    assert npualloc._sleep(0.2, s) == 0
    assert rt.memcpy_async(dst, N, src, N, acl.ACL_MEMCPY_DEVICE_TO_DEVICE, s) == 0
    assert rt.record_event(e, s) == 0
    assert rt.query_event(e) == (acl.ACL_EVENT_STATUS_NOT_READY, 0)
    assert rt.query_event_status(e) == (acl.ACL_EVENT_RECORDED_STATUS_NOT_READY, 0)
    assert read(dst) == bytes(N)  # not copied yet
    gate.set()
    assert rt.synchronize_event(e) == 0
    assert read(dst) == b"\x11" * N
    assert rt.query_event(e) == (acl.ACL_EVENT_STATUS_COMPLETE, 0)
    assert rt.query_event_status(e) == (acl.ACL_EVENT_RECORDED_STATUS_COMPLETE, 0)
    assert rt.destroy_event(e) == 0 and rt.destroy_stream(s) == 0


def test_async_memset_and_memcpy_on_the_default_stream():
    dst = malloc(fill=0)
    host, ret = rt.malloc_host(N)  # pinned: the copy is queued
    assert ret == 0
    assert rt.memset(host, N, 0, N) == 0
    gate = held(0)  # 0: the default stream
    assert rt.memset_async(dst, N, 0x3C, N, 0) == 0
    assert rt.memcpy_async(host, N, dst, N, acl.ACL_MEMCPY_DEVICE_TO_HOST, 0) == 0
    assert read(host) == bytes(N)
    gate.set()
    assert rt.synchronize_stream(0) == 0
    assert read(host) == b"\x3c" * N
    assert rt.free_host(host) == 0


def test_async_memcpy_of_pageable_memory_is_done_on_return():
    """CANN: with host memory not from aclrtMallocHost, aclrtMemcpyAsync returns after the copy is done
    (it waits for the stream's queued work first)."""
    dst = malloc(fill=0)
    s = stream()
    host = bytearray(N)
    gate = held(s)
    assert rt.memset_async(dst, N, 0x3C, N, s) == 0
    threading.Timer(0.2, gate.set).start()
    assert rt.memcpy_async(acl.util.bytes_to_ptr(host), N, dst, N, acl.ACL_MEMCPY_DEVICE_TO_HOST, s) == 0
    assert gate.is_set()  # it waited for the queued work
    assert bytes(host) == b"\x3c" * N  # no synchronize needed
    source = bytearray(b"\x7e" * N)
    assert rt.memcpy_async(dst, N, acl.util.bytes_to_ptr(source), N, acl.ACL_MEMCPY_HOST_TO_DEVICE, s) == 0
    source[:] = bytes(N)  # the copy was made already
    assert read(dst) == b"\x7e" * N
    assert rt.destroy_stream(s) == 0


def test_last_reset_of_a_device_waits_for_its_queued_work():
    """CANN's aclrtResetDevice waits for the device's unfinished tasks before it releases the device."""
    dst, other = malloc(fill=0), malloc(fill=0)
    host = bytearray(N)
    s = stream()
    assert npualloc._sleep(0.2, s) == 0
    assert rt.memset_async(dst, N, 0x5A, N, s) == 0
    assert rt.memcpy_async(acl.util.bytes_to_ptr(host), N, dst, N, acl.ACL_MEMCPY_DEVICE_TO_HOST, s) == 0
    assert npualloc._sleep(0.2) == 0  # the default stream too
    assert rt.memset_async(other, N, 0x11, N, 0) == 0
    assert rt.set_device(0) == 0 and rt.reset_device(0) == 0  # not the last reference: no wait needed
    assert rt.reset_device(0) == 0  # the last one
    assert bytes(host) == b"\x5a" * N
    assert read(other) == b"\x11" * N
    assert rt.set_device(0) == 0
    assert rt.destroy_stream(s) == 0


def test_synchronize_device_waits_for_every_stream():
    a, b = malloc(fill=0), malloc(fill=0)
    s1, s2 = stream(), stream()
    for s, p, v in ((s1, a, 1), (s2, b, 2)):
        assert npualloc._sleep(0.1, s) == 0
        assert rt.memset_async(p, N, v, N, s) == 0
    assert rt.synchronize_device() == 0
    assert read(a) == b"\x01" * N and read(b) == b"\x02" * N


def test_destroy_stream_runs_its_queued_work():
    dst = malloc(fill=0)
    s = stream()
    assert npualloc._sleep(0.1, s) == 0
    assert rt.memset_async(dst, N, 0x5F, N, s) == 0
    assert rt.destroy_stream(s) == 0
    assert read(dst) == b"\x5f" * N


def test_stream_wait_event_across_streams():
    buf, dst = malloc(fill=0), malloc(fill=0)
    s1, s2 = stream(), stream()
    e1, e2 = event(), event()
    gate = held(s1)
    assert rt.memset_async(buf, N, 0x22, N, s1) == 0
    assert rt.record_event(e1, s1) == 0
    assert rt.stream_wait_event(s2, e1) == 0  # s2's later work waits for s1's memset
    assert rt.memcpy_async(dst, N, buf, N, acl.ACL_MEMCPY_DEVICE_TO_DEVICE, s2) == 0
    assert rt.record_event(e2, s2) == 0
    assert rt.query_event(e2) == (acl.ACL_EVENT_STATUS_NOT_READY, 0)
    gate.set()
    assert rt.synchronize_stream(s2) == 0
    assert read(dst) == b"\x22" * N
    assert rt.query_event(e1) == (acl.ACL_EVENT_STATUS_COMPLETE, 0)


def test_stream_wait_event_on_the_default_stream_and_unrecorded_events():
    s = stream()
    e = event()
    assert rt.stream_wait_event(0, e) == 0  # never recorded: nothing to wait for
    assert npualloc._sleep(0.1, s) == 0
    assert rt.record_event(e, s) == 0
    assert rt.stream_wait_event(0, e) == 0
    dst = malloc(fill=0)
    assert rt.memset_async(dst, N, 9, N, 0) == 0
    assert rt.synchronize_stream(0) == 0
    assert rt.query_event(e) == (acl.ACL_EVENT_STATUS_COMPLETE, 0)  # the default stream waited for s
    assert read(dst) == b"\x09" * N


def test_event_queries_before_record():
    e = event()
    assert rt.query_event(e) == (acl.ACL_EVENT_STATUS_COMPLETE, 0)  # nothing to wait for
    assert rt.query_event_status(e) == (acl.ACL_EVENT_RECORDED_STATUS_NOT_READY, 0)  # but never recorded
    assert rt.synchronize_event(e) == 0


def test_event_errors():
    invalid = acl.ACL_ERROR_INVALID_PARAM
    e, s = event(), stream()
    assert rt.destroy_event(e) == 0
    for bad in (e, 0, 777, -1, 2**64, s):  # destroyed, NULL, forged, out of range, a stream
        assert rt.destroy_event(bad) == invalid, bad
        assert rt.record_event(bad, s) == invalid, bad
        assert rt.query_event(bad) == (0, invalid), bad
        assert rt.query_event_status(bad) == (0, invalid), bad
        assert rt.synchronize_event(bad) == invalid, bad
        assert rt.stream_wait_event(s, bad) == invalid, bad
        assert rt.event_elapsed_time(bad, bad) == (0.0, invalid), bad
    live = event()
    for bad in (777, -1, 2**64, live):
        assert rt.record_event(live, bad) == invalid, bad
        assert rt.stream_wait_event(bad, live) == invalid, bad


def test_event_elapsed_time():
    s = stream()
    start, end = event(), event()
    assert rt.record_event(start, s) == 0
    gate = held(s)
    assert npualloc._sleep(0.2, s) == 0
    assert rt.record_event(end, s) == 0
    assert rt.event_elapsed_time(start, end) == (0.0, acl.ACL_ERROR_RT_STREAM_NOT_COMPLETE)
    gate.set()
    assert rt.synchronize_event(end) == 0
    ms, ret = rt.event_elapsed_time(start, end)
    assert ret == 0 and isinstance(ms, float)
    assert 195.0 <= ms < 5000.0
    back, ret = rt.event_elapsed_time(end, start)
    assert ret == 0 and back == pytest.approx(-ms)
    unrecorded = event()  # CANN's "event recorder null", reported by ACL as 507000
    assert rt.event_elapsed_time(start, unrecorded) == (0.0, acl.ACL_ERROR_RT_INTERNAL_ERROR)
    assert rt.event_elapsed_time(unrecorded, start) == (0.0, acl.ACL_ERROR_RT_INTERNAL_ERROR)


def test_launch_callback_order_data_and_thread():
    log = []
    buf = malloc(fill=0)
    s = stream()
    main = threading.get_ident()

    def cb(data):
        log.append((data, threading.get_ident(), read(buf, 1)))

    items = [["first"], ["second", 2], None]
    gate = held(s)
    assert rt.launch_callback(cb, items[0], acl.ACL_CALLBACK_BLOCK, s) == 0
    assert rt.memset_async(buf, N, 0x01, N, s) == 0
    assert rt.launch_callback(cb, items[1], acl.ACL_CALLBACK_NO_BLOCK, s) == 0
    assert rt.memset_async(buf, N, 0x02, N, s) == 0
    assert rt.launch_callback(cb, items[2], acl.ACL_CALLBACK_BLOCK, s) == 0
    assert log == []  # still behind the gate
    gate.set()
    assert rt.synchronize_stream(s) == 0
    assert [entry[0] for entry in log] == items
    assert all(entry[0] is item for entry, item in zip(log, items))  # the very objects
    assert [entry[2] for entry in log] == [b"\x00", b"\x01", b"\x02"]  # in stream order
    threads = {entry[1] for entry in log}
    assert len(threads) == 1 and main not in threads  # on the stream's worker


def test_launch_callback_keeps_fn_and_data_alive():
    ran = []

    class Data(list):
        pass

    data = Data([42])
    ref = weakref.ref(data)
    s = stream()
    gate = held(s)
    assert rt.launch_callback(lambda d: ran.append(list(d)), data, 0, s) == 0
    del data
    gc.collect()
    assert ref() is not None  # held by the queued callback
    gate.set()
    assert rt.synchronize_stream(s) == 0
    assert ran == [[42]]
    gc.collect()
    assert ref() is None  # released once it ran


def test_launch_callback_exception_is_unraisable(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append((u.exc_type, u.object)))
    ran = []

    def boom(data):
        raise KeyError(data)

    assert rt.launch_callback(boom, "payload", 0, 0) == 0
    assert rt.launch_callback(ran.append, "after", 0, 0) == 0
    assert rt.synchronize_stream(0) == 0  # the error does not become the stream's
    assert seen == [(KeyError, boom)]
    assert ran == ["after"]


def test_callback_cannot_wait_for_its_own_stream():
    got = []
    s = stream()

    def cb(_):
        got.append(rt.synchronize_stream(s))
        got.append(rt.destroy_stream(s))

    assert rt.launch_callback(cb, None, 1, s) == 0
    assert rt.synchronize_stream(s) == 0
    assert got == [acl.ACL_ERROR_RT_FEATURE_NOT_SUPPORT] * 2
    assert rt.destroy_stream(s) == 0


def test_callbacks_running_at_exit_finish_before_the_interpreter_does():
    # A callback that gives up the GIL (sleep, I/O) when the interpreter began to finalize was ended by CPython
    # on its stream's worker, mid-task: the stream never passed it, and a finalizer's synchronize hung the exit.
    # Now exit waits for it (atexit), and a callback queued behind it is dropped.
    p = run_python("""
import os, threading, time
from npualloc import acl
rt = acl.rt
rt.set_device(0)
s, _ = rt.create_stream()
class SynchronizesAtTeardown:
    def __del__(self, sync=rt.synchronize_stream, s=s, write=os.write):   # sys.stdout may be gone by then
        write(1, f"synchronized at teardown: {sync(s)}\\n".encode())
holder = SynchronizesAtTeardown()
started = threading.Event()
rt.launch_callback(lambda _: (started.set(), time.sleep(0.5), print("callback done", flush=True)), None, 0, s)
rt.launch_callback(print, "queued callback ran", 0, s)   # (a builtin: a dropped callback's objects are leaked)
started.wait()   # the first callback is running; it gives up the GIL as the script ends
""", timeout=60)
    assert p.returncode == 0, p.stderr[-800:]
    assert p.stdout.splitlines()[0] == "callback done"
    assert "synchronized at teardown: 0" in p.stdout.splitlines()


STUCK_CALLBACK = """
import sys, threading
from npualloc import acl
rt = acl.rt
rt.set_device(0)
s, _ = rt.create_stream()
started, never = threading.Event(), threading.Event()
rt.launch_callback(lambda _: (started.set(), never.wait()), None, 0, s)   # waits for the main thread for ever
started.wait()
print("main done", flush=True)
"""


def test_exit_leaves_a_callback_that_never_ends_after_a_while():
    # the exiting main thread will never set what the callback waits for: exit waits 5 s, then says so
    p = run_python(STUCK_CALLBACK, timeout=60)
    assert p.returncode == 0, p.stderr[-800:]
    assert p.stdout == "main done\n"
    assert p.stderr == ("npualloc: 1 Python stream callback(s) still running 5 s into exit are left to the "
                        "interpreter, which ends them where they stand\n")


def test_ctrl_c_ends_the_wait_for_callbacks_at_exit():
    p = subprocess.Popen([sys.executable, "-c", STUCK_CALLBACK], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    try:
        assert p.stdout.readline() == "main done\n"
        for _ in range(12):  # until it exits (one that comes before the wait only ends the script sooner)
            time.sleep(0.3)
            p.send_signal(signal.SIGINT)
            if p.poll() is not None:
                break
        _, err = p.communicate(timeout=1)  # well before the 5 s the wait would take
    finally:
        p.kill()
    assert "KeyboardInterrupt" in err, err
    assert "still running 5 s into exit" not in err


def test_launch_callback_errors():
    data = ["x"]
    before = sys.getrefcount(data)
    fn = lambda d: None  # noqa: E731
    assert rt.launch_callback(fn, data, 2, 0) == acl.ACL_ERROR_INVALID_PARAM
    assert rt.launch_callback(fn, data, -1, 0) == acl.ACL_ERROR_INVALID_PARAM
    assert rt.launch_callback(fn, data, 2**40, 0) == acl.ACL_ERROR_INVALID_PARAM
    assert rt.launch_callback(fn, data, 0, 999) == acl.ACL_ERROR_INVALID_PARAM
    assert rt.launch_callback(fn, data, 0, -1) == acl.ACL_ERROR_INVALID_PARAM
    assert sys.getrefcount(data) == before  # nothing queued, nothing kept
    with pytest.raises(TypeError, match=r"acl\.rt\.launch_callback\(\) argument 'fn' must be callable"):
        rt.launch_callback(None, data, 0, 0)


def test_sticky_error_of_a_failed_async_copy():
    src, dst = malloc(fill=1), malloc(fill=0)
    s = stream()
    gate = held(s)
    assert rt.memcpy_async(dst, N, src, N, 3, s) == 0
    assert rt.free(src) == 0  # freed before the copy runs
    gate.set()
    assert rt.synchronize_stream(s) == acl.ACL_ERROR_RT_DEVICE_MEM_ERROR
    assert rt.synchronize_stream(s) == 0  # reported once
    assert read(dst) == bytes(N)


def test_async_argument_errors():
    invalid, param = acl.ACL_ERROR_INVALID_PARAM, acl.ACL_ERROR_RT_PARAM_INVALID
    a, b = malloc(), malloc()
    s = stream()
    assert rt.memcpy_async(a, N, b, 0, 3, s) == 0
    # A count of 0 succeeds before any other check (the reference's memcpy / memset: "count == 0
    # returns SUCCESS", as CANN's current runtime does; an older ACL layer checked pointers first).
    assert rt.memcpy_async(0, N, 0, 0, 8, s) == 0
    assert rt.memset_async(0, N, 1, 0, s) == 0
    assert rt.memcpy(0, N, 0, 0, 8) == 0
    assert rt.memset(0, N, 1, 0) == 0
    assert rt.memcpy_async(0, N, b, 10, 3, s) == invalid
    assert rt.memcpy_async(a, 5, b, 10, 3, s) == param
    assert rt.memcpy_async(a, N, b, 10, 8, s) == invalid
    for kind in (acl.ACL_MEMCPY_INNER_DEVICE_TO_DEVICE, acl.ACL_MEMCPY_INTER_DEVICE_TO_DEVICE):
        assert rt.memcpy_async(a, N, b, 10, kind, s) == invalid  # not a kind CANN's ACL layer translates
    assert rt.memcpy_async(a, N, b, 10, 3, 4242) == invalid
    assert rt.memcpy_async(a, N, b, -10, 3, s) == invalid
    assert rt.memset_async(a, N, 1, 10, 4242) == invalid
    assert rt.memset_async(a, 5, 1, 10, s) == param
    assert rt.memset_async(0, 5, 1, 1, s) == invalid
    assert rt.memset_async(a, N, 2**32, 10, s) == invalid
    assert rt.memset_async(a, N, 1, 10, -1) == invalid
    assert rt.synchronize_stream(s) == 0
    assert rt.free(b) == 0
    assert rt.memcpy_async(a, N, b, 10, 3, s) == param  # freed: rejected when queued
    assert rt.memset_async(b, N, 1, 10, s) == param
    assert rt.synchronize_stream(s) == 0
    assert npualloc._sleep(-1.0, s) == invalid
    assert npualloc._sleep(0.0, 4242) == invalid


def test_streams_belong_to_their_device():
    assert rt.set_device(2) == 0
    s = stream()
    dst = malloc(fill=0)
    assert rt.set_device(0) == 0
    assert rt.memset_async(dst, N, 4, N, s) == 0  # a created stream can be used from anywhere
    assert rt.synchronize_stream(s) == 0
    assert read(dst) == b"\x04" * N


def test_many_streams_in_threads():
    errors = []

    def work(i):
        try:
            assert rt.set_device(i % 4) == 0
            s = stream()
            p = malloc(fill=0)
            for v in range(1, 20):
                assert rt.memset_async(p, N, v, N, s) == 0
            assert rt.synchronize_stream(s) == 0
            assert read(p) == bytes([19]) * N
            assert rt.destroy_stream(s) == 0 and rt.free(p) == 0
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert time.monotonic() - t0 < 10


def test_callbacks_run_on_the_subscribed_thread_in_process_report():
    """pyACL's flow: a thread subscribes to the stream and serves callbacks in process_report."""
    import threading

    stream, ret = rt.create_stream()
    assert ret == 0
    seen = []
    stop = threading.Event()

    def serve():
        rt.set_device(0)
        while not stop.is_set():
            rt.process_report(100)  # 507012 (ACL_ERROR_RT_REPORT_TIMEOUT) when nothing arrived in time

    worker = threading.Thread(target=serve)
    worker.start()
    assert rt.subscribe_report(worker.ident, stream) == 0
    assert rt.subscribe_report(worker.ident, stream) == acl.ACL_ERROR_RT_STREAM_SUBSCRIBE
    for i in range(3):
        assert rt.launch_callback(lambda data: seen.append((data, threading.get_ident())), i,
                                  acl.ACL_CALLBACK_BLOCK, stream) == 0
    assert rt.synchronize_stream(stream) == 0
    assert seen == [(0, worker.ident), (1, worker.ident), (2, worker.ident)]
    assert rt.unsubscribe_report(worker.ident, stream) == 0
    stop.set()
    worker.join()
    assert rt.process_report(100) == acl.ACL_ERROR_RT_THREAD_SUBSCRIBE  # this thread serves nothing
    assert rt.destroy_stream(stream) == 0


def test_a_subscribed_thread_with_nothing_to_run_times_out_with_canns_code():
    """rt_error_codes.h: ACL_ERROR_RT_REPORT_TIMEOUT is 507012 (107013 is ACL_ERROR_RT_GROUP_NOT_SET)."""
    stream, ret = rt.create_stream()
    assert ret == 0
    me = threading.get_ident()
    assert rt.subscribe_report(me, stream) == 0
    assert rt.process_report(10) == acl.ACL_ERROR_RT_REPORT_TIMEOUT == 507012
    assert rt.unsubscribe_report(me, stream) == 0
    assert rt.destroy_stream(stream) == 0


def test_synchronize_stream_and_event_with_timeout():
    """pyACL's synchronize_stream_with_timeout / synchronize_event_with_timeout: -1 forever, > 0 ms."""
    s, e = stream(), event()
    gate = held(s)
    assert rt.record_event(e, s) == 0
    assert rt.synchronize_stream_with_timeout(s, 20) == acl.ACL_ERROR_RT_STREAM_SYNC_TIMEOUT == 507046
    assert rt.synchronize_event_with_timeout(e, 20) == acl.ACL_ERROR_RT_EVENT_SYNC_TIMEOUT == 507047
    assert rt.synchronize_stream_with_timeout(s, -2) == acl.ACL_ERROR_RT_PARAM_INVALID
    assert rt.synchronize_event_with_timeout(e, 2**31) == acl.ACL_ERROR_RT_PARAM_INVALID  # not an int32
    assert rt.synchronize_stream_with_timeout(12345, 10) == acl.ACL_ERROR_INVALID_PARAM
    gate.set()
    assert rt.synchronize_event_with_timeout(e, -1) == 0
    assert rt.synchronize_stream_with_timeout(s, 60000) == 0
    with pytest.raises(TypeError, match=r"acl\.rt\.synchronize_stream_with_timeout"):
        rt.synchronize_stream_with_timeout(s, "1")
    assert rt.destroy_event(e) == 0 and rt.destroy_stream(s) == 0


def test_a_sync_timeout_neither_leaves_nor_consumes_an_error():
    # A page this process keeps with no access rights: the queued memset fails there when it runs (freed
    # pinned memory would not do: under ASan its address is soon mapped again, and the memset succeeds).
    libc = ctypes.CDLL(None)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = libc.mmap(None, 4096, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)  # PROT_NONE
    assert page not in (None, ctypes.c_void_p(-1).value)
    s = stream()
    gate = held(s)
    assert rt.memset_async(page, 4096, 1, 4096, s) == 0
    assert rt.synchronize_stream_with_timeout(s, 20) == acl.ACL_ERROR_RT_STREAM_SYNC_TIMEOUT
    gate.set()
    assert rt.synchronize_stream(s) == acl.ACL_ERROR_RT_DEVICE_MEM_ERROR  # the task's error, kept for this call
    assert rt.synchronize_stream(s) == 0
    assert rt.destroy_stream(s) == 0
    assert libc.munmap(page, 4096) == 0


def test_stream_query_status():
    """pyACL: status, ret = acl.rt.stream_query(stream) with aclrtStreamStatus values."""
    s = stream()
    assert rt.stream_query(s) == (acl.ACL_STREAM_STATUS_COMPLETE, 0)
    gate = held(s)
    assert rt.stream_query(s) == (acl.ACL_STREAM_STATUS_NOT_READY, 0) == (1, 0)
    gate.set()
    assert rt.synchronize_stream(s) == 0
    assert rt.stream_query(s) == (0, 0)
    assert rt.destroy_stream(s) == 0
    # a failure leaves pyACL's status at RESERVED, never COMPLETE (0)
    assert rt.stream_query(s) == (acl.ACL_STREAM_STATUS_RESERVED, acl.ACL_ERROR_INVALID_PARAM) == (0xFFFF, 100000)


def test_failed_event_queries_return_pyacls_initial_status():
    """pyACL starts query_event at COMPLETE, query_event_status at NOT_READY and query_event_wait_status at
    COMPLETE, all 0, and returns them unchanged when the call fails."""
    e = event()
    assert rt.destroy_event(e) == 0
    invalid = acl.ACL_ERROR_INVALID_PARAM
    assert rt.query_event(e) == (acl.ACL_EVENT_STATUS_COMPLETE, invalid)
    assert rt.query_event_status(e) == (acl.ACL_EVENT_RECORDED_STATUS_NOT_READY, invalid)
    assert rt.query_event_wait_status(e) == (acl.ACL_EVENT_WAIT_STATUS_COMPLETE, invalid)


# ---- flagged events and streams (CANN's values and codes; what npualloc makes of each flag: docs/runtime.md) ----

def flagged_event(flag, ex=False):
    e, ret = (rt.create_event_ex_with_flag if ex else rt.create_event_with_flag)(flag)
    assert ret == 0 and e != 0
    return e


def test_flag_values_are_canns():
    assert (acl.ACL_EVENT_SYNC, acl.ACL_EVENT_CAPTURE_STREAM_PROGRESS, acl.ACL_EVENT_TIME_LINE,
            acl.ACL_EVENT_DEVICE_USE_ONLY, acl.ACL_EVENT_EXTERNAL, acl.ACL_EVENT_IPC) == (1, 2, 8, 0x10, 0x20, 0x40)
    assert (acl.ACL_STREAM_FAST_LAUNCH, acl.ACL_STREAM_FAST_SYNC, acl.ACL_STREAM_PERSISTENT, acl.ACL_STREAM_HUGE,
            acl.ACL_STREAM_CPU_SCHEDULE, acl.ACL_STREAM_DEVICE_USE_ONLY) == (1, 2, 4, 8, 0x10, 0x20)
    assert (acl.ACL_EVENT_WAIT_STATUS_COMPLETE, acl.ACL_EVENT_WAIT_STATUS_NOT_READY,
            acl.ACL_EVENT_WAIT_STATUS_RESERVED) == (0, 1, 0xFFFF)


@pytest.mark.parametrize("flag", [acl.ACL_EVENT_SYNC, acl.ACL_EVENT_TIME_LINE, acl.ACL_EVENT_CAPTURE_STREAM_PROGRESS,
                                  acl.ACL_EVENT_SYNC | acl.ACL_EVENT_TIME_LINE, 0x4, 0xF,
                                  acl.ACL_EVENT_DEVICE_USE_ONLY])
def test_create_event_with_flag_takes_canns_flags(flag):
    assert rt.destroy_event(flagged_event(flag)) == 0


@pytest.mark.parametrize("flag", [0, acl.ACL_EVENT_IPC, 0x80, 2**32 - 1, acl.ACL_EVENT_SYNC | acl.ACL_EVENT_EXTERNAL,
                                  acl.ACL_EVENT_SYNC | acl.ACL_EVENT_DEVICE_USE_ONLY, 2**32, -1])
def test_create_event_with_flag_refuses_the_rest(flag):
    assert rt.create_event_with_flag(flag) == (0, acl.ACL_ERROR_RT_PARAM_INVALID)


def test_flags_npualloc_cannot_honour_are_feature_not_supported():
    nope = acl.ACL_ERROR_RT_FEATURE_NOT_SUPPORT
    assert rt.create_event_with_flag(acl.ACL_EVENT_EXTERNAL) == (0, nope)  # updating captured tasks
    assert rt.create_event_ex_with_flag(acl.ACL_EVENT_IPC) == (0, nope)    # IPC events
    assert rt.create_stream_with_config(0, acl.ACL_STREAM_PERSISTENT) == (0, nope)  # model-bound streams


@pytest.mark.parametrize("flag", [0, acl.ACL_EVENT_DEVICE_USE_ONLY, acl.ACL_EVENT_EXTERNAL,
                                  acl.ACL_EVENT_IPC | acl.ACL_EVENT_SYNC, 0x80, 2**40])
def test_create_event_ex_with_flag_refuses(flag):
    assert rt.create_event_ex_with_flag(flag) == (0, acl.ACL_ERROR_RT_PARAM_INVALID)


def test_event_without_sync_is_timed_but_not_waited_for_or_reset():
    s, t = stream(), stream()
    a, b = flagged_event(acl.ACL_EVENT_TIME_LINE), flagged_event(acl.ACL_EVENT_TIME_LINE)
    assert rt.record_event(a, s) == 0
    assert npualloc._sleep(0.05, s) == 0
    assert rt.record_event(b, s) == 0
    assert rt.synchronize_event(b) == 0
    ms, ret = rt.event_elapsed_time(a, b)
    assert ret == 0 and ms >= 45.0
    assert rt.stream_wait_event(t, a) == acl.ACL_ERROR_RT_FEATURE_NOT_SUPPORT
    assert rt.reset_event(a, t) == acl.ACL_ERROR_RT_FEATURE_NOT_SUPPORT
    assert rt.query_event_wait_status(a) == (acl.ACL_EVENT_WAIT_STATUS_COMPLETE, 0)


def test_device_use_only_event_takes_no_host_task():
    s, e = stream(), flagged_event(acl.ACL_EVENT_DEVICE_USE_ONLY)
    for ret in (rt.record_event(e, s), rt.stream_wait_event(s, e), rt.reset_event(e, s)):
        assert ret == acl.ACL_ERROR_RT_PARAM_INVALID
    assert rt.query_event_status(e) == (acl.ACL_EVENT_RECORDED_STATUS_NOT_READY, 0)


def test_ex_event():
    s, t = stream(), stream()
    e = flagged_event(acl.ACL_EVENT_SYNC, ex=True)
    nope = acl.ACL_ERROR_RT_FEATURE_NOT_SUPPORT
    assert rt.query_event_status(e) == (acl.ACL_EVENT_RECORDED_STATUS_COMPLETE, 0)  # until its first record
    assert rt.query_event(e)[1] == nope
    assert rt.query_event_wait_status(e)[1] == nope
    assert rt.reset_event(e, t) == nope
    gate = held(s)
    assert rt.record_event(e, s) == 0
    assert rt.query_event_status(e) == (acl.ACL_EVENT_RECORDED_STATUS_NOT_READY, 0)
    assert rt.stream_wait_event(t, e) == 0
    gate.set()
    assert rt.synchronize_stream(t) == 0
    assert rt.query_event_status(e) == (acl.ACL_EVENT_RECORDED_STATUS_COMPLETE, 0)


def test_reset_event_takes_effect_when_the_stream_reaches_it():
    s, t = stream(), stream()
    e = flagged_event(acl.ACL_EVENT_SYNC | acl.ACL_EVENT_TIME_LINE)
    assert rt.record_event(e, s) == 0 and rt.synchronize_stream(s) == 0
    gate = held(t)
    assert rt.reset_event(e, t) == 0
    time.sleep(0.01)
    assert rt.query_event_status(e) == (acl.ACL_EVENT_RECORDED_STATUS_COMPLETE, 0)  # still queued
    gate.set()
    assert rt.synchronize_stream(t) == 0
    assert rt.query_event_status(e) == (acl.ACL_EVENT_RECORDED_STATUS_NOT_READY, 0)
    assert rt.query_event(e) == (acl.ACL_EVENT_STATUS_COMPLETE, 0)
    assert rt.event_elapsed_time(e, e) == (0.0, acl.ACL_ERROR_RT_INTERNAL_ERROR)  # no record, no time
    # a record made after the reset was queued stays
    gate = held(t)
    assert rt.reset_event(e, t) == 0
    assert rt.record_event(e, s) == 0 and rt.synchronize_stream(s) == 0
    gate.set()
    assert rt.synchronize_stream(t) == 0
    assert rt.query_event_status(e) == (acl.ACL_EVENT_RECORDED_STATUS_COMPLETE, 0)
    # the default stream (0), and a plain event
    plain = event()
    assert rt.record_event(plain, s) == 0
    assert rt.reset_event(plain, 0) == 0 and rt.synchronize_stream(0) == 0 and rt.synchronize_stream(s) == 0
    assert rt.query_event_status(plain) == (acl.ACL_EVENT_RECORDED_STATUS_NOT_READY, 0)


def test_reset_event_errors():
    invalid = acl.ACL_ERROR_INVALID_PARAM
    e, s = flagged_event(acl.ACL_EVENT_SYNC), stream()
    for bad in (0, 777, -1, 2**64, s):
        assert rt.reset_event(bad, s) == invalid, bad
    for bad in (777, -1, 2**64, e):
        assert rt.reset_event(e, bad) == invalid, bad
    assert rt.destroy_event(e) == 0
    assert rt.reset_event(e, s) == invalid
    with pytest.raises(TypeError, match=r"acl\.rt\.reset_event args parse failed: .*argument 'stream' must be int"):
        rt.reset_event(1, "s")


def test_query_event_wait_status():
    s, t, u = stream(), stream(), stream()
    e = flagged_event(acl.ACL_EVENT_SYNC)
    assert rt.query_event_wait_status(e) == (acl.ACL_EVENT_WAIT_STATUS_COMPLETE, 0)
    gate = held(s)
    assert rt.record_event(e, s) == 0
    assert rt.stream_wait_event(t, e) == 0 and rt.stream_wait_event(u, e) == 0
    assert rt.query_event_wait_status(e) == (acl.ACL_EVENT_WAIT_STATUS_NOT_READY, 0)
    gate.set()
    assert rt.synchronize_stream(t) == 0 and rt.synchronize_stream(u) == 0
    assert rt.query_event_wait_status(e) == (acl.ACL_EVENT_WAIT_STATUS_COMPLETE, 0)
    assert rt.destroy_event(e) == 0
    for bad in (e, 0, 777, -1, 2**64, s):
        assert rt.query_event_wait_status(bad) == (0, acl.ACL_ERROR_INVALID_PARAM), bad


@pytest.mark.parametrize("priority,flag", [(0, 0), (7, acl.ACL_STREAM_FAST_LAUNCH),
                                           (2**32 - 1, acl.ACL_STREAM_FAST_LAUNCH | acl.ACL_STREAM_FAST_SYNC),
                                           (0, acl.ACL_STREAM_HUGE | acl.ACL_STREAM_CPU_SCHEDULE),
                                           (0, acl.ACL_STREAM_DEVICE_USE_ONLY), (0, 0x40 | 0x80000000)])
def test_create_stream_with_config(priority, flag):
    s, ret = rt.create_stream_with_config(priority, flag)
    assert ret == 0 and s != 0
    src, dst = malloc(fill=0x33), malloc(fill=0)
    assert rt.memcpy_async(dst, N, src, N, acl.ACL_MEMCPY_DEVICE_TO_DEVICE, s) == 0
    assert rt.synchronize_stream(s) == 0
    assert read(dst) == b"\x33" * N
    assert rt.destroy_stream(s) == 0


def test_create_stream_with_config_errors():
    assert rt.create_stream_with_config(0, acl.ACL_STREAM_DEVICE_USE_ONLY | acl.ACL_STREAM_FAST_SYNC) == \
        (0, acl.ACL_ERROR_RT_PARAM_INVALID)
    assert rt.create_stream_with_config(0, 2**32) == (0, acl.ACL_ERROR_RT_PARAM_INVALID)
    assert rt.create_stream_with_config(-1, 0) == (0, acl.ACL_ERROR_INVALID_PARAM)
    with pytest.raises(TypeError, match=r"acl\.rt\.create_stream_with_config args parse failed"):
        rt.create_stream_with_config(0)


def test_synchronize_device_with_timeout():
    s = stream()
    src, dst = malloc(fill=0x44), malloc(fill=0)
    assert rt.synchronize_device_with_timeout(5) == 0
    gate = held(s)
    assert rt.memcpy_async(dst, N, src, N, acl.ACL_MEMCPY_DEVICE_TO_DEVICE, s) == 0
    assert rt.synchronize_device_with_timeout(20) == acl.ACL_ERROR_RT_STREAM_SYNC_TIMEOUT
    assert rt.synchronize_device_with_timeout(-2) == acl.ACL_ERROR_RT_PARAM_INVALID
    assert rt.synchronize_device_with_timeout(2**31) == acl.ACL_ERROR_RT_PARAM_INVALID  # not an int32
    threading.Timer(0.05, gate.set).start()
    assert rt.synchronize_device_with_timeout(60000) == 0  # waits without the GIL: the callback needs it
    assert read(dst) == b"\x44" * N
    assert rt.synchronize_device_with_timeout(-1) == 0 and rt.synchronize_device_with_timeout(0) == 0


def test_synchronize_device_with_timeout_and_create_stream_with_config_need_a_current_device():
    out = []
    t = threading.Thread(target=lambda: out.extend([rt.synchronize_device_with_timeout(10),
                                                    rt.create_stream_with_config(0, 0)]))
    t.start()
    t.join()
    assert out == [acl.ACL_ERROR_RT_CONTEXT_NULL, (0, acl.ACL_ERROR_RT_CONTEXT_NULL)]


# ---- stale handles after a restart or in a fork child: each face reports them its own way, the same for
# streams and events (pyACL: the code as ret; npualloc.Stream / Event: RuntimeError with the code) ----

def stale_pair():
    """A Stream and an Event recorded on it (complete), with their raw handles for acl.rt."""
    s = npualloc.Stream()
    e = s.record_event()
    s.synchronize()
    assert s.query() and e.query()
    return s, e, s.npu_stream, e.npu_event


def check_stale(s, e, s_handle, e_handle):
    """Raises AssertionError when a stale object answers differently from the rest of its face."""
    invalid = acl.ACL_ERROR_INVALID_PARAM
    assert rt.stream_query(s_handle) == (acl.ACL_STREAM_STATUS_RESERVED, invalid)
    assert rt.query_event(e_handle) == (0, invalid)
    assert rt.query_event_status(e_handle) == (0, invalid)
    assert rt.synchronize_stream(s_handle) == invalid
    assert rt.synchronize_event(e_handle) == invalid
    for use, what in ((s.query, "aclrtStreamQuery"), (e.query, "aclrtQueryEvent"),
                      (s.synchronize, "aclrtSynchronizeStream"), (e.synchronize, "aclrtSynchronizeEvent"),
                      (lambda: npualloc.Stream().wait_event(e), "aclrtStreamWaitEvent")):
        with pytest.raises(RuntimeError, match=rf"NPU function error: {what}, error code is {invalid}"):
            use()
    assert npualloc.Event().query()  # never recorded: not stale, nothing to wait for
    # a new record starts the event afresh; the stale stream stays refused
    fresh = npualloc.Stream()
    e.record(fresh)
    e.synchronize()
    assert e.query() and e.npu_event != e_handle
    with pytest.raises(RuntimeError):
        e.record(s)


def test_stale_stream_and_event_after_a_restart(restart):
    restart()
    rt.set_device(0)
    s, e, sh, eh = stale_pair()
    restart()
    rt.set_device(0)
    check_stale(s, e, sh, eh)
    del s, e  # releasing stale objects does nothing (and touches nothing of the new runtime)
    assert rt.synchronize_device() == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_stale_stream_and_event_in_a_fork_child():
    s, e, sh, eh = stale_pair()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            rt.set_device(0)
            check_stale(s, e, sh, eh)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert s.query() and e.query()  # the parent's own are untouched


def test_an_event_waited_for_but_never_recorded_is_not_stale_after_a_restart(restart):
    """Only a record goes stale: an Event that a stream waited for but that was never recorded answers as a
    never-recorded one after a restart (the wait, as torch_npu's block(), made no handle)."""
    restart()
    rt.set_device(0)
    e = npualloc.Event()
    npualloc.Stream().wait_event(e)
    assert e.npu_event == 0
    restart()
    rt.set_device(0)
    assert e.query()
    e.synchronize()
    npualloc.Stream().wait_event(e)
    e.record()
    e.synchronize()
    assert e.query()
