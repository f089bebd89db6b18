"""Private memory pools: MemPool, use_mem_pool, graph_pool_handle, per-pool snapshots and statistics
(torch's semantics, reference section 3.14)."""
import gc
import threading
import time

import pytest

import npualloc
from conftest_memory import MiB, block_of, check_all, mem, segment_of  # noqa: F401

alloc = npualloc.caching_allocator_alloc
free = npualloc.caching_allocator_delete

DEFAULT = (0, 0)


def pool_of(ptr):
    return segment_of(ptr)["segment_pool_id"]


def test_ids_share_one_counter_with_graph_pool_handle(mem):
    a = npualloc.MemPool()
    h = npualloc.graph_pool_handle()
    b = npualloc.MemPool()
    assert a.id[0] == 0 and h[0] == 0 and b.id[0] == 0
    assert h[1] == a.id[1] + 1 and b.id[1] == h[1] + 1
    assert isinstance(a.id, tuple) and a.allocator is None and a.device == 0
    with pytest.raises(TypeError, match="NPUPluggableAllocator"):
        npualloc.MemPool(allocator=object())  # pools with a pluggable allocator: tests/test_pluggable.py
    # torch's binding takes bools as pybind11 does: numbers and None by their truth, not strings
    for bad in ("yes", [], object()):
        with pytest.raises(TypeError, match="argument .use_on_oom. must be bool"):
            npualloc.MemPool(use_on_oom=bad)
        with pytest.raises(TypeError, match="argument .no_split. must be bool"):
            npualloc.MemPool(no_split=bad)
    flagged = npualloc.MemPool(None, 1, None)  # torch's order: allocator, use_on_oom, no_split
    assert flagged.use_count() == 1


def test_use_count_and_routing_of_this_thread_only(mem):
    pool = npualloc.MemPool()
    assert pool.use_count() == 1
    other = {}

    def elsewhere():
        other["ptr"] = alloc(1000)

    with npualloc.use_mem_pool(pool):
        assert pool.use_count() == 2
        small, large = alloc(1000), alloc(30 * MiB)
        t = threading.Thread(target=elsewhere)
        t.start()
        t.join()
    assert pool.use_count() == 1
    after = alloc(1000)
    assert pool_of(small) == pool.id and pool_of(large) == pool.id
    assert pool_of(other["ptr"]) == DEFAULT and pool_of(after) == DEFAULT
    # snapshot() / memory_snapshot(mempool_id=) list the pool's segments only
    segs = pool.snapshot()
    assert {s["segment_pool_id"] for s in segs} == {pool.id}
    assert sorted(s["segment_type"] for s in segs) == ["large", "small"]
    assert segs == npualloc.memory_snapshot(mempool_id=pool.id)
    # torch: (0, 0) is no filter, every pool's segments
    assert npualloc.memory_snapshot(mempool_id=DEFAULT) == npualloc.memory_snapshot()
    for p in (small, large, other["ptr"], after):
        free(p)
    check_all()


def test_nested_pools_innermost_wins(mem):
    p1, p2 = npualloc.MemPool(), npualloc.MemPool()
    with npualloc.use_mem_pool(p1):
        a = alloc(1000)
        with npualloc.use_mem_pool(p2):
            b = alloc(1000)
            assert p1.use_count() == 2 and p2.use_count() == 2
        c = alloc(1000)
    assert (pool_of(a), pool_of(b), pool_of(c)) == (p1.id, p2.id, p1.id)
    # the same pool inside itself: torch's error
    with npualloc.use_mem_pool(p1):
        with pytest.raises(RuntimeError, match="already recording to mempool_id"):
            with npualloc.use_mem_pool(p1):
                pass
    assert p1.use_count() == 1
    for p in (a, b, c):
        free(p)


