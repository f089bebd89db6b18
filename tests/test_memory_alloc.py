"""caching_allocator_alloc / caching_allocator_delete: the size pipeline, pools, splitting, oversize
blocks, garbage collection, the memory fraction, out-of-memory errors and the statistics, with
exact numbers (torch_npu's NPUCachingAllocator)."""
import re
import warnings

import pytest

import npualloc
from npualloc import _C
from conftest_memory import GiB, MiB, block_of, check_all, layout, mem, oom_message, segment_of, segments  # noqa: F401
from conftest_memory import run_python

alloc = npualloc.caching_allocator_alloc
free = npualloc.caching_allocator_delete


def stat(key, device=None):
    return npualloc.memory_stats(device)[key]


# ---- sizes and pools ----

@pytest.mark.parametrize("size, block, pool, segment", [
    (1, 512, "small", 2 * MiB),                            # +32 pad, 512 minimum
    (480, 512, "small", 2 * MiB),                          # 480 + 32 = 512
    (481, 1024, "small", 2 * MiB),                         # 513 rounds to 1024
    (MiB - 32, MiB, "small", 2 * MiB),                     # exactly 1 MiB: still small
    (MiB - 31, MiB + 512, "large", 20 * MiB),              # 1 MiB + 1 -> large pool, 20 MiB segment
    (MiB, MiB + 512, "large", 20 * MiB),
    (10 * MiB - 544, 10 * MiB - 512, "large", 20 * MiB),   # below 10 MiB: a 20 MiB segment
    (10 * MiB - 32, 10 * MiB, "large", 10 * MiB),          # 10 MiB: segment rounded to 2 MiB, no split
    (10 * MiB, 10 * MiB + 512, "large", 12 * MiB),         # split: 2 MiB - 512 > 1 MiB remains
    (19 * MiB - 32, 20 * MiB, "large", 20 * MiB),          # 1 MiB remainder is not split off
    (19 * MiB - 544, 19 * MiB - 512, "large", 20 * MiB),   # 1 MiB + 512 remainder is
    (100 * MiB + 1, 100 * MiB + 512, "large", 102 * MiB),
])
def test_size_rounding_pool_and_segment(mem, size, block, pool, segment):
    p = alloc(size)
    seg = segment_of(p)
    assert (seg["segment_type"], seg["total_size"], seg["address"]) == (pool, segment, p)
    b = block_of(p)
    assert (b["size"], b["requested_size"], b["state"]) == (block, size, "active_allocated")
    other, this = ("large_pool", "small_pool") if pool == "small" else ("small_pool", "large_pool")
    st = npualloc.memory_stats()
    assert st[f"allocated_bytes.{this}.current"] == block and st[f"allocated_bytes.{other}.current"] == 0
    assert st[f"reserved_bytes.{this}.current"] == segment and st["reserved_bytes.all.current"] == segment
    assert st[f"requested_bytes.{this}.current"] == size
    assert st[f"segment.{this}.current"] == 1 and st[f"allocation.{this}.current"] == 1
    split = block < segment
    assert st[f"inactive_split.{this}.current"] == int(split)
    assert st[f"inactive_split_bytes.{this}.current"] == segment - block
    free(p)
    assert layout(p) == [(segment, "inactive")]
    st = npualloc.memory_stats()
    assert st["allocated_bytes.all.current"] == 0 and st["active_bytes.all.current"] == 0
    assert st["inactive_split.all.current"] == 0 and st["reserved_bytes.all.current"] == segment
    check_all()


def test_one_byte_example_in_full(mem):
    p = alloc(1)
    assert npualloc.memory_snapshot() == [{
        "device": 0, "address": p, "total_size": 2 * MiB, "allocated_size": 512, "active_size": 512,
        "requested_size": 1, "stream": 0, "segment_pool_id": (0, 0), "segment_type": "small",
        "is_expandable": False, "frames": [],
        "blocks": [{"address": p, "size": 512, "requested_size": 1, "state": "active_allocated", "frames": []},
                   {"address": p + 512, "size": 2 * MiB - 512, "requested_size": 0, "state": "inactive",
                    "frames": []}]}]
    q = alloc(1)
    assert q == p + 512  # best fit, lowest address
    free(p)
    free(q)


def test_size_zero_is_null_and_untracked(mem):
    assert alloc(0) == 0
    free(0)
    assert npualloc.memory_snapshot() == []
    assert stat("allocation.all.allocated") == 0


def test_roundup_power2_divisions(mem):
    mem(alloc_conf="roundup_power2_divisions:4")
    p = alloc(MiB + 1)          # 1 MiB + 33 -> next quarter of [1 MiB, 2 MiB)
    q = alloc(5 * MiB)          # 5 MiB + 32 -> next quarter of [4 MiB, 8 MiB)
    r = alloc(1000)             # below 512 x 4: plain 512 rounding
    assert block_of(p)["size"] == MiB + 256 * 1024
    assert block_of(q)["size"] == 6 * MiB
    assert block_of(r)["size"] == 1536


# ---- splitting ----

