"""Captured graphs with planned memory (CUDA graph memory nodes; seed 003).  The model and its limits are
described in ``csrc/include/npualloc_graph.h``; in short::

    import npualloc
    from npualloc import acl

    n = 1 << 20
    s = npualloc.Stream()
    g = npualloc.Graph()                    # Graph(checked=True) detects use outside lifetimes
    with g.capture(stream=s):               # s (current in the block) records instead of running; capture()
                                            # alone captures the current stream
        a = npualloc.caching_allocator_alloc(n)          # an ALLOC node: a graph address
        acl.rt.memset_async(a, n, 1, n, s.npu_stream)    # a MEMSET node
        npualloc.caching_allocator_delete(a)             # a FREE node
    exe = g.instantiate()
    plan = exe.memory_plan()                # {"allocations": [(offset, size, node)], "footprint", "lower_bound", ...}
    exe.launch(s)                           # maps s's shared pages behind the graph's range, queues the nodes on s
    s.synchronize()

* Addresses are assigned at capture: an allocation takes the range of an earlier one only when that one's
  FREE is an ancestor of its ALLOC in the graph (stream order and event waits), best fit.  So the pointer a
  capture hands out is the one every launch uses, and host callbacks may carry it.
* Streams join a capture by waiting for an event recorded on a capturing stream (``Stream.wait_stream``),
  and must be joined back before the capture ends.
* Graphs launched on one stream map the same physical pages (each at its own addresses); graphs on
  different streams never share pages.  Allocations not freed in the graph are its outputs: they get
  pages of their own and keep their data until the next launch.  Freeing an output after the capture
  does nothing (the memory goes with the graph), so free graph Buffers before dropping the graph.
* ``Graph(checked=True)``: a copy or memset at capture touching graph memory outside a live allocation
  fails with ACL_ERROR_RT_PARAM_INVALID (the call's ret code) and is recorded, as is a FREE not ordered
  after every use; ``instantiate()`` then raises :class:`GraphMemoryError`.  After a launch,
  ``acl.rt.memcpy``/``memset`` (and the async forms on ordinary streams) on the graph's range outside its
  outputs return ACL_ERROR_RT_PARAM_INVALID and are recorded in ``violations()``.
* Multi-device access: ``capture(access=[1, 2])`` lets devices 1 and 2 access the capture's allocations;
  without it, the device's setting (``set_graph_mem_access``) when each allocation is captured applies.
  Changing the setting later does not change captured allocations.  Peer access enablement does not
  apply to graph memory.
* ``capture(pool=MemPool or graph_pool_handle())``: torch-style capture instead, allocations come from the
  private pool at real addresses (no plan); several captures may share a pool one after another, but
  as in torch only one may record into it at a time (a second ``capture(pool=)`` or ``use_mem_pool``
  on that pool meanwhile raises RuntimeError "beginAllocateToPool: already recording to mempool_id");
  streams that join the capture allocate from its pool.  ``pool=(0, 0)`` is torch_npu's "no pool": the
  capture gets a private pool of its own, id ``(n, 0)``.  As in torch_npu, such a capture refuses the default stream
  (RuntimeError "NPU graphs must be captured on a non-default stream. ...").  A graph is captured once:
  a second ``capture_begin`` raises RuntimeError "This NPUGraph instance already owns a captured graph.
  ..." until ``reset()``.  After the capture, ``g.pool()`` is that pool's id (torch's
  ``NPUGraph.pool()``; RuntimeError "Called NPUGraph::pool() without a preceding successful capture."
  before), and ``g.reset()`` drops the captured graph and its executables and gives the pool's reference
  back, after which ``g`` may be captured again.
* ``capture(capture_error_mode=...)`` (torch_npu's argument, also on ``capture_begin``): ``"global"`` (the
  default), ``"thread_local"`` or ``"relaxed"``, CANN's aclmdlRICaptureMode.  While the capture is underway,
  the unsafe calls CANN lists that npualloc has, ``acl.rt.memcpy``, ``acl.rt.memcpy2d`` and ``acl.rt.memset``, return
  ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT on the capture's device: in every thread ("global"), in the thread that
  began the capture ("thread_local"), or never ("relaxed"); the capture goes on.  Another string raises
  RuntimeError "Unknown capture error mode. Expected `global`, `thread_local`, or `relaxed`, got ..." (torch_npu's
  words), another type TypeError.  ``acl.rt.memcpy_async`` of pageable host memory (not ``acl.rt.malloc_host``
  memory) is a synchronous copy, as on CANN: refused by the same rule (ACL_ERROR_RT_CAPTURE_MODE_BLOCK_ASYNC),
  and on the capturing stream always (ACL_ERROR_RT_STREAM_CAPTURED), so captured copies use pinned memory.
  The caching allocator makes no such call: a capture never blocks it.
  ``memory_plan()["capture_error_mode"]`` tells the mode afterwards.
* Cost: placing an allocation scans the allocations that may be live with it, so a capture costs time in
  proportion to allocations times those live at once: the 7095 allocations of the cs336 trace capture in a
  fraction of a second, but 40,000 allocations all live at once took about 4 s (2026-11-27, 10,000: 0.4 s).
"""
import contextlib
import weakref