def test_one_thread_at_a_time_records_into_a_pool(mem):
    """torch's beginAllocateToPool refuses a second recording into a pool whatever its filter: the
    second thread's use_mem_pool raises, and the use count stays as it was."""
    pool = npualloc.MemPool()
    entered, release = threading.Event(), threading.Event()
    result = {}

    def first():
        with npualloc.use_mem_pool(pool):
            result["ptr"] = alloc(1000)
            entered.set()
            release.wait(10)

    t = threading.Thread(target=first)
    t.start()
    assert entered.wait(10)
    try:
        assert pool.use_count() == 2
        with pytest.raises(RuntimeError, match="beginAllocateToPool: already recording to mempool_id"):
            with npualloc.use_mem_pool(pool):
                pass
        assert pool.use_count() == 2
        # nor may a capture record into it meanwhile
        g = npualloc.Graph()
        with pytest.raises(RuntimeError, match="^beginAllocateToPool: already recording to mempool_id$"):
            g.capture_begin(npualloc.Stream(), pool=pool)  # torch's words alone
        assert pool.use_count() == 2
        mine = alloc(1000)  # this thread was not routed
        assert pool_of(mine) == DEFAULT
    finally:
        release.set()
        t.join()
    assert pool_of(result["ptr"]) == pool.id and pool.use_count() == 1
    with npualloc.use_mem_pool(pool):  # free again once the other thread is done
        again = alloc(1000)
    assert pool_of(again) == pool.id
    for p in (mine, result["ptr"], again):
        free(p)
    check_all()


def test_use_mem_pool_on_another_device(mem):
    pool = npualloc.MemPool()
    with npualloc.use_mem_pool(pool, device=1):
        x = alloc(1000, device=1)
        y = alloc(1000, device=0)
    assert pool_of(x) == pool.id and pool_of(y) == DEFAULT
    free(x)
    free(y)
    npualloc.empty_cache()  # the device-1 pool had no holder left: it is gone
    assert npualloc.memory_snapshot(mempool_id=pool.id) == []


def test_memory_returns_when_the_pool_goes(mem):
    pool = npualloc.MemPool()
    with npualloc.use_mem_pool(pool):
        x = alloc(30 * MiB)
    y = alloc(30 * MiB)
    free(x)
    free(y)
    in_pool = sum(seg["total_size"] for seg in pool.snapshot())
    assert 0 < in_pool < npualloc.memory_reserved()
    # empty_cache: the default pool's free segment goes, the live pool keeps its memory
    npualloc.empty_cache()
    assert npualloc.memory_reserved() == in_pool
    assert len(pool.snapshot()) == 1
    pid = pool.id
    del pool
    gc.collect()
    # torch's ~MemPool: releasePool, then emptyCache(id)
    assert npualloc.memory_snapshot(mempool_id=pid) == []
    assert npualloc.memory_reserved() == 0
    check_all()


def test_empty_cache_during_a_pool_context_releases_only_pools_nobody_uses(mem):
    # Newest torch's release_cached_blocks: with a capture underway (use_mem_pool is one) the default
    # pools and their waiting frees stay (torch_npu asserts that none is underway); a pool released
    # meanwhile goes.  Once the context ends, everything goes.
    x = alloc(30 * MiB)
    free(x)
    gone = npualloc.MemPool()
    with npualloc.use_mem_pool(gone):
        y = alloc(4 * MiB)
    free(y)
    gone.release()
    pool = npualloc.MemPool()
    syncs = npualloc.memory_stats()["num_sync_all_streams"]
    with npualloc.use_mem_pool(pool):
        npualloc.empty_cache()
        assert block_of(x)["state"] == "inactive"              # the default pool's segment stays
        assert npualloc.memory_snapshot(mempool_id=gone.id) == []
        assert npualloc.memory_stats()["num_sync_all_streams"] == syncs
    npualloc.empty_cache()
    assert npualloc.memory_reserved() == 0
    assert npualloc.memory_stats()["num_sync_all_streams"] == syncs + 1
    del pool, gone
    check_all()


def test_a_released_pool_keeps_live_blocks_until_freed(mem):
    pool = npualloc.MemPool()
    with npualloc.use_mem_pool(pool):
        x = alloc(4 * MiB)
    pid = pool.id
    pool.release()
    assert npualloc.memory_snapshot(mempool_id=pid) != []  # x is still allocated
    free(x)
    assert npualloc.memory_snapshot(mempool_id=pid) != []  # freeable, but only empty_cache returns it
    npualloc.empty_cache()
    assert npualloc.memory_snapshot(mempool_id=pid) == []


