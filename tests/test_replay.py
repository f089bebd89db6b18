"""npualloc.replay: exact peaks on hand-written traces, the reconstruction of memory alive before recording,
the recorded run's reservations, pickle round trips, the restricted unpickler, results and plots, and the
PyTorch traces in ../shared/traces/ (skipped when absent)."""
import csv
import enum
import io
import json
import os
import pickle
import threading
from array import array
from pathlib import Path

import pytest

from npualloc import _C, replay, workload

MiB = 1 << 20
GiB = 1 << 30
SHARED = Path(__file__).resolve().parent.parent.parent / "shared" / "traces"
FULLSTEP = SHARED / "cs336-ctx128-fullstep.pickle"


def entry(action, addr, size, stream=0, t=0):
    return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": t, "frames": []}


def snapshot(entries, segments=(), settings=None):
    return {"segments": list(segments), "device_traces": [list(entries)],
            "allocator_settings": settings or {"PYTORCH_CUDA_ALLOC_CONF": ""}}


def alloc(addr, size, stream=0):
    return [entry("alloc", addr, size, stream)]


def free(addr, size, stream=0):
    # what torch records for a block no other stream used: the request, then its completion (one FREE)
    return [entry("free_requested", addr, size, stream), entry("free_completed", addr, size, stream)]


# ---- exact peaks ----

def small_trace():
    ev = []
    ev += [entry("segment_alloc", 0x7000, 2 * MiB)]
    ev += alloc(0x7000, 1000) + alloc(0x7200, 1000)
    ev += free(0x7000, 1000)
    ev += alloc(0x7000, 100)
    ev += [entry("segment_alloc", 0x9000000, 20 * MiB)]
    ev += alloc(0x9000000, 5 * MiB)
    ev += free(0x7200, 1000) + free(0x7000, 100) + free(0x9000000, 5 * MiB)
    segs = [
        {"device": 0, "address": 0x7000, "total_size": 2 * MiB, "allocated_size": 0, "active_size": 0,
         "requested_size": 0, "stream": 0, "segment_type": "small", "segment_pool_id": (0, 0),
         "is_expandable": False, "frames": [], "blocks": [{"address": 0x7000, "size": 2 * MiB,
                                                            "requested_size": 0, "state": "inactive", "frames": []}]},
        {"device": 0, "address": 0x9000000, "total_size": 20 * MiB, "allocated_size": 0, "active_size": 0,
         "requested_size": 0, "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0),
         "is_expandable": False, "frames": [], "blocks": [{"address": 0x9000000, "size": 20 * MiB,
                                                            "requested_size": 0, "state": "inactive", "frames": []}]},
    ]
    return snapshot(ev, segs)


def test_hand_written_trace_has_exactly_known_peaks():
    r = replay.replay(small_trace(), device_memory="1GiB")
    # NPU: 1000 + 32 -> 1536 bytes; 100 + 32 -> 512 (in the first hole); 5 MiB + 32 -> 5 MiB + 512 in a 20 MiB
    # segment (below 10 MiB).
    assert r.events == 8 and r.allocs == 4 and r.frees == 4
    assert r.unknown_frees == 0 and r.reconstructed_count == 0
    assert r.peak_requested == 1000 + 100 + 5 * MiB
    assert r.peak_allocated == 1536 + 512 + 5 * MiB + 512
    assert r.peak_active == r.peak_allocated
    assert r.peak_reserved == 22 * MiB
    assert r.device_allocs == 2 and r.device_frees == 0 and r.retries == 0 and r.ooms == 0
    assert r.fragmentation == pytest.approx(1 - r.peak_active / r.peak_reserved)
    # The recorded run: both segments made during the trace, nothing before.
    assert r.recorded.initial_reserved == 0
    assert r.recorded.peak_reserved == r.recorded.final_reserved == 22 * MiB
    assert r.recorded.segment_allocs == 2
    assert r.recorded.peak_requested == r.peak_requested


def test_cuda_rounding_has_no_pad():
    ev = alloc(0x1000, MiB) + alloc(0x2000, 512) + free(0x1000, MiB) + free(0x2000, 512)
    npu = replay.replay(snapshot(ev), rounding="npu")
    cuda = replay.replay(snapshot(ev), rounding="cuda")
    # 1 MiB + 32 is a large request (a 20 MiB segment) on an NPU, a small one (2 MiB segment) on CUDA.
    assert npu.peak_reserved == 22 * MiB and npu.peak_allocated == MiB + 512 + 1024
    assert cuda.peak_reserved == 2 * MiB and cuda.peak_allocated == MiB + 512
    assert npu.peak_requested == cuda.peak_requested == MiB + 512


def test_streams_are_replayed_with_their_own_pools():
    ev = alloc(0x1000, 1000, stream=7) + free(0x1000, 1000, 7) + alloc(0x2000, 1000, 9) + free(0x2000, 1000, 9)
    r = replay.replay(snapshot(ev))
    assert r.device_allocs == 2 and r.peak_reserved == 4 * MiB


def deferred_free_trace(completions=True):
    """A block freed while another stream used it: its free_completed comes after the next alloc."""
    ev = alloc(0x10000000, 15 * MiB) + [entry("free_requested", 0x10000000, 15 * MiB)]
    ev += alloc(0x20000000, 15 * MiB)
    if completions:
        ev += [entry("free_completed", 0x10000000, 15 * MiB)]
    ev += alloc(0x10000000, 15 * MiB)
    return snapshot(ev)


def test_a_free_completes_where_the_trace_says():
    r = replay.replay(deferred_free_trace(), device_memory="1GiB")
    # 15 MiB + 32 fills a 16 MiB segment; the second alloc cannot reuse the first block yet.
    assert r.peak_reserved == 32 * MiB and r.device_allocs == 2 and r.final_reserved == 32 * MiB
    assert r.trace_events == 5 and r.frees == 1 and r.unknown_frees == 0 and r.live_allocations == 2
    assert r.peak_requested == r.recorded.peak_requested == 2 * 15 * MiB
    assert r.peak_active == 32 * MiB and r.peak_allocated == 32 * MiB
    ev = replay.Trace(deferred_free_trace()).device_events()
    assert list(ev.action) == [_C.replay.ALLOC, _C.replay.FREE_REQUESTED, _C.replay.ALLOC,
                               _C.replay.FREE_COMPLETED, _C.replay.ALLOC]
    assert list(ev.trace_index) == [0, 1, 2, 3, 4]
    # a completion right after its request is one FREE
    assert replay.Trace(snapshot(alloc(0x1000, 1000) + free(0x1000, 1000))).device_events().action == bytes(
        [_C.replay.ALLOC, _C.replay.FREE])
    # without completions in the trace (skip_actions), every free completes at its request
    r = replay.replay(deferred_free_trace(completions=False), device_memory="1GiB")
    assert r.trace_events == 4 and r.device_allocs == 2  # the second alloc reused the block, the third did not
    assert r.peak_requested == r.recorded.peak_requested == 2 * 15 * MiB


