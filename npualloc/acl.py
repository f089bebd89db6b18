"""The pyACL face: ``npualloc.acl.rt.*`` functions, ``acl.init`` / ``acl.finalize``, ``acl.util``
and CANN's constants.

Conventions as pyACL: arguments are positional, outputs come first and ``ret`` last
(``ptr, ret = acl.rt.malloc(size, policy)``); pointers, handles, streams and events are ints
(0 = NULL, or the current context's default stream: the device's own after ``set_device``, a context's
own while ``create_context`` or ``set_context`` has bound it).  A wrong Python type, a wrong number of
arguments or a keyword argument raises TypeError with pyACL's message, followed by the reason:
``acl.rt.malloc args parse failed: acl.rt.malloc() argument 'size' must be int, not str``; a key
(a ``str``) that is no C string (a NUL inside it, or a character UTF-8 cannot encode) raises
ValueError with the same words.  A value of the right type that is out of range is not an exception
but the ACL error code the C function returns for it.  A runtime that cannot start
because an ``NPUALLOC_*`` variable is malformed raises ValueError.
Each function's docstring gives its call form and the C function it calls (``help(acl.rt.malloc)``), after a
text signature that ``inspect.signature`` reads.
"""
import numbers as _numbers
import types as _types
import warnings as _warnings

from . import _C

rt = _C.rt

# ---- return codes (acl_base.h, rt_error_codes.h) ----
ACL_SUCCESS = 0
ACL_ERROR_NONE = 0
ACL_RT_SUCCESS = 0

ACL_ERROR_INVALID_PARAM = 100000
ACL_ERROR_UNINITIALIZE = 100001
ACL_ERROR_REPEAT_INITIALIZE = 100002
ACL_ERROR_REPEAT_SUBSCRIBE = 100033
ACL_ERROR_STREAM_NOT_SUBSCRIBE = 100034
ACL_ERROR_THREAD_NOT_SUBSCRIBE = 100035
ACL_ERROR_WAIT_CALLBACK_TIMEOUT = 100036
ACL_ERROR_REPEAT_FINALIZE = 100037
ACL_ERROR_DUMP_NOT_RUN = 100045
ACL_ERROR_BAD_ALLOC = 200000
ACL_ERROR_API_NOT_SUPPORT = 200001
ACL_ERROR_INVALID_DEVICE = 200002
ACL_ERROR_MEMORY_ADDRESS_UNALIGNED = 200003
ACL_ERROR_RESOURCE_NOT_MATCH = 200004
ACL_ERROR_INVALID_RESOURCE_HANDLE = 200005
ACL_ERROR_FEATURE_UNSUPPORTED = 200006
ACL_ERROR_PROF_MODULES_UNSUPPORTED = 200007
ACL_ERROR_STORAGE_OVER_LIMIT = 300000
ACL_ERROR_INTERNAL_ERROR = 500000
ACL_ERROR_FAILURE = 500001
ACL_ERROR_GE_FAILURE = 500002
ACL_ERROR_RT_FAILURE = 500003
ACL_ERROR_DRV_FAILURE = 500004
ACL_ERROR_PROFILING_FAILURE = 500005

ACL_ERROR_RT_PARAM_INVALID = 107000
ACL_ERROR_RT_INVALID_DEVICEID = 107001
ACL_ERROR_RT_CONTEXT_NULL = 107002
ACL_ERROR_RT_STREAM_CONTEXT = 107003
ACL_ERROR_RT_ADDR_UNALIGNED = 107008
ACL_ERROR_RT_STREAM_SUBSCRIBE = 107011
ACL_ERROR_RT_THREAD_SUBSCRIBE = 107012
ACL_ERROR_RT_STREAM_NO_CB_REG = 107015
ACL_ERROR_RT_INVALID_MEMORY_TYPE = 107016
ACL_ERROR_RT_INVALID_HANDLE = 107017
ACL_ERROR_RT_INVALID_MALLOC_TYPE = 107018
ACL_ERROR_RT_WAIT_TIMEOUT = 107019
ACL_ERROR_RT_TASK_TIMEOUT = 107020
ACL_ERROR_RT_DEVICE_TASK_ABORT = 107022
ACL_ERROR_RT_STREAM_CAPTURED = 107027  # synchronize_stream of a stream being captured
ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT = 107030  # an unsafe call during a capture (npualloc.Graph capture modes)
ACL_ERROR_RT_STREAM_CAPTURE_WRONG_THREAD = 107038  # a capture not begun relaxed ended in another thread
ACL_ERROR_RT_CAPTURE_MODE_BLOCK_ASYNC = 107041  # memcpy_async of pageable memory refused by a capture mode

