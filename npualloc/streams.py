"""Streams and events in the shape of ``torch_npu.npu.Stream`` / ``Event`` over npualloc's runtime.

A Stream is an aclrt stream of one device (``npu_stream`` is its handle, 0 for a device's
default stream).  Each thread has a current stream per device (kept in C, so that
``caching_allocator_alloc`` reads it without Python work); ``stream(s)`` and ``set_stream(s)``
change it, ``current_stream()`` reads it.
"""
import operator
import threading

from . import _C
from ._locks import fork_safe_lock
from . import memory as _memory

_M = _C.memory

__all__ = ["Stream", "Event", "StreamContext", "stream", "set_stream", "current_stream", "default_stream"]

# Keeps the Stream objects that are current on this thread alive (the C table holds handles only).
_tls = threading.local()


def _device_index(device):
    """The index of ``device``: None and -1 are the current device, as torch_npu's stream calls take them."""
    index = _memory._get_device_index(device, optional=True)
    return _memory.current_device() if index == -1 else index


def _checked_device_index(device):
    """_device_index, refused out of range as torch_npu's getCurrentNPUStream refuses it (check_npu)."""
    index = _device_index(device)
    count = _memory.device_count()
    if not 0 <= index < count:
        raise RuntimeError(f"Invalid device_index : {index}, valid device_index range is [0, {count})"
                           + _memory._pta_error("VALUE"))
    return index


class Stream:
    """An NPU stream: ``Stream(device=None, priority=0)`` creates a new stream on ``device``
    (default: the current device).  It is destroyed (after its queued work) when collected."""

    def __init__(self, device=None, priority=0):
        dev = _device_index(device)
        self.priority = operator.index(priority)  # torch_npu's stream constructor takes an int (TypeError else)
        self._device = dev
        self._gen = _M._generation()
        self._owned = False
        self.npu_stream = _M._stream_create(dev)
        self._owned = True

    @classmethod
    def _wrap(cls, handle, device):
        """A Stream object for an existing handle (not destroyed when collected)."""
        s = cls.__new__(cls)
        s.priority = 0
        s._device = device
        s._gen = _M._generation()
        s._owned = False
        s.npu_stream = handle
        return s

    @property
    def device(self):
        """The device index."""
        return self._device

    @property
    def device_index(self):
        """The device index, as ``device`` (torch_npu's Stream has both; its ``device`` is a torch.device)."""
        return self._device

    def synchronize(self):
        """Waits for everything queued on the stream."""
        _M._stream_synchronize(self.npu_stream, self._device)

    def query(self):
        """True if everything queued so far has run.  A stream of a runtime that ended (a fork or
        ``npualloc.testing.restart()`` since it was made) raises RuntimeError, as every use of it does."""
        return _M._stream_query(self.npu_stream, self._device)

    def wait_event(self, event):
        """Work queued on this stream from now on waits for ``event`` (nothing to wait for when it was never
        recorded, as torch_npu's ``block``)."""
        if event.npu_event:
            with event._lock:
                handle = event._ensure()
            _M._stream_wait_event(self.npu_stream, self._device, handle)

    def wait_stream(self, stream):
        """Work queued on this stream from now on waits for the work queued so far on ``stream``."""
        self.wait_event(stream.record_event())

    def record_event(self, event=None):
        """Records ``event`` (a new Event if None) on this stream and returns it."""
        if event is None:
            event = Event()
        event.record(self)
        return event

    def __eq__(self, other):
        if isinstance(other, Stream):
            return self.npu_stream == other.npu_stream and self._device == other._device
        return NotImplemented

    def __hash__(self):
        return hash((self.npu_stream, self._device))

    def __repr__(self):
        return f"<npualloc.Stream device=npu:{self._device} npu_stream={self.npu_stream:#x}>"

    def __del__(self):
        if getattr(self, "_owned", False):
            self._owned = False
            try:
                if _M._in_stream_task():
                    # Collected by a stream's task or callback (one holding the last reference): the destroy
                    # waits for this stream's queued work, which may wait for the caller (this very stream,
                    # or a stream it waits for behind the caller), so another thread does it.
                    threading.Thread(target=_M._stream_destroy, args=(self.npu_stream, self._gen),
                                     name="npualloc-stream-destroy", daemon=True).start()
                else:
                    _M._stream_destroy(self.npu_stream, self._gen)
            except Exception:
                pass