def test_small_pool_splits_down_to_512(mem):
    a = alloc(MiB - 32)             # 1 MiB
    b = alloc(MiB - 544)            # 1 MiB - 512: 512 bytes remain, and the small pool splits them off
    assert b == a + MiB
    assert layout(a) == [(MiB, "active_allocated"), (MiB - 512, "active_allocated"), (512, "inactive")]
    assert stat("inactive_split.small_pool.current") == 1
    assert stat("inactive_split_bytes.small_pool.current") == 512
    c = alloc(1)
    assert c == a + 2 * MiB - 512   # takes the 512 remainder whole
    assert stat("inactive_split.small_pool.current") == 0
    assert stat("segment.all.current") == 1
    free(b)
    assert layout(a) == [(MiB, "active_allocated"), (MiB - 512, "inactive"), (512, "active_allocated")]
    free(a)  # merges with the free neighbour
    assert layout(c) == [(2 * MiB - 512, "inactive"), (512, "active_allocated")]
    assert stat("inactive_split_bytes.small_pool.current") == 2 * MiB - 512
    free(c)
    assert layout(c) == [(2 * MiB, "inactive")]
    check_all()


def test_large_pool_split_threshold_on_a_cached_block(mem):
    p = alloc(5 * MiB)
    free(p)                                  # a cached 20 MiB block
    q = alloc(19 * MiB - 32)                 # 19 MiB: remainder exactly 1 MiB -> not split
    assert q == p and block_of(q)["size"] == 20 * MiB
    assert stat("inactive_split.large_pool.current") == 0
    free(q)
    r = alloc(19 * MiB - 544)                # remainder 1 MiB + 512 -> split
    assert r == p and layout(r) == [(19 * MiB - 512, "active_allocated"), (MiB + 512, "inactive")]
    assert stat("reserved_bytes.all.current") == 20 * MiB and stat("num_device_alloc") == 1
    free(r)


def test_blocks_belong_to_their_stream(mem):
    s = npualloc.Stream()
    p = alloc(1, stream=s)
    free(p)
    q = alloc(1)                      # default stream: the cached block of s is not a candidate
    assert segment_of(q)["address"] != segment_of(p)["address"]
    assert segment_of(q)["stream"] == 0 and segment_of(p)["stream"] == s.npu_stream
    r = alloc(1, stream=s.npu_stream)
    assert r == p
    with npualloc.stream(s):
        t = alloc(1)                  # the current stream
    assert t == p + 512
    for x in (q, r, t):
        free(x)
    assert stat("segment.small_pool.current") == 2


# ---- max_split_size_mb ----

def test_oversize_blocks(mem):
    mem(alloc_conf="max_split_size_mb:40")
    e = alloc(80 * MiB - 32)
    assert stat("max_split_size") == 40 * MiB
    assert stat("oversize_segments.current") == 1 and stat("oversize_allocations.current") == 1
    free(e)
    assert stat("oversize_allocations.current") == 0 and stat("oversize_allocations.freed") == 1
    f = alloc(60 * MiB - 32)          # 80 >= 60 + 20: the cached block is not used
    assert f != e and segment_of(f)["total_size"] == 60 * MiB
    free(f)
    g = alloc(61 * MiB - 32)          # 80 < 61 + 20: used whole, never split
    assert g == e and layout(g) == [(80 * MiB, "active_allocated")]
    h = alloc(30 * MiB - 32)          # below max_split: an oversize cached block (60 MiB) is not used
    assert segment_of(h)["total_size"] == 30 * MiB and h != f
    assert stat("oversize_segments.current") == 2 and stat("oversize_segments.peak") == 2
    assert stat("oversize_allocations.current") == 1
    p = alloc(20 * MiB)               # below max_split: split as usual
    assert layout(p) == [(20 * MiB + 512, "active_allocated"), (2 * MiB - 512, "inactive")]
    for x in (g, h, p):
        free(x)
    check_all()


def test_oversize_cached_block_released_for_a_new_segment(mem):
    mem(alloc_conf="max_split_size_mb:40")
    npualloc.set_per_process_memory_fraction(0.1)       # 107374182 bytes
    e = alloc(80 * MiB - 32)
    free(e)
    p = alloc(30 * MiB - 32)   # 80 + 30 > allowed: the cached 80 MiB (>= max(30, 40) MiB) is released first
    st = npualloc.memory_stats()
    assert st["num_alloc_retries"] == 0 and st["num_ooms"] == 0
    assert st["num_device_free"] == 1 and st["num_device_alloc"] == 2
    assert st["reserved_bytes.all.current"] == 30 * MiB
    assert [s["total_size"] for s in segments()] == [30 * MiB]
    free(p)


# ---- garbage collection ----

def test_garbage_collection_frees_the_oldest_segments(mem):
    mem(alloc_conf="garbage_collection_threshold:0.5")
    npualloc.set_per_process_memory_fraction(0.5)   # allowed 512 MiB, collect above 256 MiB
    a = alloc(100 * MiB - 32)
    b = alloc(100 * MiB - 32)
    e = alloc(70 * MiB - 32)                        # 270 MiB reserved
    free(a)
    free(e)
    for _ in range(5):                              # each search of the large pool ages its free blocks
        free(alloc(70 * MiB - 32))                  # reuses e (the best fit), which stays young
    free(b)
    x = alloc(120 * MiB - 32)                       # nothing cached fits: collect, then a new segment
    assert sorted(s["address"] for s in segments()) == sorted([b, e, x])   # a (the oldest) went
    st = npualloc.memory_stats()
    assert st["num_device_free"] == 1 and st["num_alloc_retries"] == 0
    assert st["reserved_bytes.all.current"] == 290 * MiB
    free(x)
    check_all()


