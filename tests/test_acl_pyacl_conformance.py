"""The pyACL face checked against pyACL's documented behaviour, one deviation at a time (each test
failed before its fix): docs and reference lines are named in the tests."""
import numpy as np
import pytest

from npualloc import acl

rt = acl.rt


@pytest.mark.usefixtures("dev0")
@pytest.mark.parametrize("name,rest", [("ipc_mem_set_import_pid", ([1],)), ("ipc_mem_import_by_key", (0,)),
                                       ("ipc_mem_close", ())])
def test_a_key_with_a_nul_character_is_refused_not_cut_short(name, rest):
    """pyACL reads a key as a C string (a str argument, B1): a NUL inside it is a parse failure, as for
    any str parsed to `const char *`.  npualloc used to pass the UTF-8 buffer on, and C saw only the part
    before the NUL: acl.rt.ipc_mem_close(key + "\\0junk") withdrew `key` (a wrong success)."""
    p, ret = rt.malloc(4096, 0)
    assert ret == 0
    key, ret = rt.ipc_mem_get_export_key(p, 4096, 65, 0)
    assert ret == 0
    fn = getattr(rt, name)
    for bad in (key + "\0", key + "\0junk", "\0" + key):
        with pytest.raises(ValueError, match=rf"^acl\.rt\.{name} args parse failed: acl\.rt\.{name}\(\) "
                                             r"argument 'key' contains a null character"):
            fn(bad, *rest)
    assert rt.ipc_mem_close(key) == 0  # still exported: nothing above reached it
    assert rt.ipc_mem_close(key) == acl.ACL_ERROR_RT_INVALID_HANDLE
    assert rt.free(p) == 0


@pytest.mark.usefixtures("dev0")
@pytest.mark.parametrize("name,rest", [("ipc_mem_set_import_pid", ([1],)), ("ipc_mem_import_by_key", (0,)),
                                       ("ipc_mem_close", ())])
def test_a_key_that_is_not_utf8_encodable_is_a_parse_failure(name, rest):
    """A lone surrogate cannot become a C string: pyACL's parse fails; npualloc's message starts as
    pyACL's does (it used to be a bare UnicodeEncodeError)."""
    with pytest.raises(ValueError, match=rf"^acl\.rt\.{name} args parse failed: acl\.rt\.{name}\(\) "
                                         r"argument 'key' cannot be encoded"):
        getattr(rt, name)("npualloc-\udc80", *rest)


# pyACL's acl.util.ptr_to_numpy lists these npy_type codes (hiascend.com aclpythondevg_01_0050,
# CANN 6.0.1: 9 NPY_LONGLONG, 10 NPY_ULONGLONG) and defers to the NumPy C-API numbering for the
# others (13 NPY_LONGDOUBLE, 14-16 the complex types); npualloc refused 9, 10 and 13-16.
@pytest.mark.usefixtures("dev0")
@pytest.mark.parametrize("code,dtype", [(9, np.longlong), (10, np.ulonglong), (13, np.longdouble),
                                        (14, np.csingle), (15, np.cdouble), (16, np.clongdouble)])
def test_ptr_to_numpy_takes_numpys_other_numeric_type_numbers(code, dtype):
    assert np.dtype(dtype).num == code
    src = np.arange(6).astype(dtype)
    dev, ret = rt.malloc(src.nbytes, 0)
    assert ret == 0
    assert rt.memcpy(dev, src.nbytes, acl.util.numpy_to_ptr(src), src.nbytes, acl.ACL_MEMCPY_HOST_TO_DEVICE) == 0
    view = acl.util.ptr_to_numpy(dev, (2, 3), code)
    assert view.dtype == np.dtype(dtype) and np.array_equal(view, src.reshape(2, 3))
    del view
    assert rt.free(dev) == 0


@pytest.mark.usefixtures("dev0")
@pytest.mark.parametrize("code", [17, 18, 19, 20, 21, 22, 24, 99, -1])
def test_ptr_to_numpy_refuses_object_and_flexible_types(code):
    """17 NPY_OBJECT would read device bytes as PyObject pointers, 18-20 and 21-22 have no fixed
    item size or unit: a ValueError, never a view."""
    dev, ret = rt.malloc(64, 0)
    assert ret == 0
    with pytest.raises(ValueError, match="npy_type"):
        acl.util.ptr_to_numpy(dev, (2,), code)
    assert rt.free(dev) == 0


