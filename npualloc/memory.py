"""The torch_npu-like memory API (``torch_npu.npu.memory`` and friends) over npualloc's caching
allocator.  Everything here is also importable from ``npualloc`` directly.

Devices are ints (``"npu:N"`` strings and objects with ``.type``/``.index``, such as a
``torch.device``, are accepted where torch_npu accepts a device); pointers are ints.
``caching_allocator_alloc``, ``caching_allocator_delete`` and ``empty`` are implemented in C
(``npualloc._C.memory``); the rest follows torch_npu's Python code.

Errors that torch_npu builds with ``pta_error(...)`` carry its suffix
``"\\n[ERROR] <time> (PID:<pid>, Device:<dev>, RankID:-1) ERR<sub><code> PTA <text>"`` unless
``TORCH_NPU_COMPACT_ERROR_OUTPUT`` is a non-zero int (or Python runs interactively).
"""
import collections
import collections.abc
import ctypes
import inspect
import operator
import os
import pickle
import re
import sys
import time
import warnings

from . import _C

_M = _C.memory

OutOfMemoryError = _M.OutOfMemoryError
Buffer = _M.Buffer
caching_allocator_alloc = _M.caching_allocator_alloc
caching_allocator_delete = _M.caching_allocator_delete
empty = _M.empty

__all__ = [
    "OutOfMemoryError",
    "Buffer",
    "empty",
    "caching_allocator_alloc",
    "caching_allocator_delete",
    "set_per_process_memory_fraction",
    "get_per_process_memory_fraction",
    "empty_cache",
    "empty_virt_addr_cache",
    "memory_stats",
    "memory_stats_as_nested_dict",
    "reset_accumulated_memory_stats",
    "reset_peak_memory_stats",
    "reset_max_memory_allocated",
    "reset_max_memory_cached",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "memory_cached",
    "max_memory_cached",
    "memory_snapshot",
    "memory_summary",
    "mem_get_info",
    "get_allocator_backend",
    "device_count",
    "set_device",
    "current_device",
    "is_initialized",
    "synchronize",
    "record_stream",
    "erase_stream",
    "NPUPluggableAllocator",
    "change_current_allocator",
]

# ---- torch_npu's error suffix (torch_npu/utils/_error_code.py) ----

_ERR_CODES = {
    "SUCCESS": (0, "success"),
    "PARAM": (1, "invalid parameter"),
    "TYPE": (2, "invalid type"),
    "VALUE": (3, "invalid value"),
    "PTR": (4, "invalid pointer"),
    "INTERNAL": (5, "internal error"),
    "MEMORY": (6, "memory error"),
    "NOT_SUPPORT": (7, "feature not supported"),
    "NOT_FOUND": (8, "resource not found"),
    "UNAVAIL": (9, "resource unavailable"),
    "SYSCALL": (10, "system call failed"),
    "TIMEOUT": (11, "timeout error"),
    "PERMISSION": (12, "permission error"),
    "ACL": (100, "call acl api failed"),
    "HCCL": (200, "call hccl api failed"),
    "GE": (300, "call ge api failed"),
    "EXCEPT": (999, "applicaiton exception"),
}


def _is_interactive_command_line():
    if hasattr(sys, "ps1") or sys.flags.interactive:
        return True
    try:
        __IPYTHON__  # noqa: F821
        return True
    except NameError:
        pass
    return "ipykernel" in sys.modules


def _compact_error_output():
    try:
        return int(os.getenv("TORCH_NPU_COMPACT_ERROR_OUTPUT", "0")) != 0
    except ValueError:
        return False


def _pta_error(code):
    """torch_npu's ``pta_error(ErrCode.<code>)``: the suffix torch_npu appends to its messages."""
    if _compact_error_output() or _is_interactive_command_line():
        return ""
    num, text = _ERR_CODES[code]
    return "\n[ERROR] {time} (PID:{pid}, Device:{device}, RankID:{rank}) ERR{sub:0>2d}{code:0>3d} PTA {msg}".format(
        time=time.strftime("%Y-%m-%d-%H:%M:%S", time.localtime()), pid=os.getpid(), device=_M._local_device(),
        rank=-1, sub=0, code=num, msg=text)


_SUBMODULES = ("PTA", "OPS", "DIST", "GRAPH", "PROF")
_ERR_TEXTS = {num: text for num, text in _ERR_CODES.values()}


def _strtol(text):
    """C's strtol(text, NULL, 10): leading digits after blanks and a sign, 0 when none, clamped to a long."""
    m = re.match(r"[ \t\n\v\f\r]*([+-]?[0-9]+)", text)
    return max(-(1 << 63), min((1 << 63) - 1, int(m.group(1)))) if m else 0