from . import _C
from . import acl as _acl
from . import memory as _memory
from . import streams as _streams
from ._locks import fork_safe_lock
from .mempool import _pool_id

_G = _C.graph

GraphMemoryError = _G.GraphMemoryError

__all__ = ["Graph", "GraphExec", "GraphMemoryError", "set_graph_mem_access", "get_graph_mem_access",
           "is_current_stream_capturing"]


def _device_mask(devices):
    # a string is one device, not a list of them (its characters were read as devices)
    if isinstance(devices, (str, bytes)) or not hasattr(devices, "__iter__"):
        raise TypeError(f"access must be a list of devices, not {type(devices).__name__}")
    mask = 0
    for d in devices:
        idx = _memory._get_device_index(d)
        if not 0 <= idx < 64:
            raise ValueError(f"invalid device {d!r}")
        mask |= 1 << idx
    return mask


def _mask_devices(mask):
    return [d for d in range(64) if (mask >> d) & 1]


# torch_npu's capture_error_mode strings -> CANN's aclmdlRICaptureMode values
_CAPTURE_MODES = {"global": _acl.ACL_MODEL_RI_CAPTURE_MODE_GLOBAL,
                  "thread_local": _acl.ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL,
                  "relaxed": _acl.ACL_MODEL_RI_CAPTURE_MODE_RELAXED}
_MODE_NAMES = {v: k for k, v in _CAPTURE_MODES.items()}


def _capture_mode(capture_error_mode):
    if not isinstance(capture_error_mode, str):
        raise TypeError(f"capture_error_mode must be a str, not {type(capture_error_mode).__name__}")
    mode = _CAPTURE_MODES.get(capture_error_mode)
    if mode is None:  # torch_npu's check and words (its binding raises them as RuntimeError)
        raise RuntimeError("Unknown capture error mode. Expected `global`, `thread_local`, or `relaxed`, got "
                           + capture_error_mode)
    return mode


def _as_stream(stream):
    if stream is None:
        return _streams.current_stream()
    if isinstance(stream, _streams.Stream):
        return stream
    raise TypeError(f"stream must be an npualloc.Stream or None, not {type(stream).__name__}")


def set_graph_mem_access(device, devices):
    """The devices that may access graph memory of ``device`` allocated in later captures (the device itself
    always may): like ``cudaMemPoolSetAccess`` on the device's graph memory pool."""
    _G.set_mem_access(_memory._get_device_index(device), _device_mask(devices))


def get_graph_mem_access(device=None):
    """The devices that may access graph memory of ``device`` captured from now on."""
    return _mask_devices(_G.get_mem_access(_memory._get_device_index(device, optional=True)))


def is_current_stream_capturing():
    """True when the current stream is in capture mode (torch's ``is_current_stream_capturing``)."""
    s = _streams.current_stream()
    return _G.capture_status(s.npu_stream, s.device)