# hicann/runtime src/acl/aclrt_impl/memory.cpp (GetAlignedAndPaddingSize): aclrtMalloc / MallocCached
# add 31 + a 32-byte pad (31 alone for MallocAlign32 and the two 1 GiB policies) before rounding
# to 32, and return ACL_ERROR_INVALID_PARAM when that sum overflows size_t, before the runtime (and
# its context check) is asked.  npualloc answered 207001 (or 107002 without a device).
SIZE_MAX = 2**64 - 1
OVERFLOWING = [("malloc", SIZE_MAX - 63, 0), ("malloc", SIZE_MAX, 0), ("malloc_cached", SIZE_MAX - 63, 0),
               ("malloc_align32", SIZE_MAX - 31, 0), ("malloc", SIZE_MAX - 31, acl.ACL_MEM_MALLOC_HUGE1G_ONLY),
               ("malloc_cached", SIZE_MAX, acl.ACL_MEM_MALLOC_HUGE1G_ONLY_P2P)]
NOT_OVERFLOWING = [("malloc", SIZE_MAX - 64, 0), ("malloc_cached", SIZE_MAX - 64, 0),
                   ("malloc_align32", SIZE_MAX - 32, 0), ("malloc", SIZE_MAX - 32, acl.ACL_MEM_MALLOC_HUGE1G_ONLY)]


@pytest.mark.parametrize("name,size,policy", OVERFLOWING)
def test_a_size_whose_padding_overflows_is_an_invalid_param(npu, name, size, policy):
    assert getattr(rt, name)(size, policy) == (0, acl.ACL_ERROR_INVALID_PARAM)  # no device yet
    assert rt.set_device(0) == 0
    assert getattr(rt, name)(size, policy) == (0, acl.ACL_ERROR_INVALID_PARAM)


@pytest.mark.parametrize("name,size,policy", NOT_OVERFLOWING)
def test_a_size_just_below_the_overflow_is_out_of_memory(npu, name, size, policy):
    assert getattr(rt, name)(size, policy) == (0, acl.ACL_ERROR_RT_CONTEXT_NULL)
    assert rt.set_device(0) == 0
    assert getattr(rt, name)(size, policy) == (0, acl.ACL_ERROR_RT_MEMORY_ALLOCATION)


# hicann/runtime memory.cpp: aclrtDeviceCanAccessPeer refuses deviceId == peerDeviceId (100000) before
# it looks either id up; aclrtDeviceEnablePeerAccess checks its reserved flags (200006) before it asks
# for the current device.  npualloc answered 107001 and 107002 there.
def test_can_access_peer_checks_equal_ids_before_their_validity(npu):
    for dev in (npu["device_count"], 99, -1):
        assert rt.device_can_access_peer(dev, dev) == (0, acl.ACL_ERROR_INVALID_PARAM)
        assert rt.device_can_access_peer(0, dev) == (0, acl.ACL_ERROR_RT_INVALID_DEVICEID)
        assert rt.device_can_access_peer(dev, 0) == (0, acl.ACL_ERROR_RT_INVALID_DEVICEID)
    assert rt.device_can_access_peer(0, 0) == (0, acl.ACL_ERROR_INVALID_PARAM)
    assert rt.device_can_access_peer(0, 1) == (1, 0)


def test_enable_peer_access_checks_its_flags_before_the_context(npu):
    assert rt.device_enable_peer_access(1, 1) == acl.ACL_ERROR_FEATURE_UNSUPPORTED  # no device set
    assert rt.device_enable_peer_access(1, 0) == acl.ACL_ERROR_RT_CONTEXT_NULL
    assert rt.set_device(0) == 0
    assert rt.device_enable_peer_access(0, 1) == acl.ACL_ERROR_FEATURE_UNSUPPORTED
    assert rt.device_enable_peer_access(0, 0) == acl.ACL_ERROR_INVALID_PARAM
    assert rt.device_enable_peer_access(99, 0) == acl.ACL_ERROR_RT_INVALID_DEVICEID
    assert rt.device_enable_peer_access(1, 0) == 0
    assert rt.device_disable_peer_access(1) == 0


PROP = {"handleType": 0, "allocationType": 0, "memAttr": acl.ACL_HBM_MEM_HUGE, "location": {"id": 0, "type": 1},
        "reserve": 0}
HBM_P2P = [acl.ACL_HBM_MEM_P2P_HUGE, acl.ACL_HBM_MEM_P2P_NORMAL, acl.ACL_HBM_MEM_P2P_HUGE1G]