ACL_ERROR_RT_FEATURE_NOT_SUPPORT = 207000
ACL_ERROR_RT_MEMORY_ALLOCATION = 207001
ACL_ERROR_RT_MEMORY_FREE = 207002
ACL_ERROR_RT_AICORE_OVER_FLOW = 207003
ACL_ERROR_RT_NO_DEVICE = 207004
ACL_ERROR_RT_RESOURCE_ALLOC_FAIL = 207005
ACL_ERROR_RT_NO_PERMISSION = 207006
ACL_ERROR_RT_NO_EVENT_RESOURCE = 207007
ACL_ERROR_RT_NO_STREAM_RESOURCE = 207008
ACL_ERROR_RT_OVER_LIMIT = 207012
ACL_ERROR_RT_DEVICE_OOM = 207018

ACL_ERROR_RT_INTERNAL_ERROR = 507000
ACL_ERROR_RT_TS_ERROR = 507001
ACL_ERROR_RT_STREAM_TASK_FULL = 507002
ACL_ERROR_RT_STREAM_NOT_COMPLETE = 507004
ACL_ERROR_RT_REPORT_TIMEOUT = 507012
ACL_ERROR_RT_IPC_ERROR = 507022
ACL_ERROR_RT_STREAM_SYNC_TIMEOUT = 507046
ACL_ERROR_RT_EVENT_SYNC_TIMEOUT = 507047
ACL_ERROR_RT_DEVICE_MEM_ERROR = 507053
ACL_ERROR_RT_HBM_MULTI_BIT_ECC_ERROR = 507054
ACL_ERROR_RT_DRV_INTERNAL_ERROR = 507899
ACL_ERROR_RT_AICPU_INTERNAL_ERROR = 507900
ACL_ERROR_RT_SOCKET_CLOSE = 507901

# ---- aclrtMemMallocPolicy ----
ACL_MEM_MALLOC_HUGE_FIRST = 0
ACL_MEM_MALLOC_HUGE_ONLY = 1
ACL_MEM_MALLOC_NORMAL_ONLY = 2
ACL_MEM_MALLOC_HUGE_FIRST_P2P = 3
ACL_MEM_MALLOC_HUGE_ONLY_P2P = 4
ACL_MEM_MALLOC_NORMAL_ONLY_P2P = 5
ACL_MEM_MALLOC_HUGE1G_ONLY = 6
ACL_MEM_MALLOC_HUGE1G_ONLY_P2P = 7
ACL_MEM_TYPE_LOW_BAND_WIDTH = 0x0100
ACL_MEM_TYPE_HIGH_BAND_WIDTH = 0x1000
ACL_MEM_ACCESS_USER_SPACE_READONLY = 0x100000

# ---- aclrtMemAttr ----
ACL_DDR_MEM = 0
ACL_HBM_MEM = 1
ACL_DDR_MEM_HUGE = 2
ACL_DDR_MEM_NORMAL = 3
ACL_HBM_MEM_HUGE = 4
ACL_HBM_MEM_NORMAL = 5
ACL_DDR_MEM_P2P_HUGE = 6
ACL_DDR_MEM_P2P_NORMAL = 7
ACL_HBM_MEM_P2P_HUGE = 8
ACL_HBM_MEM_P2P_NORMAL = 9
ACL_HBM_MEM_HUGE1G = 10
ACL_HBM_MEM_P2P_HUGE1G = 11
ACL_MEM_NORMAL = 12
ACL_MEM_HUGE = 13
ACL_MEM_HUGE1G = 14
ACL_MEM_P2P_NORMAL = 15
ACL_MEM_P2P_HUGE = 16
ACL_MEM_P2P_HUGE1G = 17

# ---- aclrtMemcpyKind ----
ACL_MEMCPY_HOST_TO_HOST = 0
ACL_MEMCPY_HOST_TO_DEVICE = 1
ACL_MEMCPY_DEVICE_TO_HOST = 2
ACL_MEMCPY_DEVICE_TO_DEVICE = 3
ACL_MEMCPY_DEFAULT = 4
ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE = 5
ACL_MEMCPY_INNER_DEVICE_TO_DEVICE = 6
ACL_MEMCPY_INTER_DEVICE_TO_DEVICE = 7

