"""acl.init / acl.finalize, devices, the current device per thread, peer access."""
import threading

import pytest

import npualloc
from npualloc import acl

from conftest import held

rt = acl.rt
pytestmark = pytest.mark.usefixtures("npu")


def in_thread(fn):
    """Runs fn() on a new thread and returns its result (re-raising its exception)."""
    box = {}

    def main():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    t = threading.Thread(target=main)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_init_and_finalize_codes():
    assert acl.init() == acl.ACL_SUCCESS
    assert acl.init("/no/such/acl.json") == acl.ACL_ERROR_REPEAT_INITIALIZE == 100002
    # a repeated init still leaves a working runtime
    assert rt.set_device(0) == 0
    ptr, ret = rt.malloc(64, acl.ACL_MEM_MALLOC_HUGE_FIRST)
    assert ret == 0 and rt.free(ptr) == 0
    assert acl.finalize() == acl.ACL_SUCCESS
    assert acl.finalize() == acl.ACL_ERROR_REPEAT_FINALIZE == 100037
    assert acl.init(None) == acl.ACL_SUCCESS
    assert acl.finalize() == acl.ACL_SUCCESS


def test_finalize_without_init():
    assert acl.finalize() == acl.ACL_ERROR_REPEAT_FINALIZE


def test_finalize_keeps_memory_valid():
    assert acl.init() == 0
    assert rt.set_device(0) == 0
    ptr, ret = rt.malloc(16, 0)
    assert ret == 0 and rt.memset(ptr, 16, 0x33, 16) == 0
    assert acl.finalize() == 0
    assert acl.util.ptr_to_bytes(ptr, 16) == b"\x33" * 16
    assert rt.free(ptr) == 0


def test_init_rejects_non_str_path():
    with pytest.raises(TypeError, match=r"acl\.init\(\) argument 'config_path'"):
        acl.init(5)


def test_shutdown_ends_the_acl_session():
    assert acl.init() == 0
    npualloc._C.shutdown()
    assert acl.finalize() == acl.ACL_ERROR_REPEAT_FINALIZE


def test_device_count(npu):
    assert rt.get_device_count() == (npu["device_count"], 0)


def test_no_current_device_until_set():
    assert rt.get_device() == (0, acl.ACL_ERROR_RT_CONTEXT_NULL)
    assert rt.malloc(16, 0) == (0, acl.ACL_ERROR_RT_CONTEXT_NULL)
    assert rt.get_mem_info(acl.ACL_HBM_MEM) == (0, 0, acl.ACL_ERROR_RT_CONTEXT_NULL)
    assert rt.create_stream() == (0, acl.ACL_ERROR_RT_CONTEXT_NULL)
    assert rt.synchronize_device() == acl.ACL_ERROR_RT_CONTEXT_NULL
    assert rt.synchronize_stream(0) == acl.ACL_ERROR_RT_CONTEXT_NULL


def test_set_and_get_device():
    for dev in (3, 0, 2):
        assert rt.set_device(dev) == 0
        assert rt.get_device() == (dev, 0)


@pytest.mark.parametrize("dev", [4, -1, 64, 2**31 - 1, -2**31, 2**31, 2**63, -2**70])
def test_set_device_out_of_range(dev):
    assert rt.set_device(dev) == acl.ACL_ERROR_RT_INVALID_DEVICEID
    assert rt.reset_device(dev) == acl.ACL_ERROR_RT_INVALID_DEVICEID
    assert rt.reset_device_force(dev) == acl.ACL_ERROR_RT_INVALID_DEVICEID
    assert rt.get_device() == (0, acl.ACL_ERROR_RT_CONTEXT_NULL)


def test_current_device_is_per_thread():
    assert rt.set_device(1) == 0
    assert in_thread(rt.get_device) == (0, acl.ACL_ERROR_RT_CONTEXT_NULL)

    def other():
        assert rt.set_device(3) == 0
        ptr, ret = rt.malloc(1 << 20, 0)
        assert ret == 0
        used = rt.get_mem_info(acl.ACL_HBM_MEM)
        rt.free(ptr)
        return rt.get_device(), used

    (dev, ret), (free, total, ret2) = in_thread(other)
    assert (dev, ret, ret2) == (3, 0, 0)
    assert free < total  # the thread's allocation was charged to device 3 ...
    assert rt.get_device() == (1, 0)  # ... and the main thread still uses device 1
    assert rt.get_mem_info(acl.ACL_HBM_MEM)[0] == rt.get_mem_info(acl.ACL_HBM_MEM)[1]