def test_a_free_waiting_for_another_stream_replays_as_recorded(restart, tmp_path):
    """record_stream: the free completes once the side stream finished; meanwhile the live allocator cannot
    reuse the block, and neither does the replay."""
    import threading

    import npualloc
    from npualloc import acl, memory

    restart()
    gate = threading.Event()
    side = npualloc.Stream()
    memory._record_memory_history()
    try:
        p = memory.caching_allocator_alloc(15 * MiB)
        npualloc.record_stream(p, side)
        assert acl.rt.launch_callback(gate.wait, None, acl.ACL_CALLBACK_BLOCK, side.npu_stream) == 0
        memory.caching_allocator_delete(p)  # waits for side, which waits for the gate
        q = memory.caching_allocator_alloc(15 * MiB)
        gate.set()
        side.synchronize()
        r = memory.caching_allocator_alloc(1)  # completes p's free first
        path = tmp_path / "streams.pickle"
        memory._dump_snapshot(str(path))
        peak_live = memory.max_memory_reserved(0)
    finally:
        gate.set()
        memory._record_memory_history(None)
    memory.caching_allocator_delete(q)
    memory.caching_allocator_delete(r)
    actions = [e["action"] for e in replay.load_trace(path)["device_traces"][0]]
    assert actions.index("free_completed") > actions.index("free_requested") + 1
    res = replay.replay(path, device_memory="4GiB")
    assert res.unknown_frees == 0 and res.ooms == 0
    assert res.peak_reserved == res.recorded.peak_reserved == peak_live == 34 * MiB
    assert res.device_allocs == res.recorded.segment_allocs == 3


def test_a_recorded_oom_is_tried_again_with_its_retry():
    ev = alloc(0x10000, 20 * MiB) + free(0x10000, 20 * MiB)
    ev += [{"action": "oom", "device_free": 42 * MiB, "size": 70 * MiB + 512, "stream": 0, "time_us": 7}]
    ev += alloc(0x20000, 20 * MiB)
    r = replay.replay(snapshot(ev), device_memory="64MiB", on_oom="stop")
    # the attempt's retry released the cached 22 MiB segment: the last alloc needs a new one
    assert (r.recorded_ooms, r.recorded_ooms_reproduced, r.ooms, r.stopped) == (1, 1, 0, False)
    assert r.device_allocs == 2 and r.device_frees == 1 and r.retries == 1 and r.allocs == 2
    assert r.trace_events == 4 and r.recorded.ooms == 1  # alloc, free (one FREE), oom, alloc
    ev = replay.Trace(snapshot(ev)).device_events()
    assert ev.action[2] == _C.replay.OOM and ev.size[2] == 70 * MiB + 512 and ev.trace_index[2] == 3
    with pytest.raises(replay.TraceError, match=r"device_traces\[0\]\[0\]: 'size' must be an int"):
        replay.Trace(snapshot([{"action": "oom", "device_free": 0, "stream": 0}]))


def test_an_oom_of_the_live_run_replays_with_its_releases(restart, tmp_path):
    from npualloc import memory

    restart(device_memory=64 * MiB, huge_memory=64 * MiB, huge1g_memory=0)
    memory._record_memory_history()
    try:
        a = memory.caching_allocator_alloc(20 * MiB)
        memory.caching_allocator_delete(a)
        with pytest.raises(memory.OutOfMemoryError):
            memory.caching_allocator_alloc(70 * MiB)  # releases the cached segment, then fails
        b = memory.caching_allocator_alloc(20 * MiB)
        path = tmp_path / "oom.pickle"
        memory._dump_snapshot(str(path))
        live = memory.memory_stats()
    finally:
        memory._record_memory_history(None)
    memory.caching_allocator_delete(b)
    r = replay.replay(path, device_memory="64MiB")
    assert r.recorded.ooms == r.recorded_ooms == r.recorded_ooms_reproduced == 1 and r.ooms == 0
    assert r.device_allocs == r.recorded.segment_allocs == live["num_device_alloc"] == 2
    assert r.device_frees == r.recorded.segment_frees == live["num_device_free"] == 1
    assert r.peak_reserved == r.recorded.peak_reserved == live["reserved_bytes.all.peak"]


def test_the_recorded_runs_device_allocations_count_expandable_maps(restart, tmp_path, monkeypatch):
    """With expandable segments torch counts every mapping as a device allocation (num_device_alloc) and every
    unmapping as a device free: so do the recorded run's columns, next to the replay's."""
    from npualloc import memory

    monkeypatch.setenv("PYTORCH_NPU_ALLOC_CONF", "expandable_segments:True")
    restart()
    memory._record_memory_history()
    try:
        a = memory.caching_allocator_alloc(30 * MiB)
        b = memory.caching_allocator_alloc(30 * MiB)
        memory.caching_allocator_delete(a)
        memory.caching_allocator_delete(b)
        memory.empty_cache()
        c = memory.caching_allocator_alloc(50 * MiB)
        snap = memory._snapshot()
        live = memory.memory_stats()
    finally:
        memory._record_memory_history(None)
    memory.caching_allocator_delete(c)
    actions = [e["action"] for e in snap["device_traces"][0]]
    assert "segment_map" in actions and "segment_unmap" in actions and "segment_alloc" not in actions
    rec = replay.replay(snap, conf="expandable_segments:True", device_memory="4GiB").recorded
    assert rec.segment_allocs == actions.count("segment_map") == live["num_device_alloc"]
    assert rec.segment_frees == actions.count("segment_unmap") == live["num_device_free"]


def test_empty_cache_of_the_recorded_run_is_replayed(restart, tmp_path):
    """empty_cache() leaves no entry of its own, only segment_free entries that no allocation follows with a
    segment_alloc or an oom (an allocation's own releases always end so): the replay empties its cache there."""
    from npualloc import memory

    restart()
    memory._record_memory_history()
    try:
        a = memory.caching_allocator_alloc(20 * MiB)
        b = memory.caching_allocator_alloc(20 * MiB)
        memory.caching_allocator_delete(a)
        memory.empty_cache()  # gives a's segment back
        memory.caching_allocator_delete(b)
        c = memory.caching_allocator_alloc(20 * MiB)  # b's cached segment
        snap = memory._snapshot()
        live = memory.memory_stats()
    finally:
        memory._record_memory_history(None)
    memory.caching_allocator_delete(c)
    r = replay.replay(snap, device_memory="4GiB")
    assert r.empty_caches == 1 and r.to_dict()["empty_caches"] == 1
    assert r.device_frees == r.recorded.segment_frees == live["num_device_free"] == 1
    assert r.final_reserved == r.recorded.final_reserved == live["reserved_bytes.all.current"] == 22 * MiB
    assert r.device_allocs == live["num_device_alloc"] == 2
    ev = replay.Trace(snap).device_events()
    at = list(ev.action).index(_C.replay.EMPTY_CACHE)
    assert snap["device_traces"][0][ev.trace_index[at]]["action"] == "segment_free"


def test_releases_of_an_allocation_are_not_an_empty_cache():
    seg = [entry("segment_free", 0x9000000, 22 * MiB)]
    # followed by the allocation's segment_alloc or its oom: the allocation's own retry
    for after in ([entry("segment_alloc", 0xA000000, 42 * MiB)] + alloc(0xA000000, 40 * MiB),
                  [{"action": "oom", "device_free": 0, "size": 40 * MiB, "stream": 0}] + alloc(0x1000, 1)):
        assert replay.Trace(snapshot(alloc(0x1000, 1) + seg + after)).device_events().empty_caches == 0
    # a retry after releasing oversize segments completes pending frees before releasing the rest
    ev = alloc(0x1000, 1) + alloc(0x2000, 1) + [entry("free_requested", 0x2000, 1)] + alloc(0x3000, 1)
    ev += seg + [entry("free_completed", 0x2000, 1), entry("segment_free", 0xB000000, 22 * MiB)]
    ev += [entry("segment_alloc", 0xA000000, 42 * MiB)] + alloc(0xA000000, 40 * MiB)
    assert replay.Trace(snapshot(ev)).device_events().empty_caches == 0
    # followed by a free, or by nothing: empty_cache
    assert replay.Trace(snapshot(alloc(0x1000, 1) + seg + free(0x1000, 1))).device_events().empty_caches == 1
    ev = replay.Trace(snapshot(alloc(0x1000, 1) + seg + seg)).device_events()
    assert ev.empty_caches == 1 and ev.action[-1] == _C.replay.EMPTY_CACHE and ev.trace_index[-1] == 1


