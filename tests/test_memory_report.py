"""memory_summary, snapshots, the memory history, _dump_snapshot, allocator settings and their errors."""
import pickle
import time

import pytest

import npualloc
from conftest_memory import GiB, MiB, mem, run_python, segment_of  # noqa: F401

alloc = npualloc.caching_allocator_alloc
free = npualloc.caching_allocator_delete
memory = npualloc.memory


# ---- memory_summary ----

SUMMARY_ONE_BYTE = """\
|===========================================================================|
|                  PyTorch NPU memory summary, device ID 0                  |
|---------------------------------------------------------------------------|
|            NPU OOMs: 0             |        npuMalloc retries: 0          |
|===========================================================================|
|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |
|---------------------------------------------------------------------------|
| Allocated memory      |     512 B  |     512 B  |     512 B  |       0 B  |
|       from large pool |       0 B  |       0 B  |       0 B  |       0 B  |
|       from small pool |     512 B  |     512 B  |     512 B  |       0 B  |
|---------------------------------------------------------------------------|
| Active memory         |     512 B  |     512 B  |     512 B  |       0 B  |
|       from large pool |       0 B  |       0 B  |       0 B  |       0 B  |
|       from small pool |     512 B  |     512 B  |     512 B  |       0 B  |
|---------------------------------------------------------------------------|
| NPU reserved memory   |    2048 KB |    2048 KB |    2048 KB |       0 B  |
|       from large pool |       0 KB |       0 KB |       0 KB |       0 B  |
|       from small pool |    2048 KB |    2048 KB |    2048 KB |       0 B  |
|---------------------------------------------------------------------------|
| Non-releasable memory |    2047 KB |    2047 KB |    2047 KB |       0 B  |
|       from large pool |       0 KB |       0 KB |       0 KB |       0 B  |
|       from small pool |    2047 KB |    2047 KB |    2047 KB |       0 B  |
|---------------------------------------------------------------------------|
| Allocations           |       1    |       1    |       1    |       0    |
|       from large pool |       0    |       0    |       0    |       0    |
|       from small pool |       1    |       1    |       1    |       0    |
|---------------------------------------------------------------------------|
| Active allocs         |       1    |       1    |       1    |       0    |
|       from large pool |       0    |       0    |       0    |       0    |
|       from small pool |       1    |       1    |       1    |       0    |
|---------------------------------------------------------------------------|
| NPU reserved segments |       1    |       1    |       1    |       0    |
|       from large pool |       0    |       0    |       0    |       0    |
|       from small pool |       1    |       1    |       1    |       0    |
|---------------------------------------------------------------------------|
| Non-releasable allocs |       1    |       1    |       1    |       0    |
|       from large pool |       0    |       0    |       0    |       0    |
|       from small pool |       1    |       1    |       1    |       0    |
|---------------------------------------------------------------------------|
| Oversize allocations  |       0    |       0    |       0    |       0    |
|---------------------------------------------------------------------------|
| Oversize NPU segments |       0    |       0    |       0    |       0    |
|===========================================================================|
"""


def test_memory_summary_exact(mem):
    alloc(1)
    assert npualloc.memory_summary() == SUMMARY_ONE_BYTE
    assert npualloc.memory_summary(0) == SUMMARY_ONE_BYTE


def test_memory_summary_layout_and_units(mem):
    p = alloc(800 * MiB - 32)                       # 800 MiB: MB once the reference value passes 768 MiB
    q = alloc(5 * MiB)
    with pytest.raises(npualloc.OutOfMemoryError):
        alloc(GiB)
    free(q)
    text = npualloc.memory_summary(device="npu:0")
    lines = text.split("\n")
    assert lines[-1] == "" and len(lines) - 1 == 43
    assert all(len(line) == 77 and line[0] == "|" and line[-1] == "|" for line in lines[:-1])
    assert lines[3] == "|            NPU OOMs: 1             |        npuMalloc retries: 1          |"
    assert "| Allocated memory      |     800 MB |     805 MB |     805 MB |    5120 KB |" in lines
    assert "|       from large pool |     800 MB |     805 MB |     805 MB |    5120 KB |" in lines
    assert "| NPU reserved memory   |     820 MB |     820 MB |     820 MB |       0 B  |" in lines
    assert "|       from small pool |       0 MB |       0 MB |       0 MB |       0 KB |" in lines
    assert "| Non-releasable memory |       0 B  |   15359 KB |   15359 KB |   15359 KB |" in lines
    short = npualloc.memory_summary(abbreviated=True).split("\n")
    assert len(short) - 1 == 27 and not any("from large pool" in line for line in short)
    assert npualloc.memory_summary(1).split("\n")[1] == (
        "|                  PyTorch NPU memory summary, device ID 1                  |")
    free(p)


