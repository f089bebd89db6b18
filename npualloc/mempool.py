"""torch's private memory pools over npualloc's caching allocator: ``MemPool``, ``use_mem_pool``,
``graph_pool_handle`` (``torch.cuda.MemPool`` / ``torch.cuda.use_mem_pool`` /
``torch.cuda.graph_pool_handle``), plus per-pool statistics.

Semantics (torch's, reference section 3.14):

* ``MemPool()`` creates a pool on the current device with a user id ``(0, n)``; ``graph_pool_handle()``
  draws from the same counter.  ``use_count()`` counts the references: the MemPool object, each active
  ``use_mem_pool`` and each graph captured into it (from its ``capture_begin`` until the graph goes; streams
  joining the capture take none).
* ``with use_mem_pool(pool, device=None):`` sends the calling thread's allocations on ``device`` to the
  pool (torch's beginAllocateCurrentThreadToPool / endAllocateToPool + releasePool).  Uses nest: the
  innermost pool wins.  As in torch, one recording per pool at a time: using a pool while it is
  already in use by any thread or capture fails with RuntimeError ("beginAllocateToPool: already
  recording to mempool_id").  The refused use leaves ``use_count()`` unchanged; torch's takes its
  reference before the check and never gives it back (the pool then outlives its last user).
* Memory of a pool goes back to the device only once nothing uses the pool and its blocks are free: when a
  MemPool is collected, its reference is released and ``emptyCache(pool.id)`` runs (torch's ~MemPool);
  ``empty_cache()`` releases the free memory of the pools nobody uses.  While a ``use_mem_pool`` or a
  capture is active it releases only those, and leaves the default pools and their waiting frees alone,
  as newest torch's release_cached_blocks does (torch_npu's asserts that no capture is underway).
* ``memory_snapshot(mempool_id=pool.id)`` / ``pool.snapshot()`` list the pool's segments
  (``segment_pool_id``); as in torch, ``mempool_id=(0, 0)`` lists every segment, not the default pool's.
* ``MemPool(allocator=pluggable.allocator())`` (an ``NPUPluggableAllocator``): the pool's segments come
  from the library's functions instead of the device (torch's custom-allocator pools, as used to register
  communication buffers); the caching, splitting and statistics stay the allocator's.
* ``MemPool(use_on_oom=True)`` (torch's setUseOnOOM): an allocation outside every private pool that finds
  no cached block and no room on the device for a new segment takes a free block of the marked pools
  (torch_npu's try_mempool_fallback), before any cached memory is released: pools in the order they were
  marked (torch iterates a hash set), each searched with the pool's own rules (same stream, best fit,
  oversize limits).  The block stays in the pool's segment (snapshot, per-pool stats) and its free returns
  it to the pool; the pool's ``use_count()`` is unchanged.  Never for a request already in a private pool;
  a marked pool that a capture or ``use_mem_pool`` is recording into makes such an allocation fail with
  RuntimeError "beginAllocateToPool: already recording to mempool_id", as torch's fallback enters each pool
  with beginAllocateToPool.  ``release()`` / collection clears the mark first (as ~MemPool), so a live
  block of a dropped pool is never handed out again; its segment returns once it is freed.
* ``MemPool(no_split=True)`` (torch's setNoSplit): the pool's blocks are never split, so every allocation
  takes a whole cached block or a whole new segment (a 1000-byte request holds a 2 MiB segment); rounding,
  segment sizes and torch_npu's base_addr_aligned_kb front split are unchanged.  As in torch_npu the
  setting lasts as long as the pool.

Per-pool statistics: the allocator keeps its counters per device, not per pool, so
``mempool_stats(pool)`` derives the *current* values of torch's statistics (reserved, allocated,
active, requested, inactive-split bytes; segment, allocation, active, inactive-split counts; each for
all/large/small) from the pool's segments in a snapshot, and ``mempool_summary(pool)`` prints them as
``memory_summary``'s table with its "Cur Usage" column only (no peaks or totals: those would need
per-pool counters inside the allocator).
"""
import collections
import contextlib

from . import _C
from ._locks import fork_safe_lock
from . import memory as _memory

_G = _C.graph
_M = _C.memory

__all__ = ["MemPool", "use_mem_pool", "graph_pool_handle", "mempool_stats", "mempool_summary"]