def test_a_private_pool_release_is_not_an_empty_cache():
    """torch's newest trace entries carry pool_id: a release of private-pool segments only (~MemPool's
    emptyCache(pool.id)) is not an empty_cache(), so the replay keeps the default pool's cached segment."""
    def pooled(entries, pool):
        return [dict(e, pool_id=pool) for e in entries]

    ev = pooled([entry("segment_alloc", 0x9000000, 32 * MiB)] + alloc(0x9000000, 30 * MiB)
                + free(0x9000000, 30 * MiB), (0, 0))
    ev += pooled([entry("segment_alloc", 0xA000000, 42 * MiB)] + alloc(0xA000000, 40 * MiB)
                 + free(0xA000000, 40 * MiB) + [entry("segment_free", 0xA000000, 42 * MiB)], (0, 1))
    ev += pooled(alloc(0x9000000, 30 * MiB), (0, 0))  # the recorded run's cached default segment
    r = replay.replay(snapshot(ev), device_memory="1GiB")
    assert r.empty_caches == 0
    assert r.device_allocs == r.recorded.segment_allocs == 2
    # the same release of a default-pool segment is one
    ev[8]["pool_id"] = (0, 0)
    assert replay.replay(snapshot(ev), device_memory="1GiB").empty_caches == 1
    # a malformed pool_id is reported
    ev[8]["pool_id"] = "private"
    with pytest.raises(replay.TraceError, match=r"pool_id"):
        replay.replay(snapshot(ev), device_memory="1GiB")


def test_npualloc_traces_have_no_pool_id_so_a_pool_release_reads_as_empty_cache(restart):
    """The limit docs/allocator.md states, with its example: without pool_id in the entries, a collected
    MemPool's release is replayed as an empty_cache() of the (only) pool."""
    import gc

    import npualloc
    from npualloc import memory

    restart()
    memory._record_memory_history()
    try:
        a = memory.caching_allocator_alloc(30 * MiB)
        memory.caching_allocator_delete(a)  # a cached 30 MiB default segment
        pool = npualloc.MemPool()
        with npualloc.use_mem_pool(pool):
            b = memory.caching_allocator_alloc(40 * MiB)
        memory.caching_allocator_delete(b)
        del pool
        gc.collect()  # ~MemPool: emptyCache(pool.id) gives the pool's segment back
        c = memory.caching_allocator_alloc(30 * MiB)  # the cached default segment
        snap = memory._snapshot()
        live = memory.memory_stats()
    finally:
        memory._record_memory_history(None)
    memory.caching_allocator_delete(c)
    assert not any("pool_id" in e for e in snap["device_traces"][0])
    r = replay.replay(snap, device_memory="1GiB")
    assert r.recorded.segment_allocs == live["num_device_alloc"] == 2
    assert r.empty_caches == 1 and r.device_allocs == 3


# ---- reconstruction of memory alive before recording ----

def test_memory_alive_before_recording_is_reconstructed():
    ev = []
    ev += free(0xA000, 5000)  # allocated before recording: only its free is in the trace
    ev += alloc(0xB000, 3000)  # allocated in the trace, alive at the end: NOT reconstructed
    ev += alloc(0xC000, 7 * MiB) + free(0xC000, 7 * MiB)
    ev += [entry("segment_alloc", 0xF0000000, 20 * MiB), entry("segment_free", 0xE0000000, 40 * MiB)]
    blocks_small = [
        {"address": 0xB000, "size": 3072, "requested_size": 3000, "state": "active_allocated", "frames": []},
        {"address": 0xB000 + 3072, "size": 2 * MiB - 3072, "requested_size": 0, "state": "inactive", "frames": []},
    ]
    blocks_large = [  # alive at the end, never allocated in the trace: reconstructed
        {"address": 0xD000000, "size": 3 * MiB + 512, "requested_size": 3 * MiB, "state": "active_allocated",
         "frames": []},
        {"address": 0xD000000 + 3 * MiB + 512, "size": 17 * MiB - 512, "requested_size": 0, "state": "inactive",
         "frames": []},
    ]
    segs = [
        {"device": 0, "address": 0xB000, "total_size": 2 * MiB, "allocated_size": 3072, "active_size": 3072,
         "requested_size": 3000, "stream": 0, "segment_type": "small", "blocks": blocks_small},
        {"device": 0, "address": 0xD000000, "total_size": 20 * MiB, "allocated_size": 3 * MiB + 512,
         "active_size": 3 * MiB + 512, "requested_size": 3 * MiB, "stream": 0, "segment_type": "large",
         "blocks": blocks_large},
    ]
    r = replay.replay(snapshot(ev, segs))
    assert r.reconstructed_count == 2
    assert r.reconstructed_bytes == 5000 + 3 * MiB
    assert r.reconstructed_from_frees == (1, 5000)
    assert r.reconstructed_from_segments == (1, 3 * MiB)
    assert r.unknown_frees == 0  # the free of 0xA000 found its reconstructed allocation
    # the last segment_free, with no allocation after it, is an empty_cache (replayed as one more event)
    assert r.empty_caches == 1
    assert r.events == 2 + len([e for e in ev if e["action"] in ("alloc", "free_requested")]) + 1
    # live requested bytes: 5000 + 3 MiB from the start; 0xA000's 5000 go first, then + 3000 and + 7 MiB
    assert r.peak_requested == 3 * MiB + 3000 + 7 * MiB
    assert r.recorded.peak_requested == r.peak_requested
    assert r.live_allocations == 2  # 0xB000 and the reconstructed 0xD000000
    # the recorded run: final 22 MiB; during the trace +20 MiB and -40 MiB, so it started at 42 MiB
    rec = r.recorded
    assert rec.final_reserved == 22 * MiB
    assert rec.initial_reserved == 42 * MiB
    assert rec.peak_reserved == 62 * MiB
    assert (rec.segment_allocs, rec.segment_frees) == (1, 1)
    assert rec.timeline[1][0] == 42 * MiB and rec.timeline[1][-1] == 22 * MiB



def test_a_second_free_of_an_address_is_not_reconstructed_again():
    # 0xA000: freed twice, allocated before recording; 0xB000: allocated and freed in the trace, then freed again.
    # Each second free was taken for one more allocation alive before recording (two at 0xA000, a duplicate).
    ev = free(0xA000, 10 * MiB) + free(0xA000, 10 * MiB) + alloc(0xB000, 1000) + free(0xB000, 1000)
    ev += free(0xB000, 1000)
    r = replay.replay(snapshot(ev), rounding="cuda")
    assert r.reconstructed_count == 1 and r.reconstructed_from_frees == (1, 10 * MiB)
    assert r.duplicate_allocs == 0
    assert r.unknown_frees == 2  # the two second frees, of addresses with nothing allocated
    assert r.peak_requested == r.recorded.peak_requested == 10 * MiB


def test_the_recorded_run_of_a_snapshot_without_segments_never_goes_below_zero():
    # Without 'segments' the end is unknown: the start was taken as the end (0) less the trace's reservations,
    # -20 MiB, and the peak as 0, below the 10 MiB the trace itself requested.
    ev = [entry("segment_alloc", 0x7F0000000000, 20 * MiB)] + alloc(0x7F0000000000, 10 * MiB)
    ev += free(0x7F0000000000, 10 * MiB)
    snap = snapshot(ev)
    del snap["segments"]
    rec = replay.replay(snap, rounding="cuda").recorded
    assert rec.initial_reserved == 0
    assert rec.peak_reserved == rec.final_reserved == 20 * MiB
    assert rec.timeline[1] == [0, 20 * MiB, 20 * MiB]
    # a segment freed in the trace was there from the start
    ev = free(0x7F0000000000, 10 * MiB) + [entry("segment_free", 0x7F0000000000, 20 * MiB)]
    snap = snapshot(ev)
    del snap["segments"]
    rec = replay.replay(snap, rounding="cuda").recorded
    assert (rec.initial_reserved, rec.peak_reserved, rec.final_reserved) == (20 * MiB, 20 * MiB, 0)