def test_garbage_collection_ages_by_one_search_per_allocation(mem):
    mem(alloc_conf="garbage_collection_threshold:0.9")
    npualloc.set_per_process_memory_fraction(0.5)   # allowed 512 MiB, collect above 460.8 MiB
    old, mid, young = (alloc(100 * MiB - 32) for _ in range(3))
    hot = alloc(5 * MiB)                            # 320 MiB reserved
    free(old)
    alloc(150 * MiB - 32)                           # a miss below the threshold: 470 MiB
    free(mid)
    free(hot)
    hot = alloc(5 * MiB)                            # a hit
    free(young)
    # A miss above the threshold: as in torch_npu, each allocation is one search of the pool, so the
    # ages are old 3, mid 2, young 1 and the two at least as old as the average go.
    alloc(120 * MiB - 32)
    assert sorted(s["address"] for s in segments() if s["total_size"] == 100 * MiB) == [young]
    assert stat("num_device_free") == 2 and stat("reserved_bytes.all.current") == 390 * MiB
    check_all()


def test_no_garbage_collection_without_a_fraction(mem):
    mem(alloc_conf="garbage_collection_threshold:0.5")
    a = alloc(300 * MiB - 32)
    free(a)
    alloc(400 * MiB - 32)
    assert stat("num_device_free") == 0 and stat("reserved_bytes.all.current") == 700 * MiB


# ---- the memory fraction and out of memory ----

def test_fraction_boundary_is_allowed_exactly(mem):
    observed = []
    npualloc.memory._attach_out_of_memory_observer(lambda *args: observed.append(args))
    npualloc.set_per_process_memory_fraction(0.25)           # 256 MiB of 1 GiB
    assert npualloc.get_per_process_memory_fraction() == 0.25
    assert npualloc.get_per_process_memory_fraction(1) == 1.0
    p = alloc(256 * MiB - 32)                                # reserved == allowed: fine
    assert stat("reserved_bytes.all.current") == 256 * MiB
    with pytest.raises(npualloc.OutOfMemoryError) as err:
        alloc(1)                                             # one more 2 MiB segment is not
    assert str(err.value) == oom_message(2 * MiB, 0, GiB, 256 * MiB, 256 * MiB, 768 * MiB, 256 * MiB,
                                         allowed=256 * MiB)
    assert isinstance(err.value, RuntimeError)
    assert observed == [(0, 2 * MiB, 256 * MiB, 768 * MiB)]
    st = npualloc.memory_stats()
    assert st["num_ooms"] == 1 and st["num_alloc_retries"] == 1 and st["num_sync_all_streams"] >= 1
    free(p)
    q = alloc(1)                                             # the cached 256 MiB goes back on the retry
    assert stat("num_alloc_retries") == 2 and stat("reserved_bytes.all.current") == 2 * MiB
    free(q)


def test_oom_message_without_a_fraction(mem):
    observed = []
    npualloc.memory._attach_out_of_memory_observer(lambda *args: observed.append(args))
    p = alloc(5 * MiB)
    with pytest.raises(npualloc.OutOfMemoryError) as err:
        alloc(GiB + 1)                                       # a 1 GiB + 2 MiB segment
    want = GiB + 2 * MiB
    assert str(err.value) == oom_message(want, 0, GiB, 5 * MiB + 512, 5 * MiB + 512, GiB - 20 * MiB, 20 * MiB)
    assert str(err.value).endswith("reserved in total by PyTorch).If reserved memory is >> allocated memory try "
                                   "setting max_split_size_mb to avoid fragmentation.")
    assert "1.00 GiB" in str(err.value) and "1024.00 MiB total capacity" in str(err.value)
    assert observed == [(0, want, GiB, GiB - 20 * MiB)]
    assert stat("num_ooms") == 1
    free(p)
    assert npualloc.memory_summary().count("NPU OOMs: 1 ") == 1
    check_all()


def test_more_than_one_exabyte(mem):
    """torch_npu checks for 1 EB in allocate() (tensors: empty) only; caching_allocator_alloc (raw_alloc)
    takes the ordinary path to the ordinary OOM."""
    observed = []
    npualloc.memory._attach_out_of_memory_observer(lambda *args: observed.append(args))
    with pytest.raises(npualloc.OutOfMemoryError, match=r"^NPU out of memory\. Tried to allocate more than 1EB "
                                                          r"memory\.$"):
        npualloc.empty(1 << 60)
    assert observed == [] and stat("num_ooms") == 0
    with pytest.raises(npualloc.OutOfMemoryError, match="more than 1EB"):
        alloc(-1)                                   # torch_npu: a negative size wraps around (here: refused)
    for size in (1 << 60, (1 << 60) - 1):
        with pytest.raises(npualloc.OutOfMemoryError) as err:
            alloc(size)
        want = (1 << 60) + 2 * MiB
        assert str(err.value) == oom_message(want, 0, GiB, 0, 0, GiB, 0)
        assert "Tried to allocate 1073741824.00 GiB" in str(err.value)
    assert observed == [(0, want, GiB, GiB)] * 2   # the ordinary OOMs are observed and counted
    assert stat("num_ooms") == 2 and stat("num_alloc_retries") == 2
    check_all()