def graph_pool_handle():
    """A new pool id ``(0, n)``: torch's ``graph_pool_handle()`` (the MemPool counter)."""
    return _G.mempool_id_new(True)


def _pool_id(pool):
    if isinstance(pool, MemPool):
        return pool.id
    if isinstance(pool, tuple) and len(pool) == 2 and all(isinstance(x, int) for x in pool):
        return pool
    raise TypeError(f"expected a MemPool or a (int, int) pool id, not {type(pool).__name__}")


class MemPool:
    """A private memory pool of the current device (torch's
    ``MemPool(allocator=None, use_on_oom=False, no_split=False)``).

    ``allocator``: what an ``NPUPluggableAllocator``'s ``allocator()`` returns (or the allocator
    itself): the pool's segments then come from its alloc function (told the segment's size, the
    device and the stream) and go back through its free function, instead of from the device.
    They are plain segments, never expandable ones, as in torch; the function must return memory
    of the device (``aclrtMalloc``), or NULL when out of memory.

    ``use_on_oom``: the pool is a last resort for allocations outside every private pool.  When
    such an allocation finds no cached block and the device cannot give a new segment, it takes a
    free block of this pool (same stream, the pool's best fit) before the allocator releases any
    cached memory; the block stays the pool's (its snapshot, and its free returns it there).  Marked
    pools are tried in the order they were made; the mark goes when the pool is released.

    ``no_split``: the pool never splits a block, so each allocation takes a whole free block or a
    whole new segment (torch's no-split pools, for memory that must not be shared by two tensors).
    """

    def __init__(self, allocator=None, use_on_oom=False, no_split=False):
        use_on_oom = _memory._pybind_bool("MemPool", "use_on_oom", use_on_oom)
        no_split = _memory._pybind_bool("MemPool", "no_split", no_split)
        if isinstance(allocator, _memory._NPUAllocator):
            allocator = allocator.allocator()
        if allocator is not None and not (isinstance(allocator, tuple) and len(allocator) == 2):
            raise TypeError("MemPool(allocator=...) takes an NPUPluggableAllocator or its allocator(), not "
                            f"{type(allocator).__name__}")
        self._alive = False
        fork_safe_lock(self, "_release_lock")  # release() drops the pool's reference once, whoever calls it
        self._allocator = allocator
        self._device = _memory.current_device()
        self._gen = _M._generation()
        self._id = _G.mempool_id_new(True)
        if allocator is None:
            _G.pool_create(self._device, *self._id)
        else:
            _G.pool_create_with_allocator(self._device, *self._id, *allocator)
        self._alive = True
        # torch's MemPool: createOrIncrefPool, then setUseOnOOM, then setNoSplit
        if use_on_oom:
            _G.pool_mark_use_on_oom(self._device, *self._id)
        if no_split:
            _G.pool_set_no_split(self._device, *self._id)

    @property
    def id(self):
        """The pool id, a tuple ``(0, n)``."""
        return self._id

    @property
    def allocator(self):
        """The allocator the pool's segments come from (``None``: the device)."""
        return self._allocator

    @property
    def device(self):
        """The index of the pool's device: the current device when the pool was created."""
        return self._device

    def _live(self):
        return self._alive and self._gen == _M._generation()

    def use_count(self):
        """References held on the pool: this object, active use_mem_pool contexts, captures."""
        return _G.pool_use_count(self._device, *self._id) if self._gen == _M._generation() else 0

    def snapshot(self, include_traces=True):
        """``memory_snapshot(mempool_id=self.id, include_traces=include_traces)``: the pool's segments."""
        return _memory.memory_snapshot(mempool_id=self._id, include_traces=include_traces)

    def memory_stats(self):
        """``mempool_stats(self)``."""
        return mempool_stats(self, self._device)

    def memory_summary(self):
        """``mempool_summary(self)``."""
        return mempool_summary(self, self._device)

    def release(self):
        """What collection does (torch's ~MemPool): setUseOnOOM(False), releasePool, then
        emptyCache(self.id)."""
        lock = getattr(self, "_release_lock", None)
        if lock is None:  # (an __init__ that raised before making it: nothing was created)
            return
        with lock:
            live = self._live()
            self._alive = False
        if not live:
            return
        _G.pool_clear_use_on_oom(self._device, *self._id)
        _G.pool_release(self._device, *self._id)
        _G.pool_empty(self._device, *self._id)

    def __del__(self):
        try:
            self.release()
        except Exception:
            pass

    def __repr__(self):
        return f"<npualloc.MemPool id={self._id} device=npu:{self._device}>"