# ---- physical memory properties ----
ACL_MEM_LOCATION_TYPE_HOST = 0
ACL_MEM_LOCATION_TYPE_DEVICE = 1
ACL_MEM_LOCATION_TYPE_UNREGISTERED = 2
ACL_MEM_LOCATION_TYPE_MANAGED = 3
ACL_MEM_LOCATION_TYPE_HOST_NUMA = 4
ACL_MEM_ALLOCATION_TYPE_PINNED = 0
ACL_MEM_HANDLE_TYPE_NONE = 0
ACL_MEM_HANDLE_TYPE_POSIX = 2
ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT = 0x1  # aclrtMemSharedHandleType (CANN's V2 sharing calls; see acl_rt.h)
ACL_MEM_SHARE_HANDLE_TYPE_FABRIC = 0x2
ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM = 0
ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1
ACL_RT_MEM_ALLOC_GRANULARITY_UNDEF = 0xFFFF

# ---- callbacks and events ----
ACL_CALLBACK_NO_BLOCK = 0
ACL_CALLBACK_BLOCK = 1
ACL_STREAM_STATUS_COMPLETE = 0
ACL_STREAM_STATUS_NOT_READY = 1
ACL_STREAM_STATUS_RESERVED = 0xFFFF
# aclrtRunMode (acl.rt.get_run_mode)
ACL_DEVICE = 0
ACL_HOST = 1
ACL_EVENT_STATUS_COMPLETE = 0
ACL_EVENT_STATUS_NOT_READY = 1
ACL_EVENT_STATUS_RESERVED = 2
ACL_EVENT_RECORDED_STATUS_NOT_READY = 0
ACL_EVENT_RECORDED_STATUS_COMPLETE = 1
ACL_EVENT_WAIT_STATUS_COMPLETE = 0
ACL_EVENT_WAIT_STATUS_NOT_READY = 1
ACL_EVENT_WAIT_STATUS_RESERVED = 0xFFFF

# ---- event and stream creation flags (create_event_with_flag, create_stream_with_config) ----
ACL_EVENT_SYNC = 0x1
ACL_EVENT_CAPTURE_STREAM_PROGRESS = 0x2
ACL_EVENT_TIME_LINE = 0x8
ACL_EVENT_DEVICE_USE_ONLY = 0x10
ACL_EVENT_EXTERNAL = 0x20
ACL_EVENT_IPC = 0x40
ACL_STREAM_FAST_LAUNCH = 0x1
ACL_STREAM_FAST_SYNC = 0x2
ACL_STREAM_PERSISTENT = 0x4
ACL_STREAM_HUGE = 0x8
ACL_STREAM_CPU_SCHEDULE = 0x10
ACL_STREAM_DEVICE_USE_ONLY = 0x20

# ---- aclmdlRICaptureMode (npualloc.Graph's capture_error_mode "global", "thread_local", "relaxed") ----
ACL_MODEL_RI_CAPTURE_MODE_GLOBAL = 0
ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL = 1
ACL_MODEL_RI_CAPTURE_MODE_RELAXED = 2

# ---- export / IPC flags ----
ACL_RT_VMM_EXPORT_FLAG_DEFAULT = 0x0
ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION = 0x1
ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT = 0x0
ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION = 0x1
ACL_RT_IPC_MEM_IMPORT_FLAG_DEFAULT = 0x0
ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS = 0x1
ACL_RT_NOTIFY_EXPORT_FLAG_DISABLE_PID_VALIDATION = 0x02
ACL_HOST_REG_MAPPED = 0x2
ACL_HOST_REG_PINNED = 0x10000000
ACL_IPC_EVENT_HANDLE_SIZE = 64


def init(config_path=None):
    """``ret = acl.init(config_path=None)``: starts the runtime (it also starts on first use).

    A second call returns ACL_ERROR_REPEAT_INITIALIZE and the runtime keeps working. The
    configuration file is not read (npualloc is configured by ``NPUALLOC_*`` or
    ``npualloc.configure``). ValueError when the ``NPUALLOC_*`` environment is malformed.
    """
    return _C.acl.init(config_path)


def finalize():
    """``ret = acl.finalize()``: ends what ``acl.init`` began; ACL_ERROR_REPEAT_FINALIZE without it.

    Memory, streams and events stay valid (``npualloc.testing.restart()`` releases them and starts afresh).
    """
    return _C.acl.finalize()


# ---- acl.util ----