def test_reset_device_is_reference_counted():
    assert rt.set_device(2) == 0
    assert rt.set_device(2) == 0
    assert rt.reset_device(2) == 0
    assert rt.get_device() == (2, 0)
    assert rt.reset_device(2) == 0
    assert rt.get_device() == (0, acl.ACL_ERROR_RT_CONTEXT_NULL)
    assert rt.reset_device(2) == 0  # resetting an unused device is harmless


def test_reset_device_force_ignores_the_reference_count():
    for _ in range(3):
        assert rt.set_device(2) == 0
    assert in_thread(lambda: rt.set_device(2)) == 0
    assert rt.reset_device_force(2) == 0  # one call drops all four references
    assert rt.get_device() == (0, acl.ACL_ERROR_RT_CONTEXT_NULL)
    assert rt.set_device(2) == 0  # none is left over: one reset ends the next context
    assert rt.reset_device(2) == 0
    assert rt.get_device() == (0, acl.ACL_ERROR_RT_CONTEXT_NULL)
    assert rt.reset_device_force(2) == 0  # an unused device


def test_reset_device_ends_other_threads_context():
    assert rt.set_device(1) == 0
    in_thread(lambda: rt.reset_device(1))
    assert rt.get_device() == (0, acl.ACL_ERROR_RT_CONTEXT_NULL)


def test_synchronize_device_with_nothing_queued(dev0):
    assert rt.synchronize_device() == 0


def test_device_can_access_peer(npu):
    assert rt.device_can_access_peer(0, 1) == (1, 0)
    assert rt.device_can_access_peer(3, 0) == (1, 0)
    assert rt.device_can_access_peer(1, 1) == (0, acl.ACL_ERROR_INVALID_PARAM)
    assert rt.device_can_access_peer(0, 4) == (0, acl.ACL_ERROR_RT_INVALID_DEVICEID)
    assert rt.device_can_access_peer(-1, 0) == (0, acl.ACL_ERROR_RT_INVALID_DEVICEID)
    assert rt.device_can_access_peer(2**40, 0) == (0, acl.ACL_ERROR_RT_INVALID_DEVICEID)


def test_peer_access_enable_disable():
    assert rt.device_enable_peer_access(1, 0) == acl.ACL_ERROR_RT_CONTEXT_NULL  # no current device
    assert rt.set_device(0) == 0
    assert rt.device_enable_peer_access(1, 0) == 0
    assert rt.device_enable_peer_access(1, 0) == 0  # enabling twice is fine
    assert rt.device_enable_peer_access(0, 0) == acl.ACL_ERROR_INVALID_PARAM  # itself
    assert rt.device_enable_peer_access(4, 0) == acl.ACL_ERROR_RT_INVALID_DEVICEID
    assert rt.device_enable_peer_access(-7, 0) == acl.ACL_ERROR_RT_INVALID_DEVICEID
    assert rt.device_enable_peer_access(1, 1) == acl.ACL_ERROR_FEATURE_UNSUPPORTED
    assert rt.device_enable_peer_access(1, -1) == acl.ACL_ERROR_FEATURE_UNSUPPORTED
    assert rt.device_enable_peer_access(1, 2**32) == acl.ACL_ERROR_FEATURE_UNSUPPORTED
    assert rt.device_disable_peer_access(1) == 0
    assert rt.device_disable_peer_access(0) == acl.ACL_ERROR_INVALID_PARAM
    assert rt.device_disable_peer_access(9) == acl.ACL_ERROR_RT_INVALID_DEVICEID
    assert rt.device_disable_peer_access(2**33) == acl.ACL_ERROR_RT_INVALID_DEVICEID


# ---- contexts (docs/runtime.md, Contexts) ----