def test_oom_observer_exception_propagates(mem):
    def observer(*args):
        raise KeyError("from the observer")
    npualloc.memory._attach_out_of_memory_observer(observer)
    with pytest.raises(KeyError):
        alloc(2 * GiB)
    assert stat("num_ooms") == 1


def test_fraction_argument_errors(mem):
    with pytest.raises(TypeError) as err:
        npualloc.set_per_process_memory_fraction(1)
    assert str(err.value) == "Invalid type for fraction argument, must be `float`"
    for bad in (1.5, -0.25):
        with pytest.raises(ValueError) as err:
            npualloc.set_per_process_memory_fraction(bad)
        assert str(err.value) == f"Invalid fraction value: {bad}. Allowed range: 0~1"
    with pytest.raises(RuntimeError, match=r"^invalid fraction:nan\. Please set within \[0, 1\]\.$"):
        npualloc.set_per_process_memory_fraction(float("nan"))
    with pytest.raises(TypeError):
        npualloc.memory._attach_out_of_memory_observer(42)


def test_fraction_sets_the_device_like_torch_npu(mem):
    assert npualloc.current_device() == 0
    npualloc.set_per_process_memory_fraction(0.5, device=1)
    assert npualloc.current_device() == 1
    assert npualloc.get_per_process_memory_fraction() == 0.5
    assert npualloc.get_per_process_memory_fraction("npu:0") == 1.0


def test_pta_error_suffix_shape(mem, monkeypatch):
    monkeypatch.delenv("TORCH_NPU_COMPACT_ERROR_OUTPUT")
    with pytest.raises(TypeError) as err:
        npualloc.set_per_process_memory_fraction(1)
    assert re.fullmatch(r"Invalid type for fraction argument, must be `float`\n\[ERROR\] "
                        r"\d{4}-\d\d-\d\d-\d\d:\d\d:\d\d \(PID:\d+, Device:0, RankID:-1\) ERR00002 PTA invalid type",
                        str(err.value)), str(err.value)
    with pytest.raises(ValueError, match=r"Allowed range: 0~1\n\[ERROR\] .* ERR00003 PTA invalid value$"):
        npualloc.set_per_process_memory_fraction(2.0)
    monkeypatch.setenv("TORCH_NPU_COMPACT_ERROR_OUTPUT", "0")
    with pytest.raises(TypeError, match=r"ERR00002 PTA invalid type$"):
        alloc(1, stream="s")
    # torch_npu adds nothing to OOM and invalid-pointer messages
    with pytest.raises(RuntimeError, match=r"^invalid device pointer: 0x1234$"):
        free(0x1234)


SUFFIX_HEAD = r"\n\[ERROR\] \d{4}-\d\d-\d\d-\d\d:\d\d:\d\d \(PID:\d+, Device:0, RankID:"


def test_settings_errors_carry_torch_npu_suffix(mem, monkeypatch):
    """A1: torch_npu's settings errors end with their PTA_ERROR / OPS_ERROR suffix (the c10 ones have none)."""
    monkeypatch.delenv("TORCH_NPU_COMPACT_ERROR_OUTPUT")
    monkeypatch.delenv("RANK", raising=False)
    mem(alloc_conf="foo:1")
    with pytest.raises(ValueError) as err:
        npualloc.caching_allocator_alloc(1)
    assert re.fullmatch(r"Unrecognized key 'foo' in NPU allocator config, " + SUFFIX_HEAD +
                        r"-1\) ERR01003 OPS invalid value", str(err.value)), str(err.value)
    with pytest.raises(ValueError) as err:      # the pool face too
        npualloc.MemPool()
    assert re.fullmatch(r"Unrecognized key 'foo' in NPU allocator config, " + SUFFIX_HEAD +
                        r"-1\) ERR01003 OPS invalid value", str(err.value)), str(err.value)
    monkeypatch.setenv("RANK", "7")
    mem(alloc_conf="multi_stream_lazy_reclaim:yes")
    with pytest.raises(RuntimeError) as err:
        npualloc.caching_allocator_alloc(1)
    assert re.fullmatch(r"Expected a single True/False argument for multi_stream_lazy_reclaim" + SUFFIX_HEAD +
                        r"7\) ERR00001 PTA invalid parameter", str(err.value)), str(err.value)
    mem(alloc_conf="expandable_segments:True,max_split_size_mb:100")
    with pytest.raises(RuntimeError, match=r"to `False`\.\n\[ERROR\] .* ERR01001 OPS invalid parameter$"):
        npualloc.caching_allocator_alloc(1)
    mem(alloc_conf="max_split_size_mb:5")  # c10's TORCH_CHECK_VALUE: no suffix
    with pytest.raises(ValueError) as err:
        npualloc.caching_allocator_alloc(1)
    assert str(err.value) == "CachingAllocator option max_split_size_mb too small, must be >= 20"
    mem()
    with pytest.raises(RuntimeError, match=r"^torch_npu\.npu\.memory\._set_allocator_settings\(\) unsupported "
                       r"setting: page_size\n\[ERROR\] .*, RankID:7\) ERR01003 OPS invalid value$"):
        npualloc.memory._set_allocator_settings("page_size:1g")
    monkeypatch.setenv("TORCH_NPU_COMPACT_ERROR_OUTPUT", "1")
    with pytest.raises(RuntimeError) as err:
        npualloc.memory._set_allocator_settings("base_addr_aligned_kb:1")
    assert str(err.value) == "torch_npu.npu.memory._set_allocator_settings() unsupported setting: base_addr_aligned_kb"
    # other allocator errors keep theirs (none here)
    monkeypatch.setenv("TORCH_NPU_COMPACT_ERROR_OUTPUT", "0")
    with pytest.raises(RuntimeError, match=r"^invalid device pointer: 0x1234$"):
        free(0x1234)