class Event:
    """An NPU event: ``record(stream)`` marks the point after the work queued so far on the stream.

    Like a Stream, an event recorded in a runtime that ended (a fork or ``npualloc.testing.restart()``
    since) is stale: using its record (``query``, ``synchronize``, ``wait``, ``elapsed_time``) raises
    RuntimeError with the ACL error code, and only a new ``record`` makes it usable again.
    """

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        # torch_npu's event constructor takes these as C integers: another type is a TypeError
        self.enable_timing = bool(operator.index(enable_timing))
        self.blocking = bool(operator.index(blocking))
        self.interprocess = bool(operator.index(interprocess))
        self._handle = 0
        self._gen = 0
        self._recorded = False  # the handle carries a record (which a restart or fork makes stale)
        self._device = None     # the device of the stream it was first recorded on (torch_npu's device_index_)
        # two threads recording a new event make one handle, and both records land
        fork_safe_lock(self, "_lock")

    def _ensure(self, renew=False):
        """The handle, created on first use.  A stale one is replaced when it carries no record, or with
        ``renew`` (a record, which starts the event afresh); a stale record is returned as it is, and the
        runtime refuses it (INVALID_PARAM) as it refuses a stale stream."""
        gen = _M._generation()
        if not self._handle or (self._gen != gen and (renew or not self._recorded)):
            self._handle = _M._event_create()
            self._gen = gen
            self._recorded = False
        return self._handle

    @property
    def npu_event(self):
        """The aclrt event handle (an int); 0 until the event is first recorded, since it is created then, as
        torch creates its events lazily."""
        return self._handle

    def record(self, stream=None):
        """Records the event on ``stream`` (default: the current stream).  The event belongs to the device of
        the stream it was first recorded on: a stream of another device is torch_npu's RuntimeError."""
        if stream is None:
            stream = current_stream()
        with self._lock:
            fresh = not self._handle or self._gen != _M._generation()  # a new handle: the stream's device is its
            if not fresh and self._device is not None and self._device != stream.device:
                raise RuntimeError(f"Event device {self._device} does not match recording stream's device "
                                   f"{stream.device}." + _memory._pta_error("PARAM"))
            _M._event_record(stream.npu_stream, stream.device, self._ensure(renew=True))
            self._recorded = True
            self._device = stream.device

    def wait(self, stream=None):
        """Makes ``stream`` (default: the current stream) wait for the event."""
        if stream is None:
            stream = current_stream()
        stream.wait_event(self)

    def query(self):
        """True once the recorded work has run (True for an event never recorded)."""
        if not self._recorded:
            return True
        return _M._event_query(self._handle)

    def synchronize(self):
        """Waits until the recorded work has run."""
        if self._recorded:
            _M._event_synchronize(self._handle)

    def elapsed_time(self, end_event):
        """Milliseconds between this event and ``end_event`` (both recorded, both with timing).  Waits for
        both first, as torch_npu does."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'."
                               + _memory._pta_error("PARAM"))
        if not (self._recorded and end_event._recorded):
            raise RuntimeError("Both events must be recorded before calculating elapsed time."
                               + _memory._pta_error("INTERNAL"))
        _M._event_synchronize(self._handle)
        _M._event_synchronize(end_event._handle)
        return _M._event_elapsed(self._handle, end_event._handle)

    def __repr__(self):
        return f"<npualloc.Event {self._handle:#x}>" if self._handle else "<npualloc.Event uninitialized>"

    def __del__(self):
        handle, self._handle = getattr(self, "_handle", 0), 0
        if handle:
            try:
                _M._event_destroy(handle, self._gen)
            except Exception:
                pass


def _current_objects():
    objs = getattr(_tls, "streams", None)
    if objs is None:
        objs = _tls.streams = {}
    return objs


def default_stream(device=None):
    """The default stream of ``device`` (handle 0; None or -1: the current device)."""
    return Stream._wrap(0, _checked_device_index(device))


def current_stream(device=None):
    """The calling thread's current stream on ``device`` (None or -1: the current device); a device out of
    range is torch_npu's RuntimeError "Invalid device_index : N, valid device_index range is [0, COUNT)"."""
    dev = _checked_device_index(device)
    handle = _M._get_current_stream(dev)
    obj = _current_objects().get(dev)
    if obj is not None and obj.npu_stream == handle and obj._gen == _M._generation():
        return obj
    return Stream._wrap(handle, dev)


def set_stream(stream):
    """Makes ``stream`` the current stream of its device and that device current (None: nothing)."""
    if stream is None:
        return
    _M._set_device(stream.device)
    _M._set_current_stream(stream.device, stream.npu_stream)
    objs = _current_objects()
    if stream.npu_stream == 0:
        objs.pop(stream.device, None)
    else:
        objs[stream.device] = stream


class StreamContext:
    """Context manager behind ``stream(s)`` (torch's StreamContext)."""

    def __init__(self, stream):
        self.stream = stream
        self.src_prev_stream = None
        self.dst_prev_stream = None

    def __enter__(self):
        cur = self.stream
        if cur is None:
            return
        self.src_prev_stream = current_stream(None)
        if self.src_prev_stream.device != cur.device:
            self.dst_prev_stream = current_stream(cur.device)
        set_stream(cur)

    def __exit__(self, exc_type, exc, tb):
        cur = self.stream
        if cur is None:
            return
        if self.src_prev_stream.device != cur.device:
            set_stream(self.dst_prev_stream)
        set_stream(self.src_prev_stream)


def stream(stream):
    """``with stream(s):`` makes ``s`` current (and its device) inside the block; None does nothing."""
    return StreamContext(stream)


_M._set_stream_type(Stream)