def test_a_pyacl_sample_with_an_explicit_context_runs():
    """The resource flow of CANN's pyACL samples: init, set_device, create_context, streams and memory in it,
    then everything released in reverse order."""
    assert acl.init() == 0
    assert rt.set_device(0) == 0
    context, ret = rt.create_context(0)
    assert ret == 0 and context != 0
    assert rt.get_context() == (context, 0)
    run_mode, ret = rt.get_run_mode()
    assert (run_mode, ret) == (acl.ACL_HOST, 0) and acl.ACL_HOST == 1 and acl.ACL_DEVICE == 0
    stream, ret = rt.create_stream()
    assert ret == 0
    dev, ret = rt.malloc(1024, acl.ACL_MEM_MALLOC_HUGE_FIRST)
    assert ret == 0
    host, ret = rt.malloc_host(1024)
    assert ret == 0 and rt.memset(host, 1024, 7, 1024) == 0
    assert rt.memcpy_async(dev, 1024, host, 1024, acl.ACL_MEMCPY_HOST_TO_DEVICE, stream) == 0
    assert rt.synchronize_stream(stream) == 0
    assert acl.util.ptr_to_bytes(dev, 4) == b"\x07" * 4
    assert rt.free(dev) == 0 and rt.free_host(host) == 0
    assert rt.destroy_stream(stream) == 0
    assert rt.destroy_context(context) == 0
    assert rt.reset_device(0) == 0
    assert acl.finalize() == 0


def test_stream_0_is_the_bound_contexts_default_stream():
    assert rt.set_device(0) == 0
    primary, ret = rt.get_context()
    assert ret == 0
    context, ret = rt.create_context(1)
    assert ret == 0 and rt.get_device() == (1, 0)
    gate = held(0)  # the context's default stream
    assert rt.stream_query(0) == (acl.ACL_STREAM_STATUS_NOT_READY, 0)
    own, ret = rt.ctx_get_current_default_stream()  # that stream, by a handle of its own
    assert ret == 0 and own != 0
    assert rt.set_context(primary) == 0 and rt.get_device() == (0, 0)
    assert rt.ctx_get_current_default_stream() == (0, 0)  # a default context's: stream 0
    assert rt.stream_query(0) == (acl.ACL_STREAM_STATUS_COMPLETE, 0)  # device 0's own default stream
    assert rt.stream_query(own) == (acl.ACL_STREAM_STATUS_NOT_READY, 0)
    gate.set()
    assert rt.synchronize_stream(own) == 0
    assert rt.set_context(context) == 0 and rt.ctx_get_current_default_stream() == (own, 0)
    assert rt.destroy_context(context) == 0
    assert rt.get_context() == (0, acl.ACL_ERROR_RT_CONTEXT_NULL)  # no fall back to a default context
    assert rt.ctx_get_current_default_stream() == (0, acl.ACL_ERROR_RT_CONTEXT_NULL)
    assert rt.set_device(0) == 0 and rt.get_context() == (primary, 0)


def test_another_thread_can_bind_a_context_and_loses_it_at_the_destroy():
    assert rt.set_device(0) == 0
    context, ret = rt.create_context(1)
    assert ret == 0
    bound, destroyed, seen = threading.Event(), threading.Event(), []

    def bound_thread():
        seen.append((rt.set_context(context), rt.get_device()))
        bound.set()
        destroyed.wait(60)
        seen.append(rt.get_device())  # still bound, to a context that is gone

    t = threading.Thread(target=bound_thread)
    t.start()
    assert bound.wait(60)
    assert rt.destroy_context(context) == 0
    destroyed.set()
    t.join()
    assert seen == [(0, (1, 0)), (0, acl.ACL_ERROR_RT_CONTEXT_NULL)]
    assert in_thread(lambda: rt.set_context(context)) == acl.ACL_ERROR_RT_PARAM_INVALID
    assert rt.destroy_context(context) == acl.ACL_ERROR_RT_CONTEXT_NULL


@pytest.mark.parametrize("call, expected", [
    (lambda: rt.create_context(-1), (0, 107001)), (lambda: rt.create_context(2**40), (0, 107001)),
    (lambda: rt.destroy_context(0), 100000), (lambda: rt.set_context(0), 100000),
    (lambda: rt.destroy_context(2**70), 107002), (lambda: rt.set_context(12345), 107000),
])
def test_context_calls_return_canns_codes(call, expected):
    assert rt.set_device(0) == 0
    assert call() == expected