def test_settings_warnings_before_an_error_are_given(mem):
    """torch_npu warns as its parser goes (TORCH_NPU_WARN_ONCE), so a warning given before the error
    that ends the parse is still seen."""
    mem(alloc_conf="segment_size_mb:5")
    with pytest.warns(UserWarning, match=r"^`segment_size_mb` is deprecated, please use `large_segment_size_mb` "
                                         r"instead\.$"):
        with pytest.raises(RuntimeError, match=r"^CachingAllocator option segment_size_mb error, must be \[20, 512\]"):
            alloc(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # once per process, as TORCH_NPU_WARN_ONCE
        with pytest.raises(RuntimeError, match="segment_size_mb error"):
            alloc(1)


def test_a_warning_hook_calling_the_allocator_does_not_change_the_error(mem):
    """The warnings come first and may run any Python (a showwarning hook); the error raised after them
    is still the failed call's own, not one the hook's calls left behind."""
    mem(alloc_conf="segment_size_mb:5")
    hook_errors = []

    def hook(*args, **kwargs):
        try:
            free(0x1234)                         # fails: the thread's last error is now this one
        except RuntimeError as e:
            hook_errors.append(str(e))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        with pytest.raises(RuntimeError, match=r"^CachingAllocator option segment_size_mb error, must be \[20, 512\]"):
            alloc(1)
    assert len(hook_errors) == 1 and "invalid device pointer" in hook_errors[0]


def test_an_oom_observer_sees_the_failed_call_after_a_warning_hook_failed_too(mem):
    """The out-of-memory details the observers get are read before the warnings' Python runs."""
    mem(alloc_conf="segment_size_mb:20")         # deprecated: warns at the first allocation
    observed = []
    npualloc.memory._attach_out_of_memory_observer(lambda *args: observed.append(args))

    def hook(*args, **kwargs):
        with pytest.raises(npualloc.OutOfMemoryError):
            alloc(GiB + 1)                       # an OOM of another size
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        with pytest.raises(npualloc.OutOfMemoryError) as err:
            alloc(2 * GiB)
    assert "Tried to allocate 2.00 GiB" in str(err.value)
    assert observed == [(0, GiB + 2 * MiB, GiB, GiB), (0, 2 * GiB + 2 * MiB, GiB, GiB)]


def test_failed_run_time_settings_keep_what_came_before(mem):
    """torch_npu parses a run-time text straight into its settings: what it set before its error stays
    (c10's pass having reset max_split_size, garbage_collection_threshold and roundup_power2_divisions)."""
    conf = "garbage_collection_threshold:0.5,roundup_power2_divisions:4"
    mem(alloc_conf=conf)
    free(alloc(1))
    with pytest.raises(ValueError, match=r"^Unrecognized key 'foo' in Accelerator allocator config\.$"):
        npualloc.memory._set_allocator_settings("max_split_size_mb:64,foo:1")
    s = npualloc.memory._snapshot()["allocator_settings"]
    assert s["max_split_size"] == 64 * MiB and s["garbage_collection_threshold"] == 0
    assert set(s["roundup_power2_divisions"].values()) == {0}
    assert s["PYTORCH_NPU_ALLOC_CONF"] == conf     # the last text that worked
    with pytest.raises(RuntimeError, match=r"^per_process_memory_fraction is invalid, set it in \[0\.0, 1\.0\]$"):
        npualloc.memory._set_allocator_settings("throw_on_npumalloc_oom:True,per_process_memory_fraction:2")
    assert npualloc.memory._snapshot()["allocator_settings"]["throw_on_npumalloc_oom"] is True
    with pytest.raises(ValueError, match="max_split_size_mb too small"):
        npualloc.memory._set_allocator_settings("per_process_memory_fraction:0.5,max_split_size_mb:1")
    assert npualloc.get_per_process_memory_fraction() == 1.0   # a failed text's fraction is not applied
    assert npualloc.memory._snapshot()["allocator_settings"]["max_split_size"] == -1
    p = alloc(30 * MiB)                            # the allocator works on with what was kept
    free(p)
    check_all()


# ---- arguments ----

def test_stream_argument_type_error(mem):
    with pytest.raises(TypeError) as err:
        alloc(1, stream="default")
    assert str(err.value) == ("Invalid type for stream argument, must be `torch_npu.npu.Stream` or `int` "
                              "representing a pointer to a exisiting stream")
    with pytest.raises(TypeError):
        alloc(1, 0, 0, 0)
    with pytest.raises(TypeError, match="unexpected keyword"):
        alloc(1, devices=0)
    with pytest.raises(TypeError, match="size"):
        alloc("1")


def test_device_argument_forms(mem):
    p = alloc(1, device=1)
    q = alloc(1, "npu:1")
    r = alloc(1, device=None)
    assert segment_of(p)["device"] == 1 and q == p + 512 and segment_of(r)["device"] == 0
    assert npualloc.memory_allocated(1) == 1024 and npualloc.memory_allocated("npu:1") == 1024
    with pytest.raises(ValueError, match="^Expected a npu device, but got: cpu$"):
        alloc(1, device="cpu")
    with pytest.raises(RuntimeError, match="^Invalid device argument 7: did you call init\\?$"):
        alloc(1, device=7)
    for x in (p, q, r):
        free(x)


def test_invalid_pointers_are_rejected_without_damage(mem):
    p = alloc(1000)
    q = alloc(1000)
    for bad in (p + 512, q - 1, 0xdead0000, 1 << 63):
        with pytest.raises(RuntimeError, match=f"^invalid device pointer: {bad:#x}$"):
            free(bad)
    free(p)
    with pytest.raises(RuntimeError, match="invalid device pointer"):
        free(p)                                   # double free
    check_all()
    assert npualloc.memory_allocated() == 1536
    free(q)
    with pytest.raises(TypeError):
        free("0x1")


# ---- statistics ----

ARRAYS = ["allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes", "active_bytes",
          "inactive_split_bytes", "requested_bytes"]
SCALARS = ["num_alloc_retries", "num_ooms", "max_split_size", "num_sync_all_streams", "num_device_alloc",
           "num_device_free", "num_oom_rejections"]
FIELDS = ["current", "peak", "allocated", "freed"]


def test_stats_keys_exact(mem):
    assert npualloc.memory_stats() == {}                 # before the runtime starts, as torch_npu
    assert npualloc.memory_stats_as_nested_dict() == {}
    alloc(1)
    st = npualloc.memory_stats()
    want = set(SCALARS)
    want |= {f"{a}.{p}.{f}" for a in ARRAYS for p in ("all", "small_pool", "large_pool") for f in FIELDS}
    want |= {f"{o}.{f}" for o in ("oversize_allocations", "oversize_segments") for f in FIELDS}
    assert len(st) == 123 and set(st) == want
    assert list(st) == sorted(want)
    assert all(type(v) is int for v in st.values())
    nested = npualloc.memory_stats_as_nested_dict()
    assert list(nested) == SCALARS + ARRAYS + ["oversize_allocations", "oversize_segments"]
    assert list(nested["allocation"]) == ["all", "small_pool", "large_pool"]
    assert list(nested["allocation"]["all"]) == FIELDS
    assert st["max_split_size"] == -1


def _flatten(nested, prefix=""):
    for key, value in nested.items():
        if isinstance(value, dict):
            yield from _flatten(value, prefix + key + ".")
        else:
            yield prefix + key, value


def test_flat_stats_are_the_nested_dict_flattened(mem):
    """memory_stats() (built in C from a sorted key table) and the one-value readers agree with
    the nested dict, flattened as torch_npu flattens it, on a state where the values differ."""
    held = [alloc(n) for n in (100, 3 * MiB, 700, 12 * MiB)]
    free(held.pop(1))
    npualloc.reset_accumulated_memory_stats()
    held.append(alloc(5 * MiB))
    free(held.pop(0))
    st, nested = npualloc.memory_stats(), npualloc.memory_stats_as_nested_dict()
    assert list(st.items()) == sorted(_flatten(nested))
    assert len(set(st.values())) > 10  # a table read at wrong offsets could not pass
    assert npualloc.memory_allocated() == nested["allocated_bytes"]["all"]["current"] > 0
    assert npualloc.max_memory_allocated() == nested["allocated_bytes"]["all"]["peak"]
    assert npualloc.memory_reserved() == nested["reserved_bytes"]["all"]["current"] > 0
    assert npualloc.max_memory_reserved() == nested["reserved_bytes"]["all"]["peak"]
    for key, value in st.items():
        assert npualloc.memory._stat(None, key) == value, key
    with pytest.raises(KeyError):
        npualloc.memory._stat(None, "allocated_bytes.all")
    with pytest.raises(KeyError):
        npualloc.memory._stat(None, "x" * 100)
    with pytest.raises(KeyError):  # not read as the name before the NUL
        npualloc.memory._stat(None, "allocated_bytes.all.current\0peak")
    with pytest.raises(TypeError, match=r"argument 'key' must be str, not int"):
        npualloc.memory._stat(None, 1)
    for p in held:
        free(p)


def test_stats_readers_and_resets(mem):
    p = alloc(5 * MiB)
    q = alloc(100)
    assert npualloc.memory_allocated() == 5 * MiB + 512 + 512
    assert npualloc.memory_reserved() == 22 * MiB
    free(p)
    assert npualloc.memory_allocated() == 512
    assert npualloc.max_memory_allocated() == 5 * MiB + 1024
    assert npualloc.max_memory_reserved() == 22 * MiB
    st = npualloc.memory_stats()
    assert st["allocation.all.allocated"] == 2 and st["allocation.all.freed"] == 1
    assert st["requested_bytes.all.current"] == 100 and st["requested_bytes.all.peak"] == 5 * MiB + 100
    assert st["num_device_alloc"] == 2
    npualloc.reset_peak_memory_stats()
    assert npualloc.max_memory_allocated() == 512 and npualloc.max_memory_reserved() == 22 * MiB
    npualloc.reset_accumulated_memory_stats()
    st = npualloc.memory_stats()
    assert st["allocation.all.allocated"] == 0 and st["allocation.all.freed"] == 0
    assert st["allocation.all.current"] == 1 and st["num_device_alloc"] == 0
    with pytest.warns(DeprecationWarning, match=r"^torch_npu\.npu\.reset_max_memory_allocated now calls "
                                                r"torch_npu\.npu\.reset_peak_memory_stats, which resets /all/ peak "
                                                r"memory stats\.$"):
        npualloc.reset_max_memory_allocated()
    with pytest.warns(DeprecationWarning, match=r"reset_max_memory_cached now calls"):
        npualloc.reset_max_memory_cached()
    with pytest.warns(DeprecationWarning, match=r"^torch_npu\.npu\.memory_cached has been renamed to "
                                                r"torch_npu\.npu\.memory_reserved$"):
        assert npualloc.memory_cached() == 22 * MiB
    with pytest.warns(DeprecationWarning, match=r"max_memory_cached has been renamed to "
                                                r"torch_npu\.npu\.max_memory_reserved$"):
        assert npualloc.max_memory_cached() == 22 * MiB
    free(q)


def test_empty_cache(mem):
    npualloc.empty_cache()                      # before the runtime starts: nothing
    assert not npualloc.is_initialized()
    p = alloc(5 * MiB)
    q = alloc(1)
    free(p)
    npualloc.empty_cache()                      # the small segment is still in use
    assert npualloc.memory_reserved() == 2 * MiB
    assert npualloc.memory_stats()["num_device_free"] == 1
    assert npualloc.mem_get_info() == (GiB - 2 * MiB, GiB)
    free(q)
    npualloc.empty_cache()
    assert npualloc.memory_reserved() == 0 and npualloc.mem_get_info() == (GiB, GiB)
    assert npualloc.memory_stats()["segment.all.freed"] == 2


def test_warnings_become_user_warnings(mem):
    mem(alloc_conf="page_size:1g")               # no 1 GiB pages configured: warns, then uses 2 MiB pages
    with pytest.warns(UserWarning, match=r"^The malloc 1G large-page physical memory failed, so malloc 2M page "
                                         r"memory\.Using the 2M memory page"):
        p = alloc(30 * MiB)
    assert segment_of(p)["total_size"] == GiB   # page_size:1g rounds large segments to 1 GiB
    free(p)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q = alloc(1)                             # small pool: no 1 GiB pages, no warning
        free(q)
        npualloc.empty_cache()
        r = alloc(30 * MiB)                      # a second fallback: torch_npu warns once a process
        assert segment_of(r)["total_size"] == GiB
        free(r)


def test_devices_and_backend(mem):
    assert npualloc.device_count() == 2
    assert npualloc.get_allocator_backend() == "native"
    assert npualloc.current_device() == 0       # lazily device 0
    npualloc.set_device(1)
    assert npualloc.current_device() == 1
    npualloc.set_device("npu:0")
    assert npualloc.current_device() == 0
    assert npualloc.mem_get_info(1) == (GiB, GiB)
    p = alloc(1, device=1)
    assert npualloc.mem_get_info("npu:1") == (GiB - 2 * MiB, GiB) and npualloc.current_device() == 0
    npualloc.synchronize()
    npualloc.synchronize(1)
    free(p)
    with pytest.raises(RuntimeError, match="error code is"):
        npualloc.set_device(5)
    with pytest.raises(ValueError, match="Expected a torch.device with a specified index or an integer"):
        npualloc.mem_get_info(1.5)


# ---- empty_virt_addr_cache (torch_npu.npu.empty_virt_addr_cache) ----

def _hbm_free():
    from npualloc import acl
    acl.rt.set_device(0)
    free_bytes, _total, ret = acl.rt.get_mem_info(acl.ACL_HBM_MEM)
    assert ret == 0
    return free_bytes


def test_empty_virt_addr_cache_unmaps_but_keeps_physical_pages(mem):
    mem(alloc_conf="expandable_segments:True")
    assert npualloc.memory.empty_virt_addr_cache is npualloc.empty_virt_addr_cache
    p = alloc(40 * MiB - 32)                    # two 20 MiB pages
    free(p)
    hbm_free = _hbm_free()
    npualloc.empty_virt_addr_cache()
    assert npualloc.memory_reserved() == 0 and stat("num_device_free") == 1
    counts = _C.vmm_counts()
    assert counts["physical_handles"] == 2 and counts["mappings"] == 0   # unmapped, handles kept
    assert _hbm_free() == hbm_free                                       # the device did not get them back
    assert segments() == []
    q = alloc(40 * MiB - 32)                    # the next growth maps the kept pages again
    assert npualloc.memory_reserved() == 40 * MiB and stat("num_device_alloc") == 2
    assert _C.vmm_counts()["physical_handles"] == 2 and _hbm_free() == hbm_free
    free(q)
    npualloc.empty_cache()                      # empty_cache frees the physical memory
    assert _C.vmm_counts()["physical_handles"] == 0 and _hbm_free() == hbm_free + 40 * MiB
    check_all()


def test_pages_kept_by_empty_virt_addr_cache_belong_to_their_pool(mem):
    # torch_npu keeps them per BlockPool (free_physical_handles_): a MemPool maps pages of its own.
    mem(alloc_conf="expandable_segments:True")
    p = alloc(40 * MiB - 32)                    # two 20 MiB pages of the default large pool
    free(p)
    npualloc.empty_virt_addr_cache()
    hbm_free = _hbm_free()
    pool = npualloc.MemPool()
    with npualloc.use_mem_pool(pool):
        q = alloc(40 * MiB - 32)                # two new pages, not the kept ones
    assert _C.vmm_counts()["physical_handles"] == 4 and _hbm_free() == hbm_free - 40 * MiB
    r = alloc(40 * MiB - 32)                    # the default pool maps its own kept pages again
    assert _C.vmm_counts()["physical_handles"] == 4 and _hbm_free() == hbm_free - 40 * MiB
    free(r)
    free(q)
    del pool                                    # nothing uses the pool's cached block any more
    npualloc.empty_virt_addr_cache()
    # The pool's pages were unmapped and kept, and the pool, holding no segment, was forgotten: no pool
    # can map them again, so they went back to the device.  The default pool's are kept.
    assert _C.vmm_counts()["physical_handles"] == 2 and _hbm_free() == hbm_free
    npualloc.empty_cache()
    assert _C.vmm_counts()["physical_handles"] == 0 and _hbm_free() == hbm_free + 40 * MiB
    check_all()


def test_a_mempool_cannot_take_the_default_pools_kept_pages(mem):
    mem(alloc_conf="expandable_segments:True")  # 1 GiB device
    p = alloc(600 * MiB)                        # 31 pages of 20 MiB
    free(p)
    npualloc.empty_virt_addr_cache()            # 620 MiB kept, 404 MiB free
    pool = npualloc.MemPool()
    with npualloc.use_mem_pool(pool):
        with pytest.raises(npualloc.OutOfMemoryError, match=r"Tried to allocate 602\.00 MiB .* 404\.00 MiB free;"):
            alloc(600 * MiB)
    assert stat("num_ooms") == 1
    del pool
    check_all()


@pytest.mark.parametrize("conf", ["", "expandable_segments:True"])
def test_out_of_descriptors_is_a_runtime_error_not_an_oom(conf):
    # torch_npu raises any error of a segment's allocation but running out of device memory; its
    # expandable segments' map does the same (NPU_CHECK_ERROR), so neither is an OutOfMemoryError.
    code = """
import os
import npualloc
fds = []
try:
    while True:
        fds.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
try:
    npualloc.caching_allocator_alloc(1000)
except npualloc.OutOfMemoryError as e:
    print("OOM", e)
except RuntimeError as e:
    print("RuntimeError", e)
for fd in fds:
    os.close(fd)
p = npualloc.caching_allocator_alloc(1000)      # recovered
npualloc.caching_allocator_delete(p)
npualloc.memory._check(0)
print("ok")
"""
    r = run_python(code, env={"PYTORCH_NPU_ALLOC_CONF": conf})
    assert r.returncode == 0, r.stderr
    first, last = r.stdout.strip().splitlines()
    what = "mapping a 2097152-byte page of an expandable segment" if conf else "allocating a 2097152-byte segment"
    assert first == f"RuntimeError NPU error: {what} on device 0 failed with ACL error 207005" and last == "ok"


def test_empty_virt_addr_cache_releases_plain_segments_like_torch_npu(mem):
    p = alloc(5 * MiB)                          # a plain 20 MiB segment, made before expandable was on
    free(p)
    npualloc.memory._set_allocator_settings("expandable_segments:True")
    npualloc.empty_virt_addr_cache()
    assert npualloc.memory_reserved() == 0 and _C.vmm_counts()["physical_handles"] == 0
    check_all()


def test_empty_virt_addr_cache_needs_expandable_segments(mem):
    npualloc.empty_virt_addr_cache()            # before initialisation: nothing to do
    p = alloc(5 * MiB)
    free(p)
    with pytest.raises(RuntimeError, match="Unsupported config for empty_virt_addr_cache, please enable "
                                           "expandable_segments."):
        npualloc.empty_virt_addr_cache()
    assert npualloc.memory_reserved() == 20 * MiB   # nothing released


def test_readme_torch_face_example_runs_as_written():
    """The README's torch_npu example prints what its comment says: 10 MiB + 32 rounds to 10 MiB + 512
    allocated, in a 12 MiB segment (a segment for 10 MiB or more is the size rounded up to 2 MiB)."""
    from pathlib import Path
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    example = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "memory_summary()" in b)
    expected = re.search(r"print\(npualloc.memory_allocated.*\)\s+# (.*)", example).group(1).strip()
    proc = run_python(example)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == expected == f"{10 * MiB + 512} {12 * MiB}"
    assert "PyTorch NPU memory summary, device ID 0" in proc.stdout