def test_memory_summary_counts_in_thousands(mem):
    ptrs = [alloc(1) for _ in range(4096)]            # 4096 x 512 in 2 MiB segments: 1 full segment per 4096
    text = npualloc.memory_summary(abbreviated=True)
    assert "| Allocations           |    4096    |    4096    |    4096    |       0    |" in text
    for p in ptrs:
        free(p)


# ---- snapshots ----

SEGMENT_KEYS = ["device", "address", "total_size", "allocated_size", "active_size", "requested_size", "stream",
                "segment_pool_id", "segment_type", "is_expandable", "frames", "blocks"]
BLOCK_KEYS = ["address", "size", "requested_size", "state", "frames"]


def test_snapshot_keys_and_order(mem):
    s = npualloc.Stream()
    a = alloc(5 * MiB, device=1)
    b = alloc(1, stream=s)
    c = alloc(1)
    segs = npualloc.memory_snapshot()
    assert [list(seg) for seg in segs] == [SEGMENT_KEYS] * 3
    assert all(list(blk) == BLOCK_KEYS for seg in segs for blk in seg["blocks"])
    assert [seg["device"] for seg in segs] == [0, 0, 1]                    # by device, then address
    assert segs[0]["address"] < segs[1]["address"]
    assert {seg["stream"] for seg in segs[:2]} == {0, s.npu_stream}
    assert segs[2]["address"] == a and segs[2]["segment_type"] == "large" and segs[2]["total_size"] == 20 * MiB
    assert npualloc.memory_snapshot(mempool_id=(0, 0)) == segs
    assert npualloc.memory_snapshot(mempool_id=(0, 1)) == []
    for p in (a, b, c):
        free(p)