def test_two_threads_releasing_a_pool_drop_one_reference(mem, monkeypatch):
    """release() checks and clears its flag under a lock: two threads passing the check together dropped the
    pool's reference twice, the second one another holder's (here a use_mem_pool context's).  A slow
    generation check widens the window between the check and the clearing so that both threads are in it."""
    pool = npualloc.MemPool()
    dev, pid = pool.device, pool.id
    real = npualloc.mempool._M._generation

    def slow_generation():
        time.sleep(0.05)
        return real()
    with npualloc.use_mem_pool(pool):
        assert pool.use_count() == 2
        monkeypatch.setattr(npualloc.mempool._M, "_generation", slow_generation)
        threads = [threading.Thread(target=pool.release) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        monkeypatch.setattr(npualloc.mempool._M, "_generation", real)
        assert npualloc._C.graph.pool_use_count(dev, *pid) == 1  # the context's reference is left
        x = alloc(1000)
    assert pool_of(x) == pid
    free(x)


def test_pool_stats_and_summary(mem):
    pool = npualloc.MemPool()
    with npualloc.use_mem_pool(pool):
        a = alloc(1000)             # small segment (2 MiB), split
        b = alloc(3000)
        c = alloc(30 * MiB)         # large segment of its own
    free(b)
    elsewhere = alloc(5 * MiB)      # default pool: not counted
    st = npualloc.mempool_stats(pool)
    assert st == pool.memory_stats()
    assert st["segment.all.current"] == 2
    assert st["segment.small_pool.current"] == 1 and st["segment.large_pool.current"] == 1
    assert st["reserved_bytes.all.current"] == 2 * MiB + segment_of(c)["total_size"]
    assert st["allocation.all.current"] == 2
    a_size = block_of(a)["size"]  # (with the NPU's 32-byte pad, rounded to 512)
    assert st["allocated_bytes.small_pool.current"] == a_size
    assert st["allocated_bytes.large_pool.current"] == block_of(c)["size"]
    assert st["requested_bytes.all.current"] == 1000 + 30 * MiB
    assert st["inactive_split.small_pool.current"] == 1
    assert st["inactive_split_bytes.small_pool.current"] == 2 * MiB - a_size
    # the device-wide counters include the pool: the pool's share is what the table shows
    dev = npualloc.memory_stats()
    assert dev["reserved_bytes.all.current"] == st["reserved_bytes.all.current"] + segment_of(elsewhere)["total_size"]
    text = pool.memory_summary()
    lines = text.splitlines()
    assert all(len(line) == 77 for line in lines)
    assert f"private pool {pool.id} memory summary, device ID 0" in text
    assert any(line.startswith("| NPU reserved segments ") and "      2" in line for line in lines)
    for p in (a, c, elsewhere):
        free(p)
    empty = npualloc.mempool_stats(npualloc.graph_pool_handle())
    assert set(empty.values()) == {0} and len(empty) == 27


def _current_stats(stats):
    return {k: v for k, v in stats.items() if k.endswith(".current") and k.split(".")[0] in
            ("allocated_bytes", "active_bytes", "reserved_bytes", "requested_bytes", "inactive_split_bytes",
             "allocation", "active", "segment", "inactive_split")}


@pytest.mark.parametrize("conf", ["", "expandable_segments:True"])
def test_pool_stats_equal_the_device_stats_when_the_pool_holds_everything(mem, conf):
    """With every block in the pool, mempool_stats is memory_stats' current values: split blocks of
    expandable segments and a free still waiting for its stream included."""
    mem(alloc_conf=conf)
    pool = npualloc.MemPool()
    s, late = npualloc.Stream(), npualloc.Stream()
    with npualloc.use_mem_pool(pool):
        a, b, c = alloc(30 * MiB), alloc(1000), alloc(50 * MiB)
        pending = alloc(5000, stream=s)
    npualloc._sleep(0.5, late.npu_stream)
    npualloc.record_stream(pending, late.npu_stream)
    free(pending)                       # waits for `late`: still active, still requested
    free(b)                             # a split remainder in the small pool
    assert block_of(pending)["state"] == "active_pending_free"
    assert _current_stats(npualloc.mempool_stats(pool)) == _current_stats(npualloc.memory_stats())
    late.synchronize()
    for p in (a, c):
        free(p)


def test_capture_refuses_pool_ids_out_of_range_as_use_mem_pool_does(mem):
    """A pool id half outside [0, 2**64) is a ValueError for a capture as for use_mem_pool, instead of
    wrapping onto another pool's id; a pool argument that is not a (first, second) tuple is a TypeError."""
    pool = npualloc.MemPool()
    s = npualloc.Stream()
    g = npualloc.Graph()
    for bad in [(2**64 + pool.id[0], pool.id[1]), (-1, 5), (pool.id[0], 2**64 + pool.id[1])]:
        with pytest.raises(ValueError, match=r"^pool_begin_thread\(\): an argument is out of range$"):
            with npualloc.use_mem_pool(bad):
                pass
        with pytest.raises(ValueError, match=r"^capture_begin\(\): an argument is out of range$"):
            g.capture_begin(s, pool=bad)
        assert pool.use_count() == 1
    raw = npualloc._C.graph.Graph(False)
    for bad, why in [(5, "or None, not int"), (pool.id + (0,), "not a tuple of 3"), (("a", 1), "'first' must be int")]:
        with pytest.raises(TypeError, match=f"^capture_begin\\(\\) argument .*{why}"):
            raw.capture_begin(s.npu_stream, s.device, None, bad, 0)
    with g.capture(stream=s, pool=pool):  # the refused calls left the graph and the stream free
        x = alloc(1000)
    assert pool_of(x) == pool.id
    free(x)
    del g
    gc.collect()
    assert pool.use_count() == 1


def test_pool_capture_shares_a_pool_between_graphs(mem):
    """torch-style captures: allocations of the capturing stream come from the pool at real addresses."""
    from npualloc import acl
    pool = npualloc.MemPool()
    s = npualloc.Stream()
    g1, g2 = npualloc.Graph(), npualloc.Graph()
    # torch (reference 3.14): a capture's beginAllocateToPool takes one reference, endAllocateToPool keeps it and
    # releasePool drops it when the graph goes; streams joining the capture share it
    s2 = npualloc.Stream()
    with g1.capture(stream=s, pool=pool):
        assert pool.use_count() == 2  # the MemPool and g1
        s2.wait_stream(s)  # s2 joins the capture
        assert pool.use_count() == 2
        x = alloc(1000)
        assert acl.rt.memset_async(x, 1000, 5, 1000, s.npu_stream) == 0
        s.wait_stream(s2)
    with g2.capture(stream=s, pool=pool.id):
        y = alloc(1000)
        assert acl.rt.memcpy_async(y, 1000, x, 1000, acl.ACL_MEMCPY_DEVICE_TO_DEVICE, s.npu_stream) == 0
    assert pool.use_count() == 3  # the MemPool and both graphs
    # one capture records into the pool at a time (torch): a second one on another stream is refused
    g3, g4 = npualloc.Graph(), npualloc.Graph()
    with g3.capture(stream=npualloc.Stream(), pool=pool):
        with pytest.raises(RuntimeError, match="beginAllocateToPool: already recording to mempool_id"):
            g4.capture_begin(npualloc.Stream(), pool=pool)
        assert pool.use_count() == 4  # the MemPool, g1, g2 and g3; not g4
    assert pool.use_count() == 4
    del g3, g4
    assert pool_of(x) == pool.id and pool_of(y) == pool.id
    assert g1.memory_plan()["pool_mode"] and g1.allocations() == []
    g1.launch(s)
    g2.launch(s)
    s.synchronize()
    buf = bytearray(4)
    import ctypes
    view = (ctypes.c_char * 4).from_buffer(buf)
    assert acl.rt.memcpy(ctypes.addressof(view), 4, y, 4, acl.ACL_MEMCPY_DEVICE_TO_HOST) == 0
    assert bytes(buf) == b"\x05" * 4
    del view
    free(x)
    free(y)
    del g1, g2
    gc.collect()
    assert pool.use_count() == 1


def test_graph_pool_is_a_method_with_torch_npus_check(mem):
    """torch_npu's NPUGraph.pool() is a method: RuntimeError "Called NPUGraph::pool() without a preceding
    successful capture." before capture_end, then the pool id, which another capture may share
    (``pool=g1.pool()``).  A planned capture has no private pool: RuntimeError too."""
    pool = npualloc.graph_pool_handle()
    s = npualloc.Stream()
    g1, g2 = npualloc.Graph(), npualloc.Graph()
    msg = r"^Called NPUGraph::pool\(\) without a preceding successful capture\.$"
    with pytest.raises(RuntimeError, match=msg):
        g1.pool()
    g1.capture_begin(s, pool=pool)
    with pytest.raises(RuntimeError, match=msg):  # not before capture_end
        g1.pool()
    with npualloc.stream(s):
        x = alloc(1000)
    g1.capture_end()
    assert g1.pool() == pool
    with g2.capture(stream=s, pool=g1.pool()):
        y = alloc(1000)
    assert pool_of(x) == pool_of(y) == pool == g2.pool()
    planned = npualloc.Graph()
    with planned.capture(stream=s):
        pass
    with pytest.raises(RuntimeError, match="planned memory"):
        planned.pool()
    free(x)
    free(y)
    del g1, g2, planned
    gc.collect()


def test_capture_into_the_default_pool_id_gets_a_pool_of_its_own(mem):
    """torch_npu's capture_begin with pool (0, 0), "no pool": a new private pool, id (n, 0), not the default
    pools."""
    s = npualloc.Stream()
    g = npualloc.Graph()
    with g.capture(stream=s, pool=DEFAULT):
        x = alloc(1000)
    pid = g.pool()
    assert pid[0] > 0 and pid[1] == 0 and pool_of(x) == pid
    h = npualloc.graph_pool_handle()
    assert h[0] == 0 and h != pid  # graph_pool_handle() draws (0, n) ids
    free(x)
    g.reset()


def test_graph_reset_releases_the_pool_and_allows_a_new_capture(mem):
    """torch's reset(): the graph gives back its pool reference at once (even while the executable it
    instantiated is still referenced), so empty_cache() returns the pool's memory; the graph can be captured
    again; reset() during a capture does nothing."""
    pool = npualloc.MemPool()
    s = npualloc.Stream()
    g = npualloc.Graph()
    with g.capture(stream=s, pool=pool):
        x = alloc(1000)
    exe = g.instantiate()
    g.replay(s)
    s.synchronize()
    assert pool.use_count() == 2
    free(x)
    g.reset()
    assert exe.destroyed and pool.use_count() == 1
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        g.pool()
    handle = npualloc.graph_pool_handle()
    with g.capture(stream=s, pool=handle):  # captured again, into another pool
        y = alloc(1000)
    assert pool_of(y) == handle == g.pool()
    free(y)
    reserved = npualloc.memory_reserved()
    g.reset()
    npualloc.empty_cache()
    assert npualloc.memory_reserved() < reserved  # the handle's pool went with the graph's reference
    g.capture_begin(s, pool=pool)
    with npualloc.stream(s):
        assert pool.use_count() == 2 and npualloc.is_current_stream_capturing()
        g.reset()  # during a capture: nothing, as torch_npu's (it acts once the capture ended)
        assert pool.use_count() == 2 and npualloc.is_current_stream_capturing()
        z = alloc(1000)
        assert pool_of(z) == pool.id
    g.capture_end()
    assert g.pool() == pool.id
    free(z)
    g.reset()
    assert pool.use_count() == 1
    del exe, g
    gc.collect()
    assert pool.use_count() == 1


def test_pool_capture_refuses_the_default_stream_and_a_second_capture(mem):
    """torch_npu's NPUGraph.capture_begin: RuntimeError on the default stream (nothing routed to the pool, no
    reference taken), and on a graph that already owns a captured graph (until reset())."""
    pool = npualloc.MemPool()
    g = npualloc.Graph()
    with pytest.raises(RuntimeError, match=r"^NPU graphs must be captured on a non-default stream\. \(However, "
                       r"after capture, it's ok to replay them on the default stream\.\)$"):
        with g.capture(pool=pool):  # the current stream: the default one
            pass
    assert pool.use_count() == 1 and not npualloc.is_current_stream_capturing()
    s = npualloc.Stream()
    with g.capture(stream=s, pool=pool):
        x = alloc(1000)
    g.replay(npualloc.default_stream())  # replaying there is fine
    npualloc.default_stream().synchronize()
    with pytest.raises(RuntimeError, match=r"^This NPUGraph instance already owns a captured graph\. "
                       r"To capture a new graph, create a new instance\.$"):
        g.capture_begin(s, pool=pool)
    assert pool.use_count() == 2
    free(x)
    g.reset()
    g.capture_begin(s, pool=pool)
    g.capture_end()
    del g
    gc.collect()
    assert pool.use_count() == 1


def test_snapshot_takes_torchs_include_traces(mem):
    """torch's MemPool.snapshot(include_traces=True) and memory_snapshot(mempool_id=None, include_traces=True):
    the argument only decides whether trace entries are gathered, so the segments are the same either way."""
    pool = npualloc.MemPool()
    with npualloc.use_mem_pool(pool):
        x = alloc(1000)
    assert pool.snapshot(include_traces=False) == pool.snapshot() == npualloc.memory_snapshot(pool.id, False)
    assert npualloc.memory_snapshot(include_traces=False) == npualloc.memory_snapshot()
    free(x)


def test_graph_replay_before_a_successful_capture_has_torch_npus_message(mem):
    """NPUGraph.replay(): RuntimeError "Called NPUGraph::replay without a preceding successful capture." before
    capture_end, during the capture and after reset()."""
    msg = r"^Called NPUGraph::replay without a preceding successful capture\.$"
    s = npualloc.Stream()
    g = npualloc.Graph()
    with pytest.raises(RuntimeError, match=msg):
        g.replay(s)
    pool = npualloc.graph_pool_handle()
    g.capture_begin(s, pool=pool)
    with pytest.raises(RuntimeError, match=msg):
        g.replay(npualloc.Stream())
    g.capture_end()
    g.replay(s)
    s.synchronize()
    g.reset()
    with pytest.raises(RuntimeError, match=msg):
        g.replay(s)


def test_a_capture_block_that_raises_still_ends_the_capture_as_torchs_graph_exit(mem):
    """torch's graph.__exit__ calls capture_end even when the block raised: the capture that ends well is a
    captured graph (pool() and replay() work), the exception goes on."""
    pool = npualloc.graph_pool_handle()
    s = npualloc.Stream()
    g = npualloc.Graph()
    with pytest.raises(KeyError):
        with g.capture(stream=s, pool=pool):
            x = alloc(1000)
            raise KeyError("in the block")
    assert g.pool() == pool
    g.replay(s)
    s.synchronize()
    free(x)


# ---- MemPool(use_on_oom=..., no_split=...) ----

def fill_device(mem, **pool_args):
    """A 64 MiB device: the pool's 22 MiB segment holds a free block (a 20 MiB request, freed) and a
    42 MiB default segment fills the rest.  Returns (pool, hog)."""
    mem(device_memory=64 * MiB)
    pool = npualloc.MemPool(**pool_args)
    with npualloc.use_mem_pool(pool):
        free(alloc(20 * MiB))
    hog = alloc(40 * MiB)
    assert npualloc.mem_get_info()[0] == 0
    return pool, hog


def test_use_on_oom_pool_serves_a_default_request_when_the_device_is_full(mem):
    plain, hog = fill_device(mem)
    with pytest.raises(npualloc.OutOfMemoryError):
        alloc(20 * MiB)
    free(hog)
    del plain
    gc.collect()
    pool, hog = fill_device(mem, use_on_oom=True)
    retries = npualloc.memory_stats()["num_alloc_retries"]
    y = alloc(20 * MiB)
    # the pool's block, before anything was released: no retry, the pool's segment in its snapshot
    assert npualloc.memory_stats()["num_alloc_retries"] == retries
    assert pool_of(y) == pool.id
    assert any(b["address"] == y and b["state"] == "active_allocated" for s in pool.snapshot() for b in s["blocks"])
    assert pool.use_count() == 1
    st = npualloc.mempool_stats(pool)
    assert st["allocation.large_pool.current"] == 1 and st["requested_bytes.all.current"] == 20 * MiB
    # freed back into the pool, merged with the rest of its segment
    free(y)
    assert pool_of(y) == pool.id
    assert [len(s["blocks"]) for s in pool.snapshot()] == [1]
    assert npualloc.mempool_stats(pool)["allocation.all.current"] == 0
    assert alloc(20 * MiB) == y
    free(y)
    check_all()
    free(hog)


def test_use_on_oom_is_not_for_requests_in_a_private_pool(mem):
    pool, hog = fill_device(mem, use_on_oom=True)
    other = npualloc.MemPool()
    with npualloc.use_mem_pool(other):
        with pytest.raises(npualloc.OutOfMemoryError):
            alloc(20 * MiB)
    with pytest.raises(npualloc.OutOfMemoryError):
        alloc(1000)  # the pool has no small block
    free(hog)
    check_all()


def test_use_on_oom_pool_being_recorded_into_fails_the_request_as_torch(mem):
    pool, hog = fill_device(mem, use_on_oom=True)
    entered, leave = threading.Event(), threading.Event()

    def record():
        with npualloc.use_mem_pool(pool):
            entered.set()
            leave.wait(10)

    t = threading.Thread(target=record)
    t.start()
    entered.wait(10)
    try:
        with pytest.raises(RuntimeError, match="beginAllocateToPool: already recording to mempool_id"):
            alloc(20 * MiB)
    finally:
        leave.set()
        t.join()
    assert pool.use_count() == 1
    free(hog)


def test_releasing_the_pool_clears_use_on_oom_first(mem):
    pool, hog = fill_device(mem, use_on_oom=True)
    npualloc._C.graph.pool_create(pool.device, *pool.id)  # another holder, as a graph sharing the pool
    pid = pool.id
    pool.release()                                         # torch's ~MemPool: setUseOnOOM(false) first
    assert npualloc.memory_snapshot(mempool_id=pid) != []
    with pytest.raises(npualloc.OutOfMemoryError):
        alloc(20 * MiB)
    npualloc._C.graph.pool_release(0, *pid)
    free(hog)


def test_a_dropped_use_on_oom_pool_keeps_its_live_block_until_freed(mem):
    pool, hog = fill_device(mem, use_on_oom=True)
    y = alloc(20 * MiB)
    pid = pool.id
    del pool
    gc.collect()
    assert [s["segment_pool_id"] for s in npualloc.memory_snapshot(mempool_id=pid)] == [pid]
    free(y)
    npualloc.empty_cache()
    assert npualloc.memory_snapshot(mempool_id=pid) == []
    assert npualloc.memory_reserved() == segment_of(hog)["total_size"]
    check_all()
    free(hog)


def test_no_split_pool_gives_each_allocation_a_whole_block(mem):
    pool, plain = npualloc.MemPool(no_split=True), npualloc.MemPool()
    with npualloc.use_mem_pool(plain):
        split_small, split_large = alloc(1000), alloc(5 * MiB)
    assert len(segment_of(split_small)["blocks"]) == 2 and len(segment_of(split_large)["blocks"]) == 2
    with npualloc.use_mem_pool(pool):
        small, large = alloc(1000), alloc(5 * MiB)
        assert [(b["size"], b["state"]) for b in segment_of(small)["blocks"]] == [(2 * MiB, "active_allocated")]
        assert [(b["size"], b["state"]) for b in segment_of(large)["blocks"]] == [(20 * MiB, "active_allocated")]
        st = npualloc.mempool_stats(pool)
        assert st["allocated_bytes.all.current"] == st["reserved_bytes.all.current"] == 22 * MiB
        assert st["requested_bytes.all.current"] == 1000 + 5 * MiB
        assert st["inactive_split.all.current"] == 0
        free(small)
        assert alloc(600) == small   # the freed block again, whole
        assert len(segment_of(small)["blocks"]) == 1
        free(small)
    for p in (large, split_small, split_large):
        free(p)
    check_all()