def _cpp_error_suffix(submodule, code):
    """torch_npu's C++ ``PTA_ERROR`` / ``OPS_ERROR`` suffix (``formatErrorCode``): as ``pta_error`` but
    with the submodule's own number and name, RankID from ``RANK`` and no check for an interactive
    Python (the settings errors carry it)."""
    if _compact_error_output():
        return ""
    rank = os.environ.get("RANK")
    return "\n[ERROR] {time} (PID:{pid}, Device:{device}, RankID:{rank}) ERR{sub:0>2d}{code:0>3d} {name} {msg}".format(
        time=time.strftime("%Y-%m-%d-%H:%M:%S", time.localtime()), pid=os.getpid(), device=_M._local_device(),
        rank=-1 if rank is None else _strtol(rank), sub=submodule, code=code, name=_SUBMODULES[submodule],
        msg=_ERR_TEXTS[code])


# ---- devices ----

# c10's device strings (c10/core/Device.cpp): a type, then optionally ':' and an index without sign,
# spaces or leading zeros; torch.device() raises RuntimeError for anything else.
_DEVICE_RE = re.compile(r"([a-zA-Z_]+)(?::(0|[1-9][0-9]*))?")
# The types c10 knows, in its error's order, privateuseone under torch_npu's name for it.
_DEVICE_TYPES = ("cpu", "cuda", "ipu", "xpu", "mkldnn", "opengl", "opencl", "ideep", "hip", "ve", "fpga", "maia",
                 "xla", "lazy", "vulkan", "mps", "meta", "hpu", "mtia", "npu")


def _parse_device(device):
    """(type, index or None) of a device string or a torch.device-like object; None otherwise.
    A string is read as torch.device(string) reads it, with its RuntimeErrors."""
    if isinstance(device, str):
        if not device:
            raise RuntimeError("Device string must not be empty")
        m = _DEVICE_RE.fullmatch(device)
        if not m:
            raise RuntimeError(f"Invalid device string: '{device}'")
        if m.group(1) not in _DEVICE_TYPES:
            raise RuntimeError(f"Expected one of {', '.join(_DEVICE_TYPES)} device type at start of device "
                               f"string: {m.group(1)}")
        return m.group(1), (int(m.group(2)) if m.group(2) is not None else None)
    if hasattr(device, "type") and hasattr(device, "index") and not isinstance(device, int):
        return device.type, device.index
    return None


def _get_device_index(device, optional=False, allow_cpu=False):
    """torch_npu's ``_get_device_index``: an int index from an int, ``"npu:N"``, a device object,
    or (optional=True) None for the current device."""
    parsed = _parse_device(device)
    idx = None
    if parsed is not None:
        dtype, idx = parsed
        if allow_cpu:
            if dtype not in ("npu", "cpu"):
                raise ValueError("Expected a npu or cpu device, but got: {}".format(device) + _pta_error("VALUE"))
            if dtype == "cpu":
                return -1
        elif dtype != "npu":
            raise ValueError("Expected a npu device, but got: {}".format(device) + _pta_error("VALUE"))
    elif isinstance(device, int):
        idx = int(device)
    elif device is not None:
        raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
    if idx is None:
        if optional:
            return current_device()
        raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
    return idx


def is_initialized():
    """True once the virtual NPU runtime has started (torch_npu's lazy initialisation)."""
    return _C.initialized()


def device_count():
    """The number of virtual NPUs."""
    return _M._device_count()


def current_device():
    """The calling thread's device; like torch_npu's lazy init, device 0 is set if none is."""
    return _M._current_device()


def set_device(device):
    """Makes ``device`` the calling thread's current device (a negative index does nothing)."""
    device = _get_device_index(device, optional=True)
    if device >= 0:
        _M._set_device(device)


def synchronize(device=None):
    """Waits for everything queued on every stream of ``device`` (default: the current one; -1 too, as
    torch_npu's ``with device(-1)`` changes nothing)."""
    device = _get_device_index(device, optional=True)
    return _M._synchronize(current_device() if device == -1 else device)


def mem_get_info(device=None):
    """(free, total) bytes of the device's HBM, from aclrtGetMemInfo(ACL_HBM_MEM).  As torch_npu,
    ``"npu"`` (no index) is the current device, and an index out of range an AssertionError."""
    if device is None:
        device = current_device()
    device = _get_device_index(device, optional=True)
    if device < 0 or device >= device_count():
        raise AssertionError("Invalid device id" + _pta_error("VALUE"))
    return _M._mem_get_info(device)


# ---- the caching allocator ----