@contextlib.contextmanager
def use_mem_pool(pool, device=None):
    """Routes the calling thread's allocations on ``device`` (default: the current one) to ``pool``."""
    device_index = _memory.current_device() if device is None else _memory._get_device_index(device)
    pid = _pool_id(pool)
    _G.pool_begin_thread(device_index, *pid)
    try:
        yield
    finally:
        _G.pool_end(device_index, *pid)  # (npualloc's endAllocateToPool also releases the reference)


_METRICS = ("allocated_bytes", "active_bytes", "reserved_bytes", "requested_bytes", "inactive_split_bytes",
            "allocation", "active", "segment", "inactive_split")
_POOLS = ("all", "large_pool", "small_pool")


def mempool_stats(pool, device=None):
    """The current values of torch's statistics for one private pool, from a snapshot: an OrderedDict
    ``{"<metric>.<all|large_pool|small_pool>.current": int}`` (``device`` None: every device)."""
    pid = _pool_id(pool)
    if device is not None:
        device = _memory._get_device_index(device)
        if device < 0 or device >= _memory.device_count():  # memory_stats' error, not a table of zeros
            raise RuntimeError(f"Invalid device argument {device}: did you call init?")
    counts = {m: dict.fromkeys(_POOLS, 0) for m in _METRICS}

    def add(metric, kind, n):
        counts[metric]["all"] += n
        counts[metric][kind] += n

    for seg in _memory._pool_segments(pid):
        if device is not None and seg["device"] != device:
            continue
        kind = "small_pool" if seg["segment_type"] == "small" else "large_pool"
        expandable = seg.get("is_expandable", False)
        add("reserved_bytes", kind, seg["total_size"])
        if not expandable:      # torch counts no segments and no inactive splits in expandable ones
            add("segment", kind, 1)
        blocks = seg["blocks"]
        for b in blocks:
            if b["state"] == "active_allocated":
                add("allocation", kind, 1)
                add("allocated_bytes", kind, b["size"])
            if b["state"] != "inactive":   # a pending free still counts as active and requested, as in torch
                add("active", kind, 1)
                add("active_bytes", kind, b["size"])
                add("requested_bytes", kind, b["requested_size"])
            elif len(blocks) > 1 and not expandable:
                add("inactive_split", kind, 1)
                add("inactive_split_bytes", kind, b["size"])
    flat = [(f"{m}.{p}.current", v) for m, per in counts.items() for p, v in per.items()]
    flat.sort()
    return collections.OrderedDict(flat)


def mempool_summary(pool, device=None, abbreviated=False):
    """``memory_summary``'s table for one private pool, current usage only."""
    pid = _pool_id(pool)
    stats = mempool_stats(pid, device)
    rows = [("allocated_bytes", "Allocated memory", _memory._format_size),
            ("active_bytes", "Active memory", _memory._format_size),
            ("requested_bytes", "Requested memory", _memory._format_size),
            ("reserved_bytes", "NPU reserved memory", _memory._format_size),
            ("inactive_split_bytes", "Non-releasable memory", _memory._format_size),
            ("allocation", "Allocations", _memory._format_count),
            ("active", "Active allocs", _memory._format_count),
            ("segment", "NPU reserved segments", _memory._format_count),
            ("inactive_split", "Non-releasable allocs", _memory._format_count)]
    where = "all devices" if device is None else f"device ID {_memory._get_device_index(device)}"
    title = f"private pool {pid} memory summary, {where}"
    lines = ["=" * 75, f" {title:^73} ", "=" * 75, f" {'Metric':^21} | {'Cur Usage':^10} {'':39}"]
    for key, name, fmt in rows:
        lines.append("-" * 75)
        subs = [("all", name)]
        if not abbreviated:
            subs += [("large_pool", "      from large pool"), ("small_pool", "      from small pool")]
        pref = stats[f"{key}.all.current"]
        for sub, label in subs:
            lines.append(f" {label:<21} | {fmt(stats[f'{key}.{sub}.current'], pref)} {'':39}")
    lines.append("=" * 75)
    return "|" + "|\n|".join(lines) + "|\n"
