"""Sharing caching-allocator memory with other processes, without copying.

``handle = npualloc.share(ptr)`` makes a small picklable handle for a live block of the caching
allocator (from a plain segment or an expandable one); another process of the same user calls
``ptr2 = npualloc.open_shared(handle)`` and sees the same bytes at ``ptr2`` (writes by either
side are seen by the other), then ``npualloc.close_shared(ptr2)``.

While any other process has the block open, the owner's allocator does not reuse its memory:
``caching_allocator_delete`` of a shared block returns at once, and the block waits (like one
waiting for stream events) until the last opener closed it, or died.  A block freed by its owner
can no longer be opened.  Details: docs/sharing.md.
"""
import re

from . import _C
from .memory import Buffer, _parse_device

_I = _C.ipc

__all__ = ["SharedBlock", "share", "open_shared", "close_shared"]


class SharedBlock:
    """A handle for a caching-allocator block shared by ``npualloc.share`` (picklable; opaque).

    Attributes: ``kind`` ('c': the block's whole segment is shared and the handle carries the
    block's offset; 'e': the physical pages of an expandable segment that the block spans),
    ``owner_pid``, ``device`` and ``size`` (the block's size in bytes).
    """

    __slots__ = ("_data", "kind", "owner_pid", "device", "size")

    def __init__(self, data):
        data = bytes(data)
        kind, pid, device, size = _I.describe(data)  # ValueError for anything else
        self._data = data
        self.kind = kind
        self.owner_pid = pid
        self.device = device
        self.size = size

    def __bytes__(self):
        return self._data

    def __reduce__(self):
        return (SharedBlock, (self._data,))

    def __eq__(self, other):
        return isinstance(other, SharedBlock) and other._data == self._data

    def __hash__(self):
        return hash(self._data)

    def __repr__(self):
        return (f"SharedBlock(kind={self.kind!r}, owner_pid={self.owner_pid}, device={self.device}, "
                f"size={self.size})")


def _device_index(device):
    """open_shared's device: None (the owner's), an int, 'npu:N' or an npu device object; a negative index
    is passed on, for the runtime to refuse as a device that does not exist."""
    if device is None:
        return None
    if isinstance(device, bool):
        raise TypeError("device must be None, an int or 'npu:N', not bool")
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        m = re.fullmatch(r"npu:(-?[0-9]+)", device)
        if not m:
            raise ValueError(f"Invalid device string: {device!r}")
        return int(m.group(1))
    parsed = _parse_device(device)
    if parsed is None:
        raise TypeError(f"device must be None, an int or 'npu:N', not {type(device).__name__}")
    kind, index = parsed
    if kind != "npu" or not isinstance(index, int):
        raise ValueError(f"Expected a npu device with an index, but got: {device}")
    return index


def share(ptr):
    """``share(ptr) -> SharedBlock``: a handle another process can open with ``open_shared``.

    ``ptr`` is a pointer returned by ``caching_allocator_alloc``, or a Buffer returned by
    ``empty``, that has not been freed. Sharing the same block again returns an equal handle.
    RuntimeError for an int that is no live block, TypeError for anything else.
    """
    if isinstance(ptr, Buffer):  # as record_stream takes one: empty() hands out Buffers, not ints
        ptr = ptr.ptr
    if isinstance(ptr, bool) or not isinstance(ptr, int):
        raise TypeError(f"share() argument 'ptr' must be int or Buffer, not {type(ptr).__name__}")
    return SharedBlock(_I.share(ptr))


def open_shared(handle, device=None):
    """``open_shared(handle, device=None) -> ptr``: maps a block shared by another process.

    ``device`` (default None: the owner's device) is the device the memory is mapped for; another
    device than the owner's needs peer access between the two (``acl.rt.device_enable_peer_access``).
    Opening the same handle again, also from several threads at once, returns the same pointer
    (close it as many times).  RuntimeError when the owner freed the block or exited, refused, or
    is not of this user, and for a device that does not exist (a negative index included).
    """
    if isinstance(handle, SharedBlock):
        data = handle._data
    elif isinstance(handle, (bytes, bytearray, memoryview)):
        data = bytes(handle)
    else:
        raise TypeError(f"open_shared() argument 'handle' must be SharedBlock, not {type(handle).__name__}")
    return _I.open_shared(data, _device_index(device))


def close_shared(ptr):
    """``close_shared(ptr)``: unmaps memory mapped by ``open_shared`` (once per open)."""
    if isinstance(ptr, bool) or not isinstance(ptr, int):
        raise TypeError(f"close_shared() argument 'ptr' must be int, not {type(ptr).__name__}")
    _I.close_shared(ptr)