def test_the_recorded_runs_device_allocations_include_the_segments_held_before_recording():
    # one 16 MiB segment held before recording (its block freed in the trace), one allocated in the trace
    ev = [entry("segment_alloc", 0x9000000, 16 * MiB)] + alloc(0x9000000, 16 * MiB) + free(0x7000, 16 * MiB)
    segs = [{"device": 0, "address": a, "total_size": 16 * MiB, "stream": 0, "segment_type": "large",
             "blocks": [{"address": a, "size": 16 * MiB, "requested_size": 0, "state": "inactive", "frames": []}]}
            for a in (0x7000, 0x9000000)]
    segs[1]["blocks"][0].update(state="active_allocated", requested_size=16 * MiB)
    r = replay.replay(snapshot(ev, segs), rounding="cuda")
    rec = r.recorded
    assert (rec.initial_segments, rec.segment_allocs) == (1, 1)
    assert r.device_allocs == 2  # the reconstructed block's segment, then the trace's
    (row,) = [line for line in replay.format_table([r]).splitlines() if line.startswith("(recorded run)")]
    assert row.split()[8] == "2"  # dev allocs: was 1, next to the replay's 2 for the same run
    assert replay.Comparison([r]).rows()[0]["device_allocs"] == 2
    # expandable segments: how many mappings made the segments held before recording is unknown
    segs[0]["is_expandable"] = True
    rec = replay.replay(snapshot(ev, segs), rounding="cuda").recorded
    assert rec.initial_segments is None
    (row,) = [line for line in replay.format_table([replay.replay(snapshot(ev, segs))]).splitlines()
              if line.startswith("(recorded run)")]
    assert row.split()[8] == "1+"


def test_a_block_freed_in_the_trace_and_pending_at_the_end_is_not_reconstructed():
    # 0xA000 was allocated before recording, 0xB000 in the trace; both frees wait for another stream
    ev = [entry("free_requested", 0xA000, 5000)] + alloc(0xB000, 3000) + [entry("free_requested", 0xB000, 3000)]
    ev += alloc(0xC000, 1000) + free(0xC000, 1000)
    blocks = [{"address": 0xA000, "size": 5120, "requested_size": 5000, "state": "active_pending_free", "frames": []},
              {"address": 0xB400, "size": 3072, "requested_size": 3000, "state": "active_pending_free", "frames": []},
              {"address": 0xC000, "size": 2 * MiB - 8192, "requested_size": 0, "state": "inactive", "frames": []}]
    segs = [{"device": 0, "address": 0xA000, "total_size": 2 * MiB, "allocated_size": 0, "active_size": 8192,
             "requested_size": 8000, "stream": 0, "segment_type": "small", "blocks": blocks}]
    segs[0]["blocks"][1]["address"] = 0xB000
    r = replay.replay(snapshot(ev, segs))
    assert r.reconstructed_count == 1 and r.reconstructed_from_frees == (1, 5000)  # 0xA000, once
    assert r.reconstructed_from_segments == (0, 0) and r.duplicate_allocs == 0 and r.unknown_frees == 0
    assert r.peak_requested == r.recorded.peak_requested == 5000 + 3000 + 1000


def test_reconstruction_makes_a_mid_run_recording_complete():
    snap = workload.transformer_trace("tiny")  # recorded from step 1: weights and Adam state came before
    r = replay.replay(snap)
    assert r.reconstructed_count > 0 and r.unknown_frees == 0 and r.ooms == 0
    assert r.peak_requested == r.recorded.peak_requested
    # every allocation alive at the end of the recorded run is alive at the end of the replay
    live_end = sum(1 for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
    assert r.live_allocations == live_end


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(device_memory=-1), ValueError, "must not be negative"),
    (dict(device_memory=0), ValueError, "more than 0 bytes"),
    (dict(device_memory="lots"), ValueError, "is not a size"),
    (dict(seq_choices=(-5,)), ValueError, "seq_choices must be positive ints"),
    (dict(seq_choices=(0,)), ValueError, "seq_choices must be positive ints"),
    (dict(seq_choices=()), ValueError, "seq_choices must be positive ints"),
    (dict(layers=0), ValueError, "must be positive"),
    (dict(layers=2.0), TypeError, "layers must be an int"),
    (dict(steps=3, record_from_step=3), ValueError, "record_from_step must be in"),
])
def test_the_workload_checks_its_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        workload.transformer_trace("tiny", **kwargs)


def test_the_workload_takes_a_size_string():
    assert workload.transformer_trace("tiny", device_memory="8GiB") == workload.transformer_trace("tiny")
    with pytest.raises(RuntimeError, match="does not fit in 1048576 bytes"):
        workload.transformer_trace("tiny", device_memory="1MiB")