def set_per_process_memory_fraction(fraction, device=None) -> None:
    """Limits the caching allocator's reserved memory on ``device`` to ``fraction`` x its total
    memory; going beyond raises OutOfMemoryError.  Like torch_npu, also makes ``device`` current."""
    current_device()  # torch_npu's _lazy_init()
    if device is None:
        device = current_device()
    device = _get_device_index(device)
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`" + _pta_error("TYPE"))
    if fraction < 0 or fraction > 1:
        raise ValueError("Invalid fraction value: {}. Allowed range: 0~1".format(fraction) + _pta_error("VALUE"))
    # torch_npu's setMemoryFraction checks the device, then the fraction (NaN gets this far), and
    # only then sets the device: a refused call leaves the current device alone.
    if device < 0 or device >= device_count():
        raise RuntimeError(f"Allocator not initialized for device {device}: did you call init?")
    _M._set_fraction(device, fraction)
    _M._set_device(device)


def get_per_process_memory_fraction(device=None) -> float:
    """The fraction set for ``device`` (1.0 when none was set).  As torch's, ``device`` needs an index
    (``"npu"`` is a ValueError); None is the current device."""
    current_device()  # torch's _lazy_init()
    if device is None:
        device = current_device()
    return _M._get_fraction(_get_device_index(device))


def empty_cache():
    """Returns every unused cached segment to the devices (after synchronising them)."""
    if is_initialized():
        _M._empty_cache()


def empty_virt_addr_cache():
    """torch_npu's lighter empty_cache: after synchronising, unmaps the free pages of expandable segments
    but keeps their physical memory for the next mapping (so other processes do not get it back; call
    empty_cache() for that).  Unused plain segments are returned, as by empty_cache.  Raises RuntimeError
    unless expandable_segments:True is in effect."""
    if is_initialized():
        _M._empty_virt_addr_cache()


def _stats_device(device):
    """The device whose statistics are read, or None before the runtime has started (no stats yet).
    With a pluggable allocator current, torch_npu's warning first, then the caching allocator's
    figures: it served nothing."""
    if not is_initialized():
        return None
    device = _get_device_index(device, optional=True)
    _unsupported_by_pluggable("getDeviceStats")
    return device


def memory_stats(device=None):
    """torch_npu's flattened, sorted statistics (an OrderedDict of 123 ints): the keys of
    memory_stats_as_nested_dict() joined with dots, as torch_npu flattens them."""
    device = _stats_device(device)
    return collections.OrderedDict() if device is None else collections.OrderedDict(_M._flat_stats(device))


def _stat(device, key):
    """memory_stats(device)[key] (0 before the runtime starts), reading that one value."""
    device = _stats_device(device)
    return 0 if device is None else _M._stat(device, key)


def memory_stats_as_nested_dict(device=None):
    """The statistics as torch_npu's nested dict ({} before the runtime started)."""
    device = _stats_device(device)
    return {} if device is None else _M._stats(device)


def reset_accumulated_memory_stats(device=None):
    """Zeroes the "allocated"/"freed" counters and the event counters."""
    device = _get_device_index(device, optional=True)
    if _unsupported_by_pluggable("resetAccumulatedStats"):
        return None
    return _M._reset_accumulated(device)


def reset_peak_memory_stats(device=None):
    """Sets every "peak" to its "current"."""
    device = _get_device_index(device, optional=True)
    if _unsupported_by_pluggable("resetPeakStats"):
        return None
    return _M._reset_peak(device)


def reset_max_memory_allocated(device=None):
    """Deprecated, as in torch_npu: warns (DeprecationWarning) and calls reset_peak_memory_stats(device),
    which resets every peak, not only max_memory_allocated()'s."""
    warnings.warn(
        "torch_npu.npu.reset_max_memory_allocated now calls torch_npu.npu.reset_peak_memory_stats, "
        "which resets /all/ peak memory stats.",
        DeprecationWarning)
    return reset_peak_memory_stats(device=device)


def reset_max_memory_cached(device=None):
    """Deprecated, as in torch_npu: warns (DeprecationWarning) and calls reset_peak_memory_stats(device),
    which resets every peak, not only max_memory_reserved()'s."""
    warnings.warn(
        "torch_npu.npu.reset_max_memory_cached now calls torch_npu.npu.reset_peak_memory_stats, "
        "which resets /all/ peak memory stats.",
        DeprecationWarning)
    return reset_peak_memory_stats(device=device)


def memory_allocated(device=None):
    """Bytes the caching allocator has handed out on ``device`` (default: the current one) and not yet
    freed, counted in block sizes (a 1-byte request counts 512); 0 before the runtime starts.
    ``torch.npu.memory_allocated``: ``memory_stats()["allocated_bytes.all.current"]``."""
    return _stat(device, "allocated_bytes.all.current")


def max_memory_allocated(device=None):
    """The peak of memory_allocated(device) in bytes since the runtime started or reset_peak_memory_stats().
    ``torch.npu.max_memory_allocated``: ``memory_stats()["allocated_bytes.all.peak"]``."""
    return _stat(device, "allocated_bytes.all.peak")


def memory_reserved(device=None):
    """Bytes of device memory the caching allocator holds on ``device`` (default: the current one): its
    segments, allocated blocks and cached free ones alike; 0 before the runtime starts.
    ``torch.npu.memory_reserved``: ``memory_stats()["reserved_bytes.all.current"]``."""
    return _stat(device, "reserved_bytes.all.current")


def max_memory_reserved(device=None):
    """The peak of memory_reserved(device) in bytes since the runtime started or reset_peak_memory_stats().
    ``torch.npu.max_memory_reserved``: ``memory_stats()["reserved_bytes.all.peak"]``."""
    return _stat(device, "reserved_bytes.all.peak")


def memory_cached(device=None):
    """Deprecated name of memory_reserved(), as in torch_npu: warns (DeprecationWarning) and returns
    memory_reserved(device), in bytes."""
    warnings.warn("torch_npu.npu.memory_cached has been renamed to torch_npu.npu.memory_reserved",
                  DeprecationWarning)
    return memory_reserved(device=device)


def max_memory_cached(device=None):
    """Deprecated name of max_memory_reserved(), as in torch_npu: warns (DeprecationWarning) and returns
    max_memory_reserved(device), in bytes."""
    warnings.warn("torch_npu.npu.max_memory_cached has been renamed to torch_npu.npu.max_memory_reserved",
                  DeprecationWarning)
    return max_memory_reserved(device=device)


def get_allocator_backend() -> str:
    """``torch.npu.get_allocator_backend()``: the name of the caching allocator's backend, always
    ``"native"`` (npualloc has no other; a pluggable allocator made current does not change it)."""
    return "native"


# ---- a pluggable allocator (torch_npu's NPUPluggableAllocator) ----

class _NPUAllocator:
    """An allocator the caching allocator can be swapped for (torch_npu's ``_NPUAllocator``)."""

    def __init__(self, allocator):
        self._allocator = allocator

    def allocator(self):
        """The allocator to hand to change_current_allocator() or MemPool(allocator=): for an
        NPUPluggableAllocator, its library's (alloc, free) function addresses; for the caching allocator
        (_get_current_allocator()), the string "native"."""
        return self._allocator


_NATIVE = "native"  # what _get_current_allocator() wraps while the caching allocator is current
_current = _NATIVE


class NPUPluggableAllocator(_NPUAllocator):
    """An allocator loaded from a shared library, as torch_npu's: ``alloc_fn_name`` names
    ``void *alloc(size_t size, int device, aclrtStream stream)`` and ``free_fn_name``
    ``void free(void *ptr, size_t size, int device, aclrtStream stream)``.

    After :func:`change_current_allocator`, ``caching_allocator_alloc``, ``empty`` and their frees
    call them (with the size asked, not rounded, and the free told the allocation's size, device and
    stream).  The library can call the runtime's ``aclrt*`` functions (``acl_rt.h`` in
    :func:`npualloc.get_include`): npualloc's extension exports them to the libraries loaded after the
    first NPUPluggableAllocator (load yours through it, not with ctypes first)."""

    def __init__(self, path_to_so_file, alloc_fn_name, free_fn_name):
        # The extension is loaded with RTLD_LOCAL: make its aclrt* symbols resolve the library's.
        ctypes.CDLL(_C.__file__, mode=os.RTLD_NOW | os.RTLD_GLOBAL | os.RTLD_NOLOAD)
        self._library = ctypes.CDLL(path_to_so_file)  # kept: the functions live in it
        alloc_fn = ctypes.cast(getattr(self._library, alloc_fn_name), ctypes.c_void_p).value
        free_fn = ctypes.cast(getattr(self._library, free_fn_name), ctypes.c_void_p).value
        super().__init__((alloc_fn, free_fn))


def change_current_allocator(allocator) -> None:
    """Makes ``allocator`` (an :class:`NPUPluggableAllocator`) the one every allocation uses.  As in
    torch_npu, only before the allocator in use is initialized: RuntimeError once any device's
    caching allocator has started, or a pluggable allocator is current (until
    ``npualloc.testing.restart``)."""
    global _current
    if not isinstance(allocator, _NPUAllocator) or not isinstance(allocator.allocator(), tuple):
        raise TypeError(f"allocator should be an NPUPluggableAllocator, could not be {type(allocator)}"
                        + _pta_error("TYPE"))
    _M._change_current_allocator(*allocator.allocator())
    _current = allocator.allocator()


def _get_current_allocator():
    """The allocator in use: the pluggable one made current, or the caching allocator."""
    return _NPUAllocator(_current if _M._allocator_is_pluggable() else _NATIVE)


def _unsupported_by_pluggable(what):
    """True (after torch_npu's warning) when a pluggable allocator is current: it keeps no stats,
    snapshots or history.  The warning points at the first caller outside the package, however many
    of its functions lie between (Python 3.12's skip_file_prefixes, by hand)."""
    if not _M._allocator_is_pluggable():
        return False
    frame, level = sys._getframe(1), 2  # level 1 is this function
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(f"NPUPluggableAllocator does not yet support {what}. "
                  "If you need it, please file an issue describing your use case.", stacklevel=level)
    return True


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def record_stream(ptr, stream):
    """``tensor.record_stream(stream)`` for a pointer (or a Buffer): the block is reused only after
    the work queued on ``stream`` when it is freed has run."""
    if isinstance(ptr, Buffer):
        return ptr.record_stream(stream)
    if stream is None:  # as Buffer.record_stream (torch takes a Stream): not "the current stream of device 0"
        raise TypeError("record_stream(): argument 'stream' must be npualloc.Stream or int")
    return _M._record_stream(ptr, stream)


def erase_stream(ptr, stream):
    """``torch_npu.erase_stream(tensor, stream)``: forgets a record_stream use.  As in torch_npu it
    does nothing unless the block's own stream is the current stream of its device."""
    from .streams import Stream
    if isinstance(ptr, Buffer):
        if _M._caching_disabled():
            return None
        ptr = ptr.ptr
    elif not isinstance(ptr, int):
        raise TypeError(f"ptr should be int or npualloc.Buffer, could not be {type(ptr)}" + _pta_error("TYPE"))
    if not isinstance(stream, Stream):
        raise TypeError(f"stream should be torch_npu.npu.Stream, could not be {type(stream)}" + _pta_error("TYPE"))
    return _M._erase_stream(ptr, stream)


def _set_allocator_settings(settings):
    """Changes allocator settings at run time (torch_npu's allowed keys)."""
    _M._set_settings(settings)


def _attach_out_of_memory_observer(observer):
    """observer(device, alloc_size, allowed_or_total, device_free) runs before OutOfMemoryError."""
    if _unsupported_by_pluggable("attachOutOfMemoryObserver"):
        return
    _M._attach_oom_observer(observer)


def _clear_out_of_memory_observers():
    """Forgets every attached OOM observer (npualloc extension, for tests)."""
    _M._clear_oom_observers()


def _check(device=None):
    """Checks the allocator's invariants for ``device``: None, or AssertionError with the reason."""
    return _M._check(_get_device_index(device, optional=True))


# ---- snapshots and history ----

def _mempool_id(mempool_id):
    """A pool id as torch's binding reads it, two non-negative ints; TypeError for anything else."""
    if isinstance(mempool_id, (str, bytes)) or not isinstance(mempool_id, collections.abc.Sequence) \
            or len(mempool_id) != 2 or not all(isinstance(x, int) and x >= 0 for x in mempool_id):
        raise TypeError(f"mempool_id must be a tuple of two non-negative ints, not {mempool_id!r:.80}")
    return tuple(int(x) for x in mempool_id)


def _pool_segments(mempool_id):
    """The segments of one pool, the default pool (0, 0) included, of every device."""
    want = _mempool_id(mempool_id)
    _unsupported_by_pluggable("snapshot")
    return [s for s in _M._snapshot()["segments"] if s["segment_pool_id"] == want]


def memory_snapshot(mempool_id=None, include_traces=True):
    """The segments of every device (torch_npu's snapshot["segments"]).  As in torch, a ``mempool_id``
    other than None or (0, 0) keeps only the segments of that private pool (none if there is no such
    pool); (0, 0) is every segment, those of private pools included.  ``include_traces`` is torch's
    argument: it only decides whether the snapshot's trace entries are gathered, and the segments returned
    here carry none either way."""
    want = None if mempool_id is None else _mempool_id(mempool_id)
    _unsupported_by_pluggable("snapshot")  # then the caching allocator's: no segments
    segments = _M._snapshot()["segments"]
    if want is not None and want != (0, 0):
        segments = [s for s in segments if s["segment_pool_id"] == want]
    return segments


_CONTEXT_LEVELS = {None: 0, "state": 1, "alloc": 2, "all": 3}  # torch's RecordContext: NEVER..ALL
_MAX_ENTRIES = (1 << 63) - 1


def _check_str(fn, name, value):
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{fn}(): argument '{name}' must be str or None, not {type(value).__name__}")


def _pybind_bool(fn, name, value):
    """A bool argument as torch's pybind11 bindings convert it: True/False, None as False, an object with
    ``__bool__`` (a number) by its truth; anything else (a str, a list) is a TypeError."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if getattr(type(value), "__bool__", None) is not None:
        try:
            return bool(value)
        except Exception:
            pass
    raise TypeError(f"{fn}(): argument '{name}' must be bool, not {type(value).__name__}")


def _pybind_int(fn, name, value, unsigned=False):
    """An integer argument as pybind11 converts it to a 64-bit C integer: an int (a bool included) or an
    object with ``__index__``, in the type's range; anything else, a float included, is a TypeError."""
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{fn}(): argument '{name}' must be int, not {type(value).__name__}") from None
    low, high = (0, 1 << 64) if unsigned else (-(1 << 63), 1 << 63)
    if not low <= n < high:
        raise TypeError(f"{fn}(): argument '{name}' must be an int in [{low}, {high - 1}], got {n}")
    return n


# The actions of trace entries, in the order of npualloc_trace_action (skip_actions' bits).
_TRACE_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
                  "segment_unmap", "snapshot", "oom")


def _check_skip_actions(fn, skip_actions):
    """The skip_actions list's type (torch's binding takes a list of str); None is []."""
    if skip_actions is None:
        return []
    if not isinstance(skip_actions, (list, tuple)):
        raise TypeError(f"{fn}(): argument 'skip_actions' must be a list of str or None, "
                        f"not {type(skip_actions).__name__}")
    for action in skip_actions:
        if not isinstance(action, str):
            raise TypeError(f"{fn}(): argument 'skip_actions' must be a list of str, "
                            f"not a list holding {type(action).__name__}")
    return skip_actions


def _skip_mask(skip_actions):
    """The NPUALLOC_TRACE_SKIP bits of valid action names; torch's error for any other."""
    mask = 0
    for action in skip_actions:
        if action not in _TRACE_ACTIONS:
            raise RuntimeError(f"Unknown TraceEntry action: {action}")
        mask |= 1 << _TRACE_ACTIONS.index(action)
    return mask


def _record_memory_history(enabled="all", *args, **kwargs):
    """Starts or stops recording the caching allocator's history on every device (torch's
    ``torch.cuda.memory._record_memory_history``).

    ``enabled``: None stops recording and clears the history; ``"state"`` keeps where the live
    memory was allocated (blocks and segments carry ``frames``) and a history of a single entry;
    ``"all"`` also keeps a ring buffer of the last ``max_entries`` trace entries (alloc,
    free_requested, free_completed, segment_alloc/free/map/unmap, snapshot, oom).

    ``context``: whose Python stack is kept, as torch's RecordContext: None none, ``"state"`` the
    live blocks' and segments', ``"alloc"`` also alloc-side trace entries', ``"all"`` also the
    frees' (``caching_allocator_delete``, a Buffer freed or collected).

    ``stacks``: ``"python"`` or ``"all"``.  Frames are Python frames, innermost first, as dicts
    ``{"name", "filename", "line"}``; there are no C++ frames to add, so ``"all"`` records the
    same as ``"python"``.

    ``clear_history``: as torch >= 2.3, a call that enables recording keeps what was recorded so
    far (trimmed to the newest ``max_entries``, where torch keeps it whole) unless this is True;
    ``enabled=None`` always clears.  torch_npu instead starts every call from an empty history.

    Bools and counts convert as torch's pybind11 binding converts them: None or a number for a
    bool, an int (True is 1) or an ``__index__`` in range for a count; a str or float count is a
    TypeError.

    ``skip_actions``: trace actions (names as above) that are not recorded from now on; None or []
    records all.  An unknown name raises torch's ``RuntimeError: Unknown TraceEntry action: <name>``.

    ``compile_context`` and ``global_record_annotations`` are accepted (bools) and change nothing:
    nothing here runs torch.compile'd regions or record_function annotations, so entries carry no
    compile context and the snapshot's ``external_annotations`` stays empty.  ``device`` is accepted
    and ignored (the history covers every device, as in torch_npu).  Any other keyword is a
    TypeError, as in torch.

    A bool first argument selects torch's legacy form ``(enabled, record_context=True,
    trace_alloc_max_entries=1, trace_alloc_record_context=False, device=None,
    record_context_cpp=False, clear_history=False, compile_context=False,
    global_record_annotations=False, skip_actions=None)``.
    """
    if isinstance(enabled, bool):
        return _record_memory_history_legacy(enabled, *args, **kwargs)
    return _record_memory_history_impl(enabled, *args, **kwargs)


def _record_memory_history_impl(enabled="all", context="all", stacks="all", max_entries=sys.maxsize,
                                device=None, clear_history=False, compile_context=False,
                                global_record_annotations=False, skip_actions=None):
    fn = "_record_memory_history"
    _check_str(fn, "enabled", enabled)
    _check_str(fn, "context", context)
    if not isinstance(stacks, str):
        raise TypeError(f"{fn}(): argument 'stacks' must be str, not {type(stacks).__name__}")
    max_entries = _pybind_int(fn, "max_entries", max_entries, unsigned=True)  # torch's size_t
    clear_history = _pybind_bool(fn, "clear_history", clear_history)
    _pybind_bool(fn, "compile_context", compile_context)
    _pybind_bool(fn, "global_record_annotations", global_record_annotations)
    skip_actions = _check_skip_actions(fn, skip_actions)
    if not (enabled is None or enabled in ("state", "all")):
        raise RuntimeError("expected state to be 'state', 'all', or None" + _pta_error("NOT_FOUND"))
    if not (context is None or context in ("state", "alloc", "all")):
        raise RuntimeError("expected context to be 'state', 'alloc', 'all', or None" + _pta_error("NOT_FOUND"))
    if stacks not in ("python", "all"):
        raise RuntimeError("expected stacks to be 'python', or 'all'" + _pta_error("NOT_FOUND"))
    skip = _skip_mask(skip_actions)
    current_device()  # torch_npu's _lazy_init()
    entries = max(1, max_entries) if enabled == "all" else 1
    when = _CONTEXT_LEVELS[context] if enabled is not None else 0
    if _unsupported_by_pluggable("recordHistory"):
        return
    _M._record_history(enabled is not None, when, min(entries, _MAX_ENTRIES), clear_history, skip)


def _record_memory_history_legacy(enabled, record_context=True, trace_alloc_max_entries=1,
                                  trace_alloc_record_context=False, device=None, record_context_cpp=False,
                                  clear_history=False, compile_context=False, global_record_annotations=False,
                                  skip_actions=None):
    fn = "_record_memory_history"
    record_context = _pybind_bool(fn, "record_context", record_context)
    trace_alloc_record_context = _pybind_bool(fn, "trace_alloc_record_context", trace_alloc_record_context)
    clear_history = _pybind_bool(fn, "clear_history", clear_history)
    for name, value in (("record_context_cpp", record_context_cpp), ("compile_context", compile_context),
                        ("global_record_annotations", global_record_annotations)):
        _pybind_bool(fn, name, value)
    trace_alloc_max_entries = _pybind_int(fn, "trace_alloc_max_entries", trace_alloc_max_entries)  # int64
    skip = _skip_mask(_check_skip_actions(fn, skip_actions))
    if trace_alloc_record_context:
        when = _CONTEXT_LEVELS["alloc"]
    elif record_context:
        when = _CONTEXT_LEVELS["state"]
    else:
        when = 0
    current_device()  # torch's lazyInitDevice
    # torch converts the int64 to size_t: a negative count is a huge one
    entries = max(1, trace_alloc_max_entries) if trace_alloc_max_entries >= 0 else _MAX_ENTRIES
    if _unsupported_by_pluggable("recordHistory"):
        return
    _M._record_history(enabled, when if enabled else 0, min(entries, _MAX_ENTRIES), clear_history, skip)


_record_memory_history.__signature__ = inspect.signature(_record_memory_history_impl)


def _set_memory_metadata(metadata):
    """Attaches ``metadata`` (a str; "" for none) to the current device's trace entries recorded from
    now on, as their ``user_metadata`` (torch's ``torch.cuda.memory._set_memory_metadata``)."""
    _M._set_user_metadata(current_device(), metadata)


def _get_memory_metadata():
    """The metadata the current device's new trace entries get ("" for none; torch's
    ``_get_memory_metadata``)."""
    return _M._get_user_metadata(current_device())


def _snapshot(device=None, augment_with_fx_traces=False):
    """torch's snapshot dict: ``{"segments": [...], "device_traces": [[entries of device d] for d],
    "allocator_settings": {...}, "external_annotations": []}`` (``device`` is ignored: every device is
    included).  ``external_annotations`` is torch >= 2.6's list of record_function annotations; npualloc
    records none, so it is empty.  ``augment_with_fx_traces`` is torch's argument: it adds FX
    graph nodes to frames that come from FX-generated code, which npualloc's frames never do, so it
    changes nothing.

    Segments and blocks always carry ``frames``: the Python stack where the live block was allocated,
    and for a segment where it was allocated, or [] when not recorded.  As in torch, a segment whose first
    block has been split reports [] from then on, even after the merge back: the split hands out a new
    first block, and the stack stays with the old one, which the merge drops.  A trace entry carries
    ``frames`` only when its context was kept (context "alloc" or "all"), and always torch's
    ``compile_context`` ("N/A": no compiled regions here) and ``user_metadata`` (see
    ``_set_memory_metadata``; "" for none).  Trace entries are oldest first; an "oom" entry has
    ``device_free`` instead of ``addr``.  Frames lists may be shared between entries that come from
    one stack, as in torch."""
    _unsupported_by_pluggable("snapshot")  # then the caching allocator's: empty
    return _M._snapshot()


def _dump_snapshot(filename="dump_snapshot.pickle", augment_with_fx_traces=False):
    """Pickles ``_snapshot()`` into ``filename``: only dicts, lists, tuples, ints, floats, strings and
    bools, so torch's ``torch.cuda._memory_viz`` and its web viewer read it, and so does an
    unpickler that refuses every global.  ``augment_with_fx_traces``: as for :func:`_snapshot`."""
    data = _snapshot(augment_with_fx_traces=augment_with_fx_traces)
    # torch's plain open(): the file is 0666 less the umask, like any file the user writes
    with open(filename, "wb") as f:
        pickle.dump(data, f)


# ---- memory_summary (torch_npu's table, 75 characters wide) ----

def _format_size(sz, pref_sz):
    prefixes = ["B ", "KB", "MB", "GB", "TB", "PB"]
    prefix = prefixes[0]
    for new_prefix in prefixes[1:]:
        if pref_sz < 768 * 1024:
            break
        prefix = new_prefix
        sz //= 1024
        pref_sz /= 1024
    return "{:7d} {}".format(sz, prefix)


def _format_count(cnt, pref_cnt):
    prefixes = [" ", "K", "M"]
    prefix = prefixes[0]
    for new_prefix in prefixes[1:]:
        if pref_cnt < 750 * 1000:
            break
        prefix = new_prefix
        cnt //= 1000
        pref_cnt /= 1000
    return "{:7d} {} ".format(cnt, prefix)


def _create_metrics_to_display():
    metrics_to_display = [
        ("allocated_bytes", "Allocated memory", _format_size),
        ("active_bytes", "Active memory", _format_size),
        ("reserved_bytes", "NPU reserved memory", _format_size),
        ("inactive_split_bytes", "Non-releasable memory", _format_size),
        ("allocation", "Allocations", _format_count),
        ("active", "Active allocs", _format_count),
        ("segment", "NPU reserved segments", _format_count),
        ("inactive_split", "Non-releasable allocs", _format_count),
    ]
    lines = []
    lines.append("=" * 75)
    lines.append(" {_:16} PyTorch NPU memory summary, device ID {device:<18d} ")
    lines.append("-" * 75)
    lines.append("  {_:9} NPU OOMs: {num_ooms:<13d} | {_:6} npuMalloc retries: {num_alloc_retries:<9d}  ")
    lines.append("=" * 75)
    lines.append("        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ")
    return metrics_to_display, lines


def memory_summary(device=None, abbreviated=False):
    """torch_npu's human-readable table of the allocator statistics of ``device``."""
    device = _get_device_index(device, optional=True)
    stats = memory_stats(device=device)
    metrics_to_display, lines = _create_metrics_to_display()

    for metric_key, metric_name, formatter in metrics_to_display:
        lines.append("-" * 75)
        submetrics = [("all", metric_name)]
        if not abbreviated:
            submetrics.append(("large_pool", "      from large pool"))
            submetrics.append(("small_pool", "      from small pool"))

        current_prefval, peak_prefval, allocated_prefval, freed_prefval = None, None, None, None

        for submetric_key, submetric_name in submetrics:
            prefix = metric_key + "." + submetric_key + "."

            current = stats[prefix + "current"]
            peak = stats[prefix + "peak"]
            allocated = stats[prefix + "allocated"]
            freed = stats[prefix + "freed"]

            if current_prefval is None:
                current_prefval = current
                peak_prefval = peak
                allocated_prefval = allocated
                freed_prefval = freed

            lines.append(" {:<21} | {} | {} | {} | {} ".format(
                submetric_name,
                formatter(current, current_prefval),
                formatter(peak, peak_prefval),
                formatter(allocated, allocated_prefval),
                formatter(freed, freed_prefval)), )

    metrics_to_display = [
        ("oversize_allocations", "Oversize allocations", _format_count),
        ("oversize_segments", "Oversize NPU segments", _format_count),
    ]

    for metric_key, metric_name, formatter in metrics_to_display:
        lines.append("-" * 75)
        prefix = metric_key + "."
        current = stats[prefix + "current"]
        peak = stats[prefix + "peak"]
        allocated = stats[prefix + "allocated"]
        freed = stats[prefix + "freed"]
        lines.append(" {:<21} | {} | {} | {} | {} ".format(
            metric_name,
            formatter(current, current),
            formatter(peak, peak),
            formatter(allocated, allocated),
            formatter(freed, freed)), )

    lines.append("=" * 75)

    fmt_dict = {"_": "", "device": device}
    for k, v in stats.items():
        fmt_dict[k.replace(".", "-")] = v
    return "|" + "|\n|".join(lines).format(**fmt_dict) + "|\n"


from . import streams as _streams  # noqa: E402  (registers npualloc.Stream with the C face)