# pyACL's npy_type codes (numpy's type numbers) -> numpy dtype names: the fixed-size numeric types.
# pyACL lists 0-12 and 23 and defers to NumPy's numbering for the rest; 17 (object) would read
# device bytes as object pointers, 18-22 have no fixed size or unit: those are refused.
_NPY_TYPES = {
    0: "bool",
    1: "int8",
    2: "uint8",
    3: "int16",
    4: "uint16",
    5: "int32",
    6: "uint32",
    7: "int64",
    8: "uint64",
    9: "longlong",
    10: "ulonglong",
    11: "float32",
    12: "float64",
    13: "longdouble",
    14: "csingle",
    15: "cdouble",
    16: "clongdouble",
    23: "float16",
}


def _is_int(value):
    """An int, NumPy's integers included (acl.rt's arguments take those too), but not a bool."""
    return isinstance(value, _numbers.Integral) and not isinstance(value, bool)


def numpy_to_ptr(arr):
    """``ptr = acl.util.numpy_to_ptr(arr)``: the address of an ndarray's data (no copy).

    The caller keeps ``arr`` alive while the pointer is used. A non-contiguous array warns
    (as pyACL does): its data is not one block of ``arr.nbytes`` bytes.
    """
    import numpy as np

    if not isinstance(arr, np.ndarray):
        raise TypeError(f"acl.util.numpy_to_ptr() argument 'arr' must be numpy.ndarray, not {type(arr).__name__}")
    if not arr.flags.c_contiguous:
        _warnings.warn("acl.util.numpy_to_ptr(): the array is not C-contiguous; use numpy.ascontiguousarray first",
                       RuntimeWarning, stacklevel=2)
    return arr.__array_interface__["data"][0]


def ptr_to_numpy(ptr, shape, npy_type):
    """``arr = acl.util.ptr_to_numpy(ptr, shape, npy_type)``: an ndarray over memory at ``ptr``.

    No copy: the array is a writable view, valid while the memory stays allocated (and mapped); over
    ``ACL_MEM_ACCESS_USER_SPACE_READONLY`` memory it is read-only (numpy refuses a write with ValueError,
    where a write to the pages would fault).
    A device range is checked when the view is made: ValueError unless it is mapped throughout.
    ``npy_type`` is pyACL's code (NumPy's type number): 0 BOOL, 1 INT8, 2 UINT8, 3 INT16, 4 UINT16,
    5 INT32, 6 UINT32, 7 INT64, 8 UINT64, 9 LONGLONG, 10 ULONGLONG, 11 FLOAT32, 12 DOUBLE,
    13 LONGDOUBLE, 14 CFLOAT, 15 CDOUBLE, 16 CLONGDOUBLE, 23 FLOAT16.
    """
    import numpy as np

    if not _is_int(ptr):
        raise TypeError(f"acl.util.ptr_to_numpy() argument 'ptr' must be int, not {type(ptr).__name__}")
    if _is_int(shape):
        shape = (shape,)
    if not isinstance(shape, (tuple, list)) or not all(_is_int(d) for d in shape):
        raise TypeError("acl.util.ptr_to_numpy() argument 'shape' must be a tuple or list of ints, "
                        f"not {type(shape).__name__}")
    if not _is_int(npy_type):
        raise TypeError(f"acl.util.ptr_to_numpy() argument 'npy_type' must be int, not {type(npy_type).__name__}")
    ptr, npy_type, shape = int(ptr), int(npy_type), [int(d) for d in shape]
    if any(d < 0 for d in shape):
        raise ValueError(f"acl.util.ptr_to_numpy(): negative dimension in shape {tuple(shape)}")
    if npy_type not in _NPY_TYPES:
        raise ValueError(f"acl.util.ptr_to_numpy(): unsupported npy_type {npy_type} "
                         f"(supported: {sorted(_NPY_TYPES)})")
    dtype = np.dtype(_NPY_TYPES[npy_type])
    count = 1
    for d in shape:
        count *= d
    view = _C.acl.memory(ptr, count * dtype.itemsize)
    return np.frombuffer(view, dtype=dtype, count=count).reshape(tuple(shape))


util = _types.ModuleType("npualloc.acl.util", "pyACL's acl.util: pointers to and from bytes and numpy arrays.")
util.ptr_to_bytes = _C.acl.ptr_to_bytes
util.bytes_to_ptr = _C.acl.bytes_to_ptr
util.numpy_to_ptr = numpy_to_ptr
util.ptr_to_numpy = ptr_to_numpy
del numpy_to_ptr, ptr_to_numpy