def test_generated_trace_reports_the_settings_it_was_recorded_under(restart, monkeypatch):
    """workload.transformer_trace's allocator_settings are what _snapshot() reports for the same text,
    as torch's snapshot would be: not the defaults whatever conf says."""
    from npualloc import memory

    got = workload.transformer_trace("tiny", conf="expandable_segments:True")["allocator_settings"]
    assert got["expandable_segments"] is True and got["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"
    conf = "max_split_size_mb:40,garbage_collection_threshold:0.6,roundup_power2_divisions:4"
    got = workload.transformer_trace("tiny", conf=conf)["allocator_settings"]
    assert got["expandable_segments"] is False
    assert got["max_split_size"] == 40 << 20 and got["garbage_collection_threshold"] == 0.6
    assert set(got["roundup_power2_divisions"].values()) == {4}
    assert got["PYTORCH_NPU_ALLOC_CONF"] == conf
    monkeypatch.setenv("PYTORCH_NPU_ALLOC_CONF", conf)
    restart()
    assert got == memory._snapshot()["allocator_settings"]  # the live allocator's keys and values
    default = workload.transformer_trace("tiny")["allocator_settings"]
    assert default["expandable_segments"] is False and default["max_split_size"] == -1
    assert default["PYTORCH_NPU_ALLOC_CONF"] == ""


# ---- round trips ----

def test_pickle_round_trip(tmp_path):
    path = tmp_path / "trace.pickle"
    with open(path, "wb") as f:
        pickle.dump(small_trace(), f)
    a = replay.replay(str(path), device_memory="1GiB")
    b = replay.replay(small_trace(), device_memory="1GiB")
    assert a.trace == "trace.pickle"
    for k in ("events", "peak_requested", "peak_allocated", "peak_reserved", "device_allocs"):
        assert getattr(a, k) == getattr(b, k)
    assert replay.load_trace(path) == small_trace()


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_a_fully_recorded_run_is_reproduced_exactly(size, tmp_path):
    """The workload recorded through npualloc's allocator from the start, replayed under the same settings and
    rounding, makes the same reservations: the replay is faithful to the recording allocator."""
    snap = workload.transformer_trace(size, record_from_step=0, seed=3)
    path = tmp_path / "w.pickle"
    with open(path, "wb") as f:
        pickle.dump(snap, f)
    r = replay.replay(path)
    rec = r.recorded
    assert r.reconstructed_count == 0 and r.unknown_frees == 0
    assert r.peak_reserved == rec.peak_reserved
    assert r.final_reserved == rec.final_reserved
    assert r.device_allocs == rec.segment_allocs
    assert r.final_allocated == rec.final_allocated
    assert r.peak_requested == rec.peak_requested


def test_dump_snapshot_round_trip(restart, tmp_path):
    """npualloc.memory._dump_snapshot -> replay reproduces the live allocator's reservations."""
    memory = pytest.importorskip("npualloc.memory")
    if not all(hasattr(memory, n) for n in ("_record_memory_history", "_dump_snapshot", "caching_allocator_alloc")):
        pytest.skip("npualloc.memory has no memory history yet")
    restart()
    memory._record_memory_history(max_entries=100000)
    ptrs = []
    sizes = [1000, 3 * MiB, 25 * MiB, 700, 64 * MiB, 5 * MiB, 123456]
    for i in range(60):
        ptrs.append(memory.caching_allocator_alloc(sizes[i % len(sizes)] + i * 512))
        if i % 3 == 2:
            memory.caching_allocator_delete(ptrs.pop(i % len(ptrs)))
    for p in ptrs[::2]:
        memory.caching_allocator_delete(p)
    path = tmp_path / "live.pickle"
    memory._dump_snapshot(str(path))
    peak_live = memory.max_memory_reserved(0)
    memory._record_memory_history(None)
    for p in ptrs[1::2]:
        memory.caching_allocator_delete(p)
    r = replay.replay(path, device_memory="4GiB")
    assert r.reconstructed_count == 0 and r.unknown_frees == 0 and r.ooms == 0
    assert r.peak_reserved == r.recorded.peak_reserved == peak_live
    assert r.device_allocs == r.recorded.segment_allocs


# ---- the restricted unpickler ----

class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
def test_a_malicious_pickle_is_refused_and_nothing_runs(tmp_path, protocol):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pickle"
    with open(path, "wb") as f:
        pickle.dump({"segments": [], "device_traces": [[_Evil(marker)]]}, f, protocol=protocol)
    with pytest.raises(replay.UnsafeTraceError) as exc:
        replay.load_trace(path)
    assert "system" in str(exc.value) and "nothing from this file was run" in str(exc.value)
    with pytest.raises(replay.TraceError):
        replay.replay(path)
    assert not marker.exists()


def test_a_pickle_naming_any_class_is_refused(tmp_path):
    path = tmp_path / "set.pickle"
    with open(path, "wb") as f:
        pickle.dump({"segments": [], "device_traces": [[]], "x": {1, 2}}, f)  # protocol 4 pickles sets natively
    replay.load_trace(path)
    with open(path, "wb") as f:
        pickle.dump({"x": Path("/")}, f)
    with pytest.raises(replay.UnsafeTraceError, match="pathlib"):
        replay.load_trace(path)


def test_unreadable_and_malformed_traces_raise_trace_errors(tmp_path):
    with pytest.raises(replay.TraceError, match="no such file"):
        replay.load_trace(tmp_path / "missing.pickle")
    with pytest.raises(replay.TraceError, match="^'': no such file"):
        replay.load_trace("")
    (tmp_path / "junk.pickle").write_bytes(b"this is not a pickle")
    with pytest.raises(replay.TraceError, match=r"not a readable pickle \(.*\): it looks like text, not a pickle"):
        replay.load_trace(tmp_path / "junk.pickle")
    whole = pickle.dumps({"segments": [1] * 1000}, protocol=4)
    (tmp_path / "cut.pickle").write_bytes(whole[:len(whole) // 2])
    with pytest.raises(replay.TraceError, match=r"\(frame longer than the data at byte 2\): the file ends inside "
                                                r"the pickle \(cut short\?\)$"):
        replay.load_trace(tmp_path / "cut.pickle")
    (tmp_path / "trace.json").write_text('{"device_traces": []}')
    with pytest.raises(replay.TraceError, match="unknown opcode at byte 0.: it looks like JSON"):
        replay.load_trace(tmp_path / "trace.json")
    (tmp_path / "list.pickle").write_bytes(pickle.dumps([1, 2, 3]))
    with pytest.raises(replay.TraceError, match="the pickle holds a list, not a dict"):
        replay.Trace.load(tmp_path / "list.pickle")
    (tmp_path / "empty.pickle").write_bytes(b"")
    with pytest.raises(replay.TraceError, match="empty"):
        replay.load_trace(tmp_path / "empty.pickle")
    with pytest.raises(replay.TraceError, match="directory"):
        replay.load_trace(tmp_path)
    for bad, msg in [({"foo": 1}, "no 'device_traces'"), ([{"address": 1}], "list of segments"),
                     ({"device_traces": {"0": []}}, "list of lists"),
                     ({"device_traces": [[{"action": "alloc", "addr": "x", "size": 1}]]}, "'addr' must be an int"),
                     ({"device_traces": [[7]]}, "must be a dict"),
                     ({"device_traces": [[{"action": "alloc", "addr": 1, "size": 5}]],
                       "segments": [{"total_size": 512, "blocks": [{"address": 2**64, "size": 512,
                                                                    "state": "active_allocated"}]}]},
                      r"blocks\[0\]: 'address' is too large"),
                     ({"device_traces": [[{"action": "alloc", "addr": 1, "size": 5}]],
                       "segments": [{"total_size": 512, "blocks": [{"address": 4096, "size": 2**64,
                                                                    "state": "active_allocated"}]}]},
                      r"blocks\[0\]: 'size' is too large"),
                     ({"device_traces": [[]], "segments": []}, "no alloc or free events")]:
        with pytest.raises(replay.TraceError, match=msg):
            replay.replay(bad)
    with open(tmp_path / "int.pickle", "wb") as f:
        pickle.dump(42, f)
    with pytest.raises(replay.TraceError, match="holds an int"):
        replay.replay(tmp_path / "int.pickle")


def test_int_subclass_fields_are_range_checked_like_ints():
    class Offset(enum.IntEnum):
        BELOW_ZERO = -1
        PAST_U64 = 2**64

    def with_final_block(**block):
        return {"device_traces": [[{"action": "alloc", "addr": 1, "size": 5}]],
                "segments": [{"total_size": 512, "blocks": [dict({"state": "active_allocated"}, **block)]}]}

    with pytest.raises(replay.TraceError, match="'address' is negative"):
        replay.Trace(with_final_block(address=Offset.BELOW_ZERO, size=512))
    with pytest.raises(replay.TraceError, match="'size' is too large"):
        replay.Trace(with_final_block(address=4096, size=Offset.PAST_U64))


# ---- settings, OOM, results ----

def test_bad_settings_raise_value_error_with_torch_npus_message():
    with pytest.raises(ValueError, match="max_split_size_mb too small, must be >= 20"):
        replay.replay(small_trace(), conf="max_split_size_mb:1")
    with pytest.raises(ValueError, match="rounding"):
        replay.replay(small_trace(), rounding="tpu")
    with pytest.raises(ValueError, match="fraction"):
        replay.replay(small_trace(), fraction=1.5)
    with pytest.raises(ValueError, match="on_oom"):
        replay.replay(small_trace(), on_oom="ignore")


def test_compare_checks_every_setting_before_it_replays_any():
    calls = []
    with pytest.raises(ValueError, match="Unrecognized key 'foo'"):
        replay.compare(small_trace(), ["", "foo:1"], progress=lambda done, total: calls.append(done))
    assert calls == []  # the default was not replayed first
    with pytest.raises(replay.TraceError, match="no such file"):  # the settings are fine: then the trace is read
        replay.compare("/nonexistent/trace.pickle", ["", "expandable_segments:True"])


def test_compare_takes_a_single_settings_text_as_one_setting():
    (only,) = replay.compare(small_trace(), "max_split_size_mb:128", device_memory="1GiB")
    assert only.label == "max_split_size_mb:128"  # not the one-letter settings 'm', 'a', ...


@pytest.mark.parametrize("size, message", [(2**64, "device_memory is too large"),
                                           (2**61, "device_memory must be at most 1 EiB")])
def test_device_memory_beyond_the_largest_device_is_named(size, message):
    with pytest.raises(ValueError, match=message):  # 2**64 wrapped to 0: "must be more than 0 bytes"
        replay.replay(small_trace(), device_memory=size)


def test_a_fraction_that_is_not_a_number_is_a_type_error():
    with pytest.raises(TypeError, match="fraction must be a number"):
        replay.replay(small_trace(), fraction="0.5")


def test_oom_continue_and_stop():
    ev = alloc(0x1000, 60 * MiB) + alloc(0x2000, 60 * MiB) + free(0x2000, 60 * MiB) + free(0x1000, 60 * MiB)
    go = replay.replay(snapshot(ev), device_memory="100MiB")
    assert go.ooms == 1 and not go.stopped and go.skipped_frees == 1 and go.events == 4
    assert go.oom_events[0]["event"] == 1 and go.oom_events[0]["size"] == 60 * MiB
    assert go.oom_events[0]["message"].startswith("NPU out of memory. Tried to allocate 62.00 MiB")
    stop = replay.replay(snapshot(ev), device_memory="100MiB", on_oom="stop")
    assert stop.ooms == 1 and stop.stopped and stop.events == 2
    assert "stop" in replay.format_table([stop])


def test_oom_events_say_where_in_the_trace():
    ev = [entry("alloc", 0x1000, 60 * MiB, t=5)] + [entry("annotate", 0, 0)] + [entry("alloc", 0x2000, 60 * MiB, t=9)]
    res = replay.replay(snapshot(ev), device_memory="100MiB")
    (oom,) = res.oom_events
    assert oom["trace_index"] == 2 and oom["time_us"] == 9 and not oom["reconstructed"]
    assert "OOM at device_traces[0][2] (time_us 9): 60.00 MiB" in repr(res)
    assert "first <snapshot> [default]: OOM at device_traces[0][2] (time_us 9)" in replay.format_table([res])
    # an allocation alive before recording (freed in the trace, never allocated in it) that does not fit
    ev = free(0x1000, 60 * MiB) + free(0x2000, 60 * MiB)
    res = replay.replay(snapshot(ev), device_memory="100MiB")
    assert [o["reconstructed"] for o in res.oom_events] == [True]
    assert res.oom_events[0]["trace_index"] is None and "reconstructed" in repr(res)


def test_the_count_of_further_ooms_is_not_capped_by_the_ooms_described():
    ev = [entry("alloc", 0x1000 * (i + 1), 60 * MiB, t=i) for i in range(100)]
    res = replay.replay(snapshot(ev), device_memory="100MiB")
    assert res.ooms == 99 and len(res.oom_events) == 64  # the first 64 are described
    assert "OOM at device_traces[0][1] (time_us 1): 60.00 MiB on stream 0x0 (98 more)" in replay.format_table([res])
    assert "... 96 more OOMs" in repr(res)


def test_device_frees_count_released_segments():
    # the cached 62 MiB segment cannot serve 70 MiB and both do not fit: it is released, then the retry works
    ev = alloc(0x1000, 60 * MiB) + free(0x1000, 60 * MiB) + alloc(0x2000, 70 * MiB) + free(0x2000, 70 * MiB)
    res = replay.replay(snapshot(ev), device_memory="100MiB")
    assert (res.device_allocs, res.device_frees, res.retries, res.ooms) == (2, 1, 1, 0)
    assert res.peak_reserved == 72 * MiB and res.final_reserved == 72 * MiB  # 70 MiB + 32, to 2 MiB
    assert res.wall_seconds > 0 and res.events_per_second == pytest.approx(res.events / res.wall_seconds)


def test_results_are_plain_objects():
    r = replay.replay(small_trace())
    d = r.to_dict()
    json.dumps(d)
    assert d["peak_reserved"] == 22 * MiB and d["recorded"]["peak_reserved"] == 22 * MiB
    assert set(d["timeline"]) == {"event", "allocated", "reserved"}
    text = repr(r)
    assert "peak requested" in text and "fragmentation" in text and "M events/s" in text
    ev, al, re = r.timeline
    assert max(al) == r.peak_allocated and max(re) == r.peak_reserved and ev[0] == 0


def test_compare_gives_a_table():
    table = replay.compare(small_trace(), ["", "max_split_size_mb:128",
                                           {"conf": "garbage_collection_threshold:0.8", "fraction": 0.9},
                                           {"conf": "", "rounding": "cuda", "label": "cuda"}])
    assert len(table) == 4
    assert table["cuda"].rounding == "cuda" and table[0].label == "default"
    assert table[2].fraction == 0.9
    text = repr(table)
    assert "(recorded run)" in text and "max_split_size_mb:128" in text and "frag" in text
    rows = table.rows()
    assert rows[0]["setting"] == "(recorded run)" and len(rows) == 5
    json.dumps(table.to_dict())


def test_rows_have_the_same_keys_and_the_tables_columns():
    table = replay.compare(small_trace(), ["", "max_split_size_mb:128"], device_memory="1GiB")
    rows = table.rows()
    assert all(list(row) == list(rows[0]) for row in rows)  # csv.DictWriter refused the 'error' of row 2
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    assert len(out.getvalue().splitlines()) == 1 + len(rows)
    r = table[0]
    assert rows[1]["peak_requested"] == r.peak_requested and rows[1]["peak_active"] == r.peak_active
    assert rows[1]["device_frees"] == r.device_frees and rows[1]["wall_seconds"] == r.wall_seconds
    assert rows[0]["peak_requested"] == r.recorded.peak_requested


def test_a_small_traces_table_is_in_mib():
    text = replay.format_table([replay.replay(small_trace(), device_memory="1GiB")])
    assert text.splitlines()[0].endswith("sizes in MiB")
    (row,) = [line for line in text.splitlines() if line.startswith("default ")]
    assert row.split()[5] == "22.00"  # peak resv: read 0.02 in GiB
    big = replay.replay(snapshot(alloc(0x1000, 3 * GiB)), device_memory="8GiB")
    assert replay.format_table([big]).splitlines()[0].endswith("sizes in GiB")


# ---- which setting wastes least ----

def three_big_buffers():
    """7 to 35 MiB buffers, three alive at a time (docs/allocator.md's example): default reserves 124 MiB,
    expandable segments 120 MiB, max_split_size_mb:20 140 MiB."""
    ev, live = [], []
    for step in range(20):
        addr, size = 0x10000000 * (step + 1), (step % 5 + 1) * 7 * MiB
        ev += alloc(addr, size)
        live.append((addr, size))
        if len(live) > 3:
            ev += free(*live.pop(0))
    return snapshot(ev)


def test_the_least_reserving_setting_is_named_with_its_saving():
    table = replay.compare(three_big_buffers(), ["", "expandable_segments:True", "max_split_size_mb:20"],
                           device_memory="1GiB")
    assert [r.peak_reserved for r in table] == [124 * MiB, 120 * MiB, 140 * MiB]
    best = table.least_waste()
    assert list(best) == [("<snapshot>", 0)] and best["<snapshot>", 0] is table["expandable_segments:True"]
    assert replay.least_waste(table) is table["expandable_segments:True"]
    assert json.loads(json.dumps(table.to_dict()))["least_waste"] == [
        {"trace": "<snapshot>", "device": 0, "label": "expandable_segments:True", "peak_reserved": 120 * MiB}]
    over = table[1].peak_reserved - table[1].peak_requested
    assert over > 0
    assert (f"least waste: expandable_segments:True, peak reserved 120.00 MiB ({replay.format_size(over)} over the "
            "peak requested); 4.00 MiB (3.2%) less than the default (124.00 MiB)") in table.format().splitlines()


def test_a_tie_goes_to_the_default():
    # without a memory fraction garbage collection never runs: the same reservations as the default
    table = replay.compare(three_big_buffers(), ["garbage_collection_threshold:0.5", ""], device_memory="1GiB")
    assert table[0].peak_reserved == table[1].peak_reserved
    assert replay.least_waste(table) is table["default"]
    assert "least waste: default, peak reserved 124.00 MiB" in table.format()
    assert "no setting reserves less than the default" in table.format()


def test_settings_with_an_oom_are_not_ranked():
    # a 0.5 fraction of 200 MiB cannot hold three buffers: it reserves less, but failed
    table = replay.compare(three_big_buffers(), ["", {"conf": "", "fraction": 0.5}], device_memory="200MiB")
    assert table[1].ooms > 0 and table[1].peak_reserved < table[0].peak_reserved
    assert replay.least_waste(table) is table["default"]
    assert "settings with OOMs are not ranked" in table.format()
    failed = replay.compare(three_big_buffers(), [{"conf": "", "fraction": 0.5}], device_memory="200MiB")
    assert failed.least_waste() == {} and replay.least_waste(failed) is None
    assert "least waste: no setting ran without an OOM" in failed.format()


def test_cuda_rounded_rows_are_not_ranked_against_npu_ones():
    # 1 MiB: with CUDA rounding a small-pool block (2 MiB segment); with NPU's 32-byte pad a large one (20 MiB)
    ev = snapshot(alloc(0x1000, MiB) + free(0x1000, MiB))
    table = replay.compare(ev, ["", {"conf": "", "rounding": "cuda", "label": "cuda"}])
    assert table["cuda"].peak_reserved == 2 * MiB < table["default"].peak_reserved == 20 * MiB
    assert replay.least_waste(table) is table["default"]
    only_cuda = replay.compare(ev, [""], rounding="cuda")
    assert replay.least_waste(only_cuda) is only_cuda[0]


def test_rounding_in_capitals_ranks_as_its_lower_case_name():
    ev = snapshot(alloc(0x1000, MiB) + free(0x1000, MiB))
    for npu, cuda in (("NPU", "CUDA"), ("Npu", "cuda")):
        table = replay.compare(ev, ["", {"conf": "", "rounding": cuda, "label": "cuda"}], rounding=npu)
        assert [r.rounding for r in table] == ["npu", "cuda"]
        assert replay.least_waste(table) is table["default"]  # the CUDA row (2 MiB) is not ranked against it
    assert replay.Setting("", rounding="CUDA").rounding == "cuda"
    with pytest.raises(ValueError, match="rounding must be 'npu' or 'cuda'"):
        replay.Setting("", rounding="gpu")
    with pytest.raises(ValueError, match="rounding must be 'npu' or 'cuda'"):
        replay.replay(ev, rounding=None)


def test_default_and_blank_settings_are_the_default_as_in_the_cli():
    for text in ("default", " Default ", " ", ""):
        s = replay.Setting.of(text)
        assert s.conf == "" and s.label == "default", text
    table = replay.compare(three_big_buffers(), ["garbage_collection_threshold:0.5", " "], device_memory="1GiB")
    assert replay.least_waste(table) is table["default"]  # a tie goes to the default, now found
    assert replay.Setting(" max_split_size_mb:20 ").conf == "max_split_size_mb:20"


def test_a_1g_page_pool_needs_a_setting_that_asks_for_1g_pages():
    with pytest.raises(ValueError, match="huge1g_memory is the pool of page_size:1g"):
        replay.replay(small_trace(), huge1g_memory="4GiB")
    with pytest.raises(ValueError, match="huge1g_memory is the pool of page_size:1g"):
        replay.compare(small_trace(), [{"conf": "max_split_size_mb:20", "huge1g_memory": GiB}])
    r = replay.replay(small_trace(), conf="page_size:1g", huge1g_memory="4GiB")
    assert r.huge1g_memory == 4 * GiB


@pytest.mark.parametrize("points, error", [(-1, ValueError), (10**12, ValueError), (1.5, TypeError),
                                           (True, TypeError), ("9", TypeError)])
def test_timeline_points_are_checked(points, error):
    with pytest.raises(error, match="timeline_points"):
        replay.replay(small_trace(), timeline_points=points)
    with pytest.raises(error, match="timeline_points"):
        replay.compare(small_trace(), [""], timeline_points=points)


def test_a_trace_made_from_a_path_says_to_load_it(tmp_path):
    """Trace() takes a loaded snapshot; given a path it said "the pickle holds a str" without reading any."""
    for path in (str(tmp_path / "t.pickle"), tmp_path / "t.pickle"):
        with pytest.raises(replay.TraceError, match=r"Trace\(\) takes a loaded snapshot \(a dict\); Trace\.load\("):
            replay.Trace(path)
    with pytest.raises(replay.TraceError, match="not a memory snapshot: it is an int, not a dict"):
        replay.Trace(5)


def test_timeline_points_bound_the_timeline():
    assert len(replay.replay(small_trace(), timeline_points=0).timeline[0]) == 0
    assert 0 < len(replay.replay(small_trace(), timeline_points=4).timeline[0]) <= 4


@pytest.mark.parametrize("points", [1, 2, 3, 5, 7])
def test_an_odd_or_single_timeline_limit_holds(points):
    """The samples merge in pairs, so a limit of 7 once gave 8 samples and a limit of 1 gave 2."""
    trace = {"segments": [], "device_traces": [[
        {"action": "alloc", "addr": (i + 1) << 24, "size": 4096 * (i + 1), "stream": 0} for i in range(15)]]}
    events, allocated, reserved = replay.replay(trace, timeline_points=points).timeline
    assert 0 < len(events) <= points and len(allocated) == len(reserved) == len(events)
    assert events[0] == 0
    assert max(allocated) == replay.replay(trace).peak_allocated  # the samples keep the peak


def test_device_is_an_int():
    with pytest.raises(TypeError, match="device must be an int or None, not str"):
        replay.replay(small_trace(), device="0")
    assert replay.replay(small_trace(), device=0).device == 0

    class Index:  # what numpy's integers are to operator.index
        def __index__(self):
            return 0

    assert replay.replay(small_trace(), device=Index()).device == 0


def test_a_bytes_path_gives_a_str_name(tmp_path):
    path = tmp_path / "t.pickle"
    path.write_bytes(pickle.dumps(small_trace()))
    table = replay.compare(os.fsencode(path), [""])
    assert table[0].trace == "t.pickle"
    assert json.loads(json.dumps(table.to_dict()))["least_waste"][0]["trace"] == "t.pickle"
    with pytest.raises(replay.TraceError, match="^/nonexistent/x.pickle: no such file"):
        replay.load_trace(b"/nonexistent/x.pickle")


def test_least_waste_of_several_traces_is_per_trace():
    big = replay.compare(replay.Trace(three_big_buffers(), name="big"), ["", "expandable_segments:True"],
                         device_memory="1GiB")
    small = replay.compare(replay.Trace(small_trace(), name="small"), [""])
    both = replay.Comparison(list(small) + list(big))
    assert both.least_waste() == {("small", 0): small[0], ("big", 0): big[1]}
    verdicts = [line for line in both.format().splitlines() if line.startswith("least waste:")]
    assert len(verdicts) == 2 and verdicts[0].startswith("least waste: default,")
    assert verdicts[1].startswith("least waste: expandable_segments:True,")
    with pytest.raises(ValueError, match="several traces"):
        replay.least_waste(both)


def test_an_unavailable_setting_is_marked_not_crashed(monkeypatch):
    real = _C.replay.Session

    def session(conf, *a, **kw):
        if conf and "expandable_segments" in conf:
            raise replay.Unavailable("expandable_segments is not available in this build of npualloc's allocator")
        return real(conf, *a, **kw)

    monkeypatch.setattr(_C.replay, "Session", session)
    table = replay.compare(small_trace(), ["", "expandable_segments:True"])
    assert table[0].available and not table[1].available
    assert "not available" in table.format()
    assert table[1].to_dict()["available"] is False


def test_a_setting_the_device_refuses_is_marked_not_crashed():
    """Expandable pages of 11 MiB are off the 2 MiB physical granularity: the device refuses them, as
    aclrtMallocPhysical does (the replay raised MemoryError, as if the host were out of memory)."""
    table = replay.compare(small_trace(), ["", "expandable_segments:True,large_segment_size_mb:11",
                                           "expandable_segments:True,large_segment_size_mb:12"],
                           device_memory="1GiB")
    assert table[0].available and table[2].available and not table[1].available
    assert table[1].error.startswith("the device refused an allocation: ") and "ACL error 107000" in table[1].error
    assert "not available" in table.format()
    assert table.least_waste()[("<snapshot>", 0)] is table[2]   # the refused setting is not ranked


def test_a_fraction_every_setting_shares_keeps_the_default_the_default():
    """With one fraction for every row (the CLI's --fraction), the row without a settings text is still the
    default: it wins a tie and the verdict compares with it (no row was the default, so a setting that
    changes nothing won the tie)."""
    rows = [replay.Setting("release_lock_on_npumalloc:True", fraction=0.5), replay.Setting("", fraction=0.5)]
    table = replay.compare(small_trace(), rows, device_memory="1GiB")
    assert table[0].peak_reserved == table[1].peak_reserved
    assert replay.least_waste(table) is table[1]
    assert "no setting reserves less than the default" in table.format()
    # a default without the fraction others have is the default, as before
    mixed = replay.compare(small_trace(), [replay.Setting("", fraction=0.5), ""], device_memory="1GiB")
    assert replay.least_waste(mixed) is mixed[1]


def test_settings_that_cannot_change_a_replay_are_noted():
    """A key npualloc never reads, or one that acts only with a fraction or with expandable segments, gets a
    note under the table: such a setting ties with the default, and its row is no recommendation."""
    table = replay.compare(small_trace(), [
        "garbage_collection_threshold:0.5", "release_lock_on_npumalloc:True,multi_stream_lazy_reclaim:True",
        "roundup_power2_divisions:[256:4,>:8],base_addr_aligned_kb:0",
        replay.Setting("garbage_collection_threshold:0.5", fraction=0.9), "expandable_segments:True,base_addr_aligned_kb:0",
    ], device_memory="1GiB")
    notes = [line for line in table.format().splitlines() if line.startswith("note: ")]
    assert notes == [
        "note: garbage_collection_threshold:0.5: garbage_collection_threshold acts only with a memory fraction "
        "(--fraction, or per_process_memory_fraction in the setting)",
        "note: release_lock_on_npumalloc:True,multi_stream_lazy_reclaim:True: multi_stream_lazy_reclaim, "
        "release_lock_on_npumalloc change nothing in npualloc's allocator (docs/allocator.md, Settings)",
        "note: roundup_power2_divisions:[256:4,>:8],base_addr_aligned_kb:0: base_addr_aligned_kb acts only with "
        "expandable_segments:True",
    ]


def test_expandable_segments_replay_when_available():
    try:
        r = replay.replay(workload.transformer_trace("tiny"), conf="expandable_segments:True")
    except replay.Unavailable:
        pytest.skip("expandable segments are not in this build")
    assert r.expandable and r.ooms == 0 and r.peak_reserved >= r.peak_allocated


def test_page_size_1g_gets_a_pool():
    r = replay.replay(small_trace(), conf="page_size:1g", device_memory="8GiB")
    assert r.huge1g_memory == 6 * GiB and r.huge1g_fallbacks == 0
    assert r.peak_reserved == GiB + 2 * MiB  # the 5 MiB request gets a whole 1 GiB segment


def test_progress_is_reported_and_sessions_run_in_parallel():
    tr = replay.Trace(workload.transformer_trace("small"), name="small")
    seen = []
    base = replay.replay(tr, progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1][0] == seen[-1][1] == len(tr.devices[0])
    out = [None] * 4

    def run(i):
        out[i] = replay.replay(tr, conf="max_split_size_mb:128" if i % 2 else "")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out[0].peak_reserved == out[2].peak_reserved == base.peak_reserved
    assert out[1].peak_reserved == out[3].peak_reserved


def test_replay_leaves_the_live_runtime_alone():
    _C.shutdown()
    replay.replay(workload.transformer_trace("tiny"))
    assert not _C.initialized()


def test_plot_timeline_draws_on_an_axis():
    mpl = pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    del mpl
    table = replay.compare(workload.transformer_trace("tiny"), ["", "max_split_size_mb:128"])
    fig = Figure()
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    assert replay.plot_timeline(table, ax=ax) is ax
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("recorded run" in t for t in labels) and any("max_split_size_mb:128" in t for t in labels)
    assert len(ax.lines) == 4  # two settings' reserved, the recorded run, where the trace starts


def test_export_events_writes_the_bench_format(tmp_path):
    path = tmp_path / "e.bin"
    n = replay.export_events(small_trace(), path)
    data = path.read_bytes()
    assert data[:8] == b"NPUREPL1"
    count = int.from_bytes(data[8:16], "little")
    assert count == n == 8
    pad = (8 - n % 8) % 8
    addrs = array("Q", data[24 + n + pad: 24 + n + pad + 8 * n])
    assert addrs[0] == 0x7000


# ---- the PyTorch traces ----

needs_shared = pytest.mark.skipif(not FULLSTEP.exists(), reason="../shared/traces/ is not present")


@needs_shared
def test_fullstep_trace_replays_sanely():
    # its speed is a benchmark's target (benchmarks/bench_replay.c), not this test's
    npu = replay.replay(FULLSTEP)  # default settings, NPU rounding, 80 GiB
    assert npu.trace_events == 6771 + 5894  # allocs + free_requested
    assert npu.reconstructed_count > 0 and npu.unknown_frees == 0 and npu.ooms == 0
    assert npu.events_per_second > 0
    rec = npu.recorded
    assert rec.final_reserved == 58280 * MiB  # the README's figure
    # The +32-byte pad costs a little; never less than the recorded run, never wildly more.
    assert rec.peak_reserved <= npu.peak_reserved <= 1.10 * rec.peak_reserved
    # CUDA rounding is the allocator that recorded the trace: its reservations come back.
    cuda = replay.replay(FULLSTEP, rounding="cuda")
    assert abs(cuda.peak_reserved - rec.peak_reserved) <= 0.01 * rec.peak_reserved
    assert rec.initial_segments + rec.segment_allocs == cuda.device_allocs  # the segments of the run, all of them
    assert npu.peak_requested == cuda.peak_requested == rec.peak_requested


@needs_shared
@pytest.mark.parametrize("name", ["cs336-ctx128-forward.pickle", "cs336-ctx128-forward-mixed.pickle"])
def test_forward_traces_replay_sanely(name):
    path = SHARED / name
    if not path.exists():
        pytest.skip(f"{name} is not present")
    tr = replay.Trace.load(path)
    table = replay.compare(tr, ["", "expandable_segments:True", {"conf": "", "rounding": "cuda"}])
    npu, cuda = table[0], table[2]
    rec = npu.recorded
    assert npu.ooms == 0 and npu.unknown_frees == 0
    assert rec.peak_reserved <= npu.peak_reserved <= 1.10 * rec.peak_reserved
    assert abs(cuda.peak_reserved - rec.peak_reserved) <= 0.01 * rec.peak_reserved
    if table[1].available:
        assert table[1].peak_reserved <= npu.peak_reserved