def _plain(obj):
    if isinstance(obj, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return all(_plain(v) for v in obj)
    return type(obj) in (int, str, bool, float)


def test_history_traces(mem):
    memory._record_memory_history()
    before = time.time() * 1e6
    p = alloc(1)
    free(p)
    snap = memory._snapshot()
    assert list(snap) == ["segments", "device_traces", "allocator_settings", "external_annotations"]
    assert snap["external_annotations"] == []  # torch >= 2.6's key; npualloc records no annotations
    assert len(snap["device_traces"]) == 2 and snap["device_traces"][1] == []
    trace = snap["device_traces"][0]
    assert [(e["action"], e["addr"], e["size"], e["stream"]) for e in trace] == [
        ("segment_alloc", p, 2 * MiB, 0), ("alloc", p, 1, 0), ("free_requested", p, 1, 0),
        ("free_completed", p, 1, 0)]
    assert all(list(e) == ["action", "addr", "size", "stream", "time_us", "compile_context", "user_metadata",
                           "frames"] for e in trace)
    assert all(before - 5e6 <= e["time_us"] <= time.time() * 1e6 for e in trace)      # microseconds since the epoch
    assert [e["time_us"] for e in trace] == sorted(e["time_us"] for e in trace)
    q = alloc(MiB + 1)
    trace = memory._snapshot()["device_traces"][0]
    assert trace[4] == dict(trace[4], action="snapshot", addr=0, size=0, stream=0)  # the previous snapshot
    assert [e["action"] for e in trace[5:]] == ["segment_alloc", "alloc"]
    with pytest.raises(npualloc.OutOfMemoryError):
        alloc(2 * GiB)
    npualloc.empty_cache()
    trace = memory._snapshot()["device_traces"][0]
    assert trace[-3]["action"] == "snapshot" and trace[-3]["size"] == MiB + 512       # active bytes then
    assert [e["action"] for e in trace[-2:]] == ["segment_free", "oom"]   # the retry freed the small segment
    assert trace[-2]["size"] == 2 * MiB
    oom = trace[-1]
    assert list(oom) == ["action", "device_free", "size", "stream", "time_us", "compile_context", "user_metadata",
                         "frames"]
    assert oom["size"] == 2 * GiB + 512 and oom["device_free"] == GiB - 20 * MiB
    assert _plain(memory._snapshot())
    free(q)


def test_history_limits_and_disabling(mem):
    memory._record_memory_history(max_entries=2)
    free(alloc(1))
    assert [e["action"] for e in memory._snapshot()["device_traces"][0]] == ["free_requested", "free_completed"]
    memory._record_memory_history("state")                 # "state" keeps a single entry
    free(alloc(1))
    assert [e["action"] for e in memory._snapshot()["device_traces"][0]] == ["free_completed"]
    memory._record_memory_history(None)
    free(alloc(1))
    assert memory._snapshot()["device_traces"] == [[], []]


def test_history_argument_errors(mem):
    with pytest.raises(RuntimeError, match=r"^expected state to be 'state', 'all', or None$"):
        memory._record_memory_history("yes")
    with pytest.raises(RuntimeError, match=r"^expected context to be 'state', 'alloc', 'all', or None$"):
        memory._record_memory_history(context="some")
    with pytest.raises(RuntimeError, match=r"^expected stacks to be 'python', or 'all'$"):
        memory._record_memory_history(stacks="cpp")
    with pytest.raises(TypeError):  # a bool selects torch's legacy form, whose flags are bools
        memory._record_memory_history(True, record_context="yes")


def test_dump_snapshot(mem, tmp_path):
    memory._record_memory_history()
    p = alloc(1000)
    path = tmp_path / "dump.pickle"
    path.write_bytes(b"x" * 100000)          # an older, longer file is replaced, not patched
    memory._dump_snapshot(str(path))
    with open(path, "rb") as f:
        data = pickle.load(f)
    assert _plain(data)
    assert data["segments"] == npualloc.memory_snapshot()
    assert [e["action"] for e in data["device_traces"][0]] == ["segment_alloc", "alloc"]
    free(p)


# ---- settings ----

def test_allocator_settings_in_the_snapshot(mem):
    mem(alloc_conf="max_split_size_mb:40,garbage_collection_threshold:0.6,roundup_power2_divisions:[256:4,>:8]")
    settings = memory._snapshot()["allocator_settings"]
    assert settings["PYTORCH_NPU_ALLOC_CONF"] == "max_split_size_mb:40,garbage_collection_threshold:0.6," \
                                                "roundup_power2_divisions:[256:4,>:8]"
    assert settings["max_split_size"] == 40 * MiB and settings["garbage_collection_threshold"] == 0.6
    assert settings["expandable_segments"] is False
    assert list(settings["roundup_power2_divisions"]) == [str(1 << i) for i in range(16)]
    assert settings["roundup_power2_divisions"]["1"] == 4 and settings["roundup_power2_divisions"]["512"] == 8
    memory._set_allocator_settings("max_split_size_mb:60")
    settings = memory._snapshot()["allocator_settings"]
    assert settings["PYTORCH_NPU_ALLOC_CONF"] == "max_split_size_mb:60" and settings["max_split_size"] == 60 * MiB


def test_set_allocator_settings(mem):
    memory._set_allocator_settings("max_split_size_mb:40")
    p = alloc(80 * MiB - 32)
    free(p)
    assert segment_of(alloc(60 * MiB - 32))["address"] != p    # the new max_split_size applies
    with pytest.raises(RuntimeError, match=r"^torch_npu\.npu\.memory\._set_allocator_settings\(\) unsupported "
                                           r"setting: garbage_collection_threshold$"):
        memory._set_allocator_settings("garbage_collection_threshold:0.5")
    with pytest.raises(RuntimeError, match=r"^Invalid value 'abc' for allocator option max_split_size_mb"):
        memory._set_allocator_settings("max_split_size_mb:abc")
    with pytest.raises(TypeError):
        memory._set_allocator_settings(40)


def test_settings_text_without_the_fraction_leaves_fractions_alone(mem):
    mem(alloc_conf="per_process_memory_fraction:0.5")
    free(alloc(1, device=0))
    assert npualloc.get_per_process_memory_fraction(0) == 0.5      # the environment's, at the start
    npualloc.set_per_process_memory_fraction(0.9, 0)
    memory._set_allocator_settings("max_split_size_mb:30")
    assert npualloc.get_per_process_memory_fraction(0) == 0.9      # not put back to 0.5
    free(alloc(1, device=1))
    assert npualloc.get_per_process_memory_fraction(1) == 0.5      # a cache started later: still the environment's
    memory._set_allocator_settings("per_process_memory_fraction:0.25")
    assert [npualloc.get_per_process_memory_fraction(d) for d in (0, 1)] == [0.25, 0.25]


def test_a_long_settings_text_is_reported_whole(mem):
    """torch keeps the whole text (a std::string); npualloc cut it to 1023 bytes."""
    text = "max_split_size_mb:" + "0" * 1100 + "40"
    mem(alloc_conf=text)
    free(alloc(1))
    settings = memory._snapshot()["allocator_settings"]
    assert settings["PYTORCH_NPU_ALLOC_CONF"] == text and settings["max_split_size"] == 40 * MiB
    longer = "max_split_size_mb:" + "0" * 5000 + "30"
    memory._set_allocator_settings(longer)
    assert memory._snapshot()["allocator_settings"]["PYTORCH_NPU_ALLOC_CONF"] == longer


def test_max_split_size_stat_is_the_value_when_the_first_cache_started(mem):
    mem(alloc_conf="max_split_size_mb:64")
    free(alloc(1, device=0))
    memory._set_allocator_settings("max_split_size_mb:30")
    free(alloc(1, device=1))
    # torch builds every device's allocator at once: both report the value of that moment
    assert [npualloc.memory_stats(d)["max_split_size"] for d in (0, 1)] == [64 * MiB, 64 * MiB]
    assert memory._snapshot()["allocator_settings"]["max_split_size"] == 30 * MiB   # the settings in force
    mem(alloc_conf="max_split_size_mb:64")
    memory._set_allocator_settings("max_split_size_mb:30")          # before any cache started
    free(alloc(1, device=1))
    assert npualloc.memory_stats(1)["max_split_size"] == 30 * MiB


@pytest.mark.parametrize("conf, error", [
    ({"PYTORCH_NPU_ALLOC_CONF": "max_split_size_mb:10"},
     "ValueError: CachingAllocator option max_split_size_mb too small, must be >= 20"),
    ({"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:40"},
     "RuntimeError: `max_split_size_mb` or `garbage_collection_threshold`, cannot be enabled with "
     "`expandable_segments`, please set `expandable_segments` to `False`."),
    ({"PYTORCH_NPU_ALLOC_CONF": "max_split_size_mb:40", "PYTORCH_ALLOC_CONF": "max_split_size_mb:40"},
     "RuntimeError: Both PYTORCH_NPU_ALLOC_CONF and PYTORCH_ALLOC_CONF have been set, please set only one of them."),
])
def test_option_errors_in_a_fresh_process(conf, error):
    code = ("import npualloc\n"
            "assert npualloc.memory_stats() == {}\n"
            "npualloc.caching_allocator_alloc(1)\n")
    r = run_python(code, env=dict(conf, TORCH_NPU_COMPACT_ERROR_OUTPUT="1"))  # no [ERROR] ... suffix
    assert r.returncode == 1
    assert r.stderr.rstrip().splitlines()[-1] == error


def test_allocator_conf_alias_in_a_fresh_process():
    code = ("import npualloc\n"
            "p = npualloc.caching_allocator_alloc(1)\n"
            "print(npualloc.memory_stats()['max_split_size'])\n")
    r = run_python(code, env={"PYTORCH_ALLOC_CONF": "max_split_size_mb:40"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(40 * MiB)