class Graph:
    """A graph captured from streams.  ``checked=True`` detects uses of graph memory outside an
    allocation's lifetime (see the module docstring)."""

    def __init__(self, checked=False):
        self._g = _G.Graph(bool(checked))
        self.checked = bool(checked)
        self._exec = None   # weak reference to the executable graph instantiate() returned
        self._owned = None  # the C executable launch() made (the graph keeps it, like torch's replay); not a
                            # GraphExec, which points back at the graph: that cycle would keep the memory
                            # mapped until the cycle collector ran
        self._capture_pool = None  # the pool capture_begin routed to (None: planned memory)
        self._capturing = False    # between capture_begin and capture_end
        self._begins = 0           # capture_begin calls in flight (reset() leaves the graph alone meanwhile)
        # one executable at a time: threads launching first make one.  It also guards _g, _exec, _owned and
        # _captured against reset() and capture_end() in another thread, so launch() sees them together.
        fork_safe_lock(self, "_exec_lock")
        self._captured = False     # capture_end succeeded: pool() answers
        self._resets = 0           # reset() calls: an executable of an earlier capture has no plan here

    # ---- capture ----
    def capture_begin(self, stream=None, access=None, pool=None, capture_error_mode="global"):
        """Starts capturing ``stream`` (default: the current stream).  ``access``: devices that may access the
        allocations (default: the device's ``set_graph_mem_access`` setting at each allocation).  ``pool``:
        capture torch-style into a private pool instead (a MemPool or an id).  ``capture_error_mode``: which
        unsafe calls the capture refuses (see the module docstring), checked first as torch_npu does."""
        mode = _capture_mode(capture_error_mode)
        if self._captured:  # torch_npu's check and words; reset() makes the graph capturable again
            raise RuntimeError("This NPUGraph instance already owns a captured graph. "
                               "To capture a new graph, create a new instance.")
        s = _as_stream(stream)
        mask = None if access is None else _device_mask(access)
        pid = None if pool is None else _pool_id(pool)
        if pid == (0, 0):  # torch_npu: no pool given, the capture gets a private pool of its own
            pid = _G.mempool_id_new(False)
        if pid is not None and mask is not None:
            raise ValueError("access applies to planned graph memory, not to a pool capture")
        if pid is not None and self.checked:  # pool memory is the cache's, at real addresses: nothing to check
            raise ValueError("checked applies to planned graph memory, not to a pool capture")
        if pid is not None and s.npu_stream == 0:  # torch_npu refuses a torch-style capture there
            raise RuntimeError("NPU graphs must be captured on a non-default stream. "
                               "(However, after capture, it's ok to replay them on the default stream.)")
        # counted from before the call: a reset() meanwhile in another thread leaves the graph alone (it
        # replaced the graph being begun, whose capture then ended with it)
        with self._exec_lock:
            g = self._g
            self._begins += 1
        began = False
        try:
            g.capture_begin(s.npu_stream, s.device, mask, pid, mode)
            began = True
        finally:
            with self._exec_lock:
                self._begins -= 1
                if began:
                    self._capturing = True
                    self._capture_pool = pid
        return s

    def capture_end(self):
        """Ends the capture; every stream that joined it leaves capture mode."""
        try:
            self._g.capture_end()
        except BaseException:
            with self._exec_lock:
                self._capturing = False  # a capture_end that fails ends the capture broken
            raise
        with self._exec_lock:
            self._capturing = False
            self._captured = True

    def pool(self):
        """The id of the private pool a successful ``capture(pool=...)`` allocated from (torch's
        ``NPUGraph.pool()``), to pass to another capture that shares it.  RuntimeError before a successful
        capture, and for a capture with planned memory, which has no private pool."""
        if not self._captured:
            raise RuntimeError("Called NPUGraph::pool() without a preceding successful capture.")
        if self._capture_pool is None:
            raise RuntimeError("pool(): the graph was captured with planned memory, not into a private pool")
        return self._capture_pool

    @contextlib.contextmanager
    def capture(self, stream=None, access=None, pool=None, capture_error_mode="global"):
        """``with g.capture(stream=None, access=None, pool=None, capture_error_mode="global"):`` captures the
        block; the capturing stream is the current stream inside it."""
        s = self.capture_begin(stream, access, pool, capture_error_mode)
        try:
            with _streams.stream(s):
                yield self
        except BaseException:
            try:
                self.capture_end()  # as torch's graph.__exit__: a capture that ends well is captured
            except RuntimeError:
                pass
            raise
        self.capture_end()

    # ---- execution ----
    def instantiate(self):
        """The executable graph (one at a time; after ``launch()`` or ``replay()`` made one, that one, now
        yours); raises GraphMemoryError for a checked graph whose capture recorded a violation."""
        with self._exec_lock:
            owned, self._owned = self._owned, None
            exe = GraphExec(self, owned if owned is not None and not owned.destroyed else self._g.instantiate())
            self._exec = weakref.ref(exe)
        return exe

    def launch(self, stream=None):
        """Launches on ``stream`` (default: the current stream) the executable graph instantiate() returned if
        it is still alive, else one the graph instantiates on first use and keeps.  RuntimeError (torch_npu's
        words) before a successful capture."""
        # Read together under the lock: a reset() and a new capture in another thread meanwhile must not
        # make this launch instantiate the graph of that later capture (maybe not yet captured).
        with self._exec_lock:
            if not self._captured:
                raise RuntimeError("Called NPUGraph::replay without a preceding successful capture.")
            exe = self._exec() if self._exec is not None else None
            if exe is None or exe.destroyed:
                exe = None
                if self._owned is None or self._owned.destroyed:
                    self._owned = self._g.instantiate()
                owned = self._owned
        if exe is not None:
            exe.launch(stream)
            return
        s = _as_stream(stream)
        owned.launch(s.npu_stream, s.device)

    replay = launch

    def reset(self):
        """torch's ``NPUGraph.reset()``: destroys the executable graphs and drops what was captured, giving
        back the graph's reference to its private pool (whose free memory ``empty_cache()`` then returns once
        nothing else uses the pool); the graph may then be captured again.  Free the graph's allocations
        first: an allocation still live after the reset keeps its pool's segment.  During a capture it does
        nothing, and the capture goes on.  torch_npu's there gives nothing back either (it releases the pool
        and the graph only once a capture ended), but forgets the capture, so that its capture_end then
        fails and leaves the stream capturing; npualloc keeps the capture whole instead."""
        new = _G.Graph(self.checked)
        with self._exec_lock:  # launch() in another thread sees the old capture or the new graph, never a mix
            if self._capturing or self._begins:
                return
            exe = self._exec() if self._exec is not None else None
            owned, old = self._owned, self._g
            self._exec = self._owned = None
            self._g = new
            self._capture_pool = None
            self._captured = False
            self._resets += 1
        for e in (exe, owned):  # (outside the lock: destroy waits for their launches)
            if e is not None:
                e.destroy()
        del old  # the old graph goes now: its executables no longer hold it

    # ---- introspection ----
    def nodes(self):
        """The nodes in capture order: dicts with index, kind (alloc, free, memcpy, memset, host, delay, task),
        stream (capture stream index), deps, and alloc / dst, src, value, count."""
        return self._g.nodes()

    def allocations(self):
        """The allocations: index, address, offset, size (rounded to 512), requested, alloc_node, free_node
        (None: an output), access (devices)."""
        return self._g.allocations()

    def streams(self):
        """(handle, device) of each capture stream, by index (the origin first)."""
        return self._g.streams()

    def violations(self):
        """What a checked graph detected (messages)."""
        return self._g.violations()

    def memory_plan(self):
        """The plan: ``allocations`` [(offset, size, alloc node)], ``footprint`` (bytes of the range in use),
        ``lower_bound`` (a set of allocations that pairwise may be live together: no plan needs less),
        ``ratio``, ``mapped`` (bytes mapped at launch), ``base``, ``output_bytes``, ``details`` (allocations()),
        ``capture_error_mode`` (the capture's mode)."""
        plan = self._g.plan()
        plan["capture_error_mode"] = _MODE_NAMES[plan.pop("capture_mode")]
        details = self._g.allocations()
        plan["allocations"] = [(a["offset"], a["size"], a["alloc_node"]) for a in details]
        plan["details"] = details
        plan["ratio"] = plan["footprint"] / plan["lower_bound"] if plan["lower_bound"] else 1.0
        return plan

    def __repr__(self):
        return f"<npualloc.Graph checked={self.checked}>"