# hicann/runtime memory.cpp: aclrtMallocPhysical and aclrtMemGetAllocationGranularity map memAttr
# through one table (HBM_HUGE/NORMAL/HUGE1G, DDR_* for host locations, ACL_MEM_* and ACL_MEM_P2P_*);
# ACL_HBM_MEM_P2P_HUGE (8), _NORMAL (9) and _HUGE1G (11) are not in it: "memAttr [...] is not
# supported", ACL_ERROR_INVALID_PARAM (reference B3: a memAttr not in the map gives 100000).
@pytest.mark.parametrize("attr", HBM_P2P)
def test_hbm_p2p_attributes_are_not_physical_attributes(dev0, attr):
    size = 1 << 30 if attr == acl.ACL_HBM_MEM_P2P_HUGE1G else 2 << 20
    assert rt.malloc_physical(size, dict(PROP, memAttr=attr), 0) == (0, acl.ACL_ERROR_INVALID_PARAM)
    assert rt.mem_get_allocation_granularity(dict(PROP, memAttr=attr), 0) == (0, acl.ACL_ERROR_INVALID_PARAM)


# The same source: aclrtMemGetAllocationGranularity reads only memAttr, location and reserve from the
# property (the runtime's property has no handle or allocation type); malloc_physical checks both.
@pytest.mark.parametrize("key,value", [("handleType", acl.ACL_MEM_HANDLE_TYPE_POSIX), ("handleType", 7),
                                       ("allocationType", 1), ("allocationType", -1)])
def test_granularity_ignores_handle_and_allocation_types(dev0, key, value):
    assert rt.mem_get_allocation_granularity(dict(PROP, **{key: value}), 0) == (2 << 20, 0)
    assert rt.mem_get_allocation_granularity(dict(PROP, **{key: value}, memAttr=acl.ACL_HBM_MEM_HUGE1G), 1) == \
        (1 << 30, 0)
    assert rt.malloc_physical(2 << 20, dict(PROP, **{key: value}), 0) == (0, acl.ACL_ERROR_INVALID_PARAM)


# hicann/runtime memory.cpp: aclrtMemcpyAsync translates its kind with the same table as aclrtMemcpy
# (MemcpyKindTranslate: HOST_TO_HOST .. HOST_TO_BUF_TO_DEVICE); INNER_ / INTER_DEVICE_TO_DEVICE (6, 7)
# are ACL_ERROR_INVALID_PARAM for both.  npualloc queued them on the async copy.
@pytest.mark.parametrize("kind", [acl.ACL_MEMCPY_INNER_DEVICE_TO_DEVICE, acl.ACL_MEMCPY_INTER_DEVICE_TO_DEVICE])
def test_memcpy_async_takes_the_kinds_memcpy_takes(dev0, kind):
    p, ret = rt.malloc(64, 0)
    assert ret == 0
    assert rt.memcpy(p, 32, p + 32, 32, kind) == acl.ACL_ERROR_INVALID_PARAM
    assert rt.memcpy_async(p, 32, p + 32, 32, kind, 0) == acl.ACL_ERROR_INVALID_PARAM
    for ok in range(acl.ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE + 1):
        assert rt.memcpy_async(p, 32, p + 32, 32, ok, 0) == 0
    assert rt.synchronize_stream(0) == 0
    assert rt.free(p) == 0


# hicann/runtime api_impl_ipc_memory.cc: the runtime refuses a zero size or key length for
# rtsIpcMemGetExportKey and a pid count <= 0 for rtsIpcMemSetImportPid (RT_ERROR_INVALID_VALUE,
# ACL_ERROR_RT_PARAM_INVALID); the ACL layer checks only the pointers (memory.cpp).  npualloc
# answered ACL_ERROR_INVALID_PARAM.
def test_ipc_key_zero_size_and_length_are_runtime_param_errors(dev0):
    p, ret = rt.malloc(4096, 0)
    assert ret == 0
    assert rt.ipc_mem_get_export_key(p, 0, 65, 0) == ("", acl.ACL_ERROR_RT_PARAM_INVALID)
    assert rt.ipc_mem_get_export_key(p, 4096, 0, 0) == ("", acl.ACL_ERROR_RT_PARAM_INVALID)
    assert rt.ipc_mem_get_export_key(0, 0, 0, 0) == ("", acl.ACL_ERROR_INVALID_PARAM)  # the pointer first
    assert rt.ipc_mem_get_export_key(p, 4096, 8, 0) == ("", acl.ACL_ERROR_INVALID_PARAM)  # too short for the key
    key, ret = rt.ipc_mem_get_export_key(p, 4096, 65, 0)
    assert ret == 0
    assert rt.ipc_mem_set_import_pid(key, []) == acl.ACL_ERROR_RT_PARAM_INVALID
    assert rt.ipc_mem_set_import_pid("no-such-key", []) == acl.ACL_ERROR_RT_PARAM_INVALID
    assert rt.mem_set_pid_to_shareable_handle(1, []) == acl.ACL_ERROR_INVALID_PARAM  # ACL's own pidNum check
    assert rt.ipc_mem_close(key) == 0
    assert rt.free(p) == 0