class GraphExec:
    """An executable graph: ``launch(stream=None)``, ``memory_plan()``, ``destroy()`` (waits for its launches,
    unmaps its memory; also done when collected)."""

    def __init__(self, graph, cexec):
        self.graph = graph
        self._e = cexec
        self._capture = graph._resets  # which of the graph's captures it runs

    @property
    def destroyed(self):
        """True once destroy() (or leaving ``with exe:``) released it: it can no longer be launched."""
        return self._e.destroyed

    def launch(self, stream=None):
        """Runs the graph on ``stream`` (default: the current stream; ``replay`` is the same method, torch's
        ``CUDAGraph.replay``): maps the stream's shared pages behind the graph's address range (after waiting
        for its launches on another stream, if any) and queues the nodes on the stream in capture order, then
        returns without waiting for them.  RuntimeError once destroyed or if the launch fails, and from a
        callback of the stream it was launched on last, with that launch still queued behind the callback,
        when ``stream`` is another stream (it could not wait for that launch)."""
        s = _as_stream(stream)
        self._e.launch(s.npu_stream, s.device)

    replay = launch

    def memory_plan(self):
        """The memory plan of the graph it was instantiated from: :meth:`Graph.memory_plan` (a dict;
        sizes and offsets in bytes).  RuntimeError once that graph was reset: its plan went with the capture
        (the graph's plan is then another capture's)."""
        if self.graph._resets != self._capture:
            raise RuntimeError("memory_plan(): the graph this was instantiated from was reset since; its plan "
                               "went with that capture")
        return self.graph.memory_plan()

    def destroy(self):
        """Waits for the graph's launches, unmaps its memory and frees it (also done when it is collected);
        calling it again does nothing.  From a stream's callback, which cannot wait for launches queued
        behind it, it returns at once and a thread of its own waits and frees."""
        self._e.destroy()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()

    def __repr__(self):
        return f"<npualloc.GraphExec of {self.graph!r}{' destroyed' if self.destroyed else ''}>"

