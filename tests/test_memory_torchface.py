"""The torch-like face checked against torch / torch_npu where they define the behaviour: device
arguments, argument names, error types and texts (torch.cuda.memory of PyTorch 2.13,
torch_npu/npu/__init__.py and memory.py, c10's device-string parser)."""
import pytest

import npualloc
from conftest_memory import GiB, MiB, mem  # noqa: F401

alloc = npualloc.caching_allocator_alloc
free = npualloc.caching_allocator_delete

TORCH_TYPES = ("cpu, cuda, ipu, xpu, mkldnn, opengl, opencl, ideep, hip, ve, fpga, maia, xla, lazy, vulkan, mps, "
               "meta, hpu, mtia, npu")


# ---- mem_get_info: torch_npu's optional device index and its range check ----

def test_mem_get_info_takes_a_device_without_an_index(mem):
    # torch_npu: _get_device_index(device, optional=True), as torch.cuda.mem_get_info
    npualloc.set_device(1)
    p = alloc(1, device=1)
    assert npualloc.mem_get_info("npu") == (GiB - 2 * MiB, GiB)
    free(p)


@pytest.mark.parametrize("device", [2, 99, -1, "npu:5", 1 << 40])
def test_mem_get_info_rejects_a_device_out_of_range(mem, device):
    # torch_npu: AssertionError("Invalid device id" + pta_error(ErrCode.VALUE))
    with pytest.raises(AssertionError) as err:
        npualloc.mem_get_info(device)
    assert str(err.value) == "Invalid device id"


# ---- set_per_process_memory_fraction: the allocator's device check comes first ----

@pytest.mark.parametrize("device", [2, -1, "npu:7"])
def test_fraction_on_a_device_out_of_range(mem, device):
    index = int(str(device).rpartition(":")[2])
    with pytest.raises(RuntimeError) as err:
        npualloc.set_per_process_memory_fraction(0.5, device)
    assert str(err.value) == f"Allocator not initialized for device {index}: did you call init?"
    assert npualloc.current_device() == 0


def test_nan_fraction_leaves_the_current_device(mem):
    # torch_npu's C++ checks the fraction before c10_npu::SetDevice(device)
    with pytest.raises(RuntimeError, match=r"^invalid fraction:nan\. Please set within \[0, 1\]\.$"):
        npualloc.set_per_process_memory_fraction(float("nan"), 1)
    assert npualloc.current_device() == 0


# ---- caching_allocator_delete(mem_ptr) ----

def test_caching_allocator_delete_takes_mem_ptr_by_keyword(mem):
    p = alloc(1000)
    free(mem_ptr=p)
    assert npualloc.memory_allocated() == 0
    free(mem_ptr=0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'ptr'"):
        free(ptr=p)
    with pytest.raises(TypeError, match="missing required argument 'mem_ptr'"):
        free()
    with pytest.raises(TypeError, match="at most 1 positional"):
        free(p, p)
    with pytest.raises(TypeError, match="multiple values"):
        free(p, mem_ptr=p)


# ---- memory_snapshot(mempool_id) ----

def test_memory_snapshot_default_pool_id_means_every_segment(mem):
    # torch's snapshot(mempool_id): (0, 0) returns the blocks of every pool, private ones too
    p = alloc(1000)
    pool = npualloc.MemPool()
    with npualloc.use_mem_pool(pool):
        q = alloc(1000)
    everything = npualloc.memory_snapshot()
    assert len(everything) == 2
    assert npualloc.memory_snapshot((0, 0)) == everything
    assert [s["segment_pool_id"] for s in npualloc.memory_snapshot(pool.id)] == [pool.id]
    assert npualloc.memory_snapshot((5, 5)) == []
    free(p)
    free(q)


@pytest.mark.parametrize("bad", ["ab", 5, (1,), (1, "x")])
def test_memory_snapshot_rejects_a_malformed_pool_id(mem, bad):
    with pytest.raises(TypeError):
        npualloc.memory_snapshot(bad)


def test_mempool_stats_keep_counting_the_default_pool_only(mem):
    p = alloc(1000)
    pool = npualloc.MemPool()
    with npualloc.use_mem_pool(pool):
        q = alloc(3000)
    assert npualloc.mempool_stats((0, 0))["allocated_bytes.all.current"] == 1536
    assert npualloc.mempool_stats(pool)["allocated_bytes.all.current"] == 3072
    free(p)
    free(q)


# ---- device strings: c10's parser ----
# (the statistics readers parse their device only once the runtime has started, as torch's)

@pytest.fixture
def started(mem):
    npualloc.current_device()
    return mem


@pytest.mark.parametrize("text", [" npu:0", "npu:0 ", "npu:01", "npu:", "npu:-1", "npu:+1", "npu:1a", "1"])
def test_malformed_device_strings(started, text):
    with pytest.raises(RuntimeError) as err:
        npualloc.memory_allocated(text)
    assert str(err.value) == f"Invalid device string: '{text}'"


def test_empty_device_string(started):
    with pytest.raises(RuntimeError) as err:
        npualloc.memory_stats("")
    assert str(err.value) == "Device string must not be empty"


@pytest.mark.parametrize("text, kind", [("gpu:0", "gpu"), ("NPU:0", "NPU"), ("npu_x", "npu_x")])
def test_unknown_device_types(started, text, kind):
    with pytest.raises(RuntimeError) as err:
        npualloc.memory_reserved(text)
    assert str(err.value) == f"Expected one of {TORCH_TYPES} device type at start of device string: {kind}"


def test_known_device_types_that_are_not_npu(started):
    for text in ("cuda:0", "cpu", "meta"):
        with pytest.raises(ValueError, match=f"^Expected a npu device, but got: {text}$"):
            npualloc.memory_reserved(text)
    assert npualloc.memory_allocated("npu:1") == 0 and npualloc.memory_allocated("npu") == 0


# ---- use_mem_pool / MemPool errors: the allocator's message, as torch raises it ----

def test_use_mem_pool_errors_carry_torchs_message_alone(mem):
    pool = npualloc.MemPool()
    with npualloc.use_mem_pool(pool):
        with pytest.raises(RuntimeError) as err:
            with npualloc.use_mem_pool(pool):
                pass
    assert str(err.value) == "beginAllocateToPool: already recording to mempool_id"
    with pytest.raises(RuntimeError) as err:
        with npualloc.use_mem_pool(pool, device=5):
            pass
    assert str(err.value) == "Invalid device argument 5: did you call init?"
    assert pool.use_count() == 1


# ---- get_per_process_memory_fraction: torch's device handling ----

def test_get_fraction_needs_a_device_index(mem):
    npualloc.set_per_process_memory_fraction(0.25, 1)
    assert npualloc.get_per_process_memory_fraction() == 0.25
    assert npualloc.get_per_process_memory_fraction("npu:0") == 1.0
    with pytest.raises(ValueError) as err:
        npualloc.get_per_process_memory_fraction("npu")
    assert str(err.value) == "Expected a torch.device with a specified index or an integer, but got:npu"


# ---- record_stream(ptr, None) ----

def test_record_stream_refuses_none_like_buffer_record_stream(mem):
    p = alloc(100, device=1)
    b = npualloc.empty(100, device=1)
    for call in (lambda: npualloc.record_stream(p, None), lambda: b.record_stream(None),
                 lambda: npualloc.record_stream(b, None)):
        with pytest.raises(TypeError) as err:
            call()
        assert str(err.value) == "record_stream(): argument 'stream' must be npualloc.Stream or int"
    s = npualloc.Stream(device=1)
    npualloc.record_stream(p, s)
    free(p)
    b.free()
    s.synchronize()


# ---- device -1: torch_npu's "current device" where it passes -1 on ----

def test_device_minus_one_is_the_current_device_where_torch_npu_passes_it_on(mem):
    npualloc.set_device(1)
    p = alloc(100, device=-1)    # current_stream(-1), then raw_alloc on the current device
    assert npualloc.memory_allocated(1) == 512 and npualloc.memory_allocated(0) == 0
    free(p)
    npualloc.synchronize(-1)     # torch_npu: `with device(-1)` is a no-op
    with pytest.raises(RuntimeError):
        npualloc.synchronize(-2)
    with pytest.raises(RuntimeError, match="^Invalid device argument -1: did you call init\\?$"):
        npualloc.memory_stats(-1)


# ---- mempool_stats / mempool_summary on a device out of range ----

@pytest.mark.parametrize("device", [2, -1, "npu:9"])
def test_mempool_stats_refuse_a_device_out_of_range(mem, device):
    pool = npualloc.MemPool()
    index = int(str(device).rpartition(":")[2])
    for call in (npualloc.mempool_stats, npualloc.mempool_summary):
        with pytest.raises(RuntimeError) as err:
            call(pool, device)
        assert str(err.value) == f"Invalid device argument {index}: did you call init?"
    assert npualloc.mempool_stats(pool, 1)["reserved_bytes.all.current"] == 0


# ---- signatures: torch's Python functions have them, so the C ones here give theirs ----

@pytest.mark.parametrize("fn, text", [(npualloc.caching_allocator_alloc, "(size, device=None, stream=None)"),
                                      (npualloc.caching_allocator_delete, "(mem_ptr)"),
                                      (npualloc.empty, "(nbytes, device=None, stream=None)"),
                                      (npualloc.parse_size, "(text, /)")])
def test_c_functions_have_torchs_signatures(fn, text):
    import inspect
    assert str(inspect.signature(fn)) == text
    assert fn.__doc__.splitlines()[0].strip()  # help() shows a description, not only the signature


def test_the_signatures_keywords_are_accepted(mem):
    p = alloc(size=1000, device=0, stream=None)
    free(mem_ptr=p)
    with npualloc.empty(nbytes=100, device=0, stream=None) as b:
        assert b.nbytes == 100
    with pytest.raises(TypeError):
        npualloc.parse_size(text="1KiB")  # positional only, as the signature says


def test_a_device_or_pointer_beyond_the_c_types_gets_one_message(mem):
    """Beyond 32 bits (a device) or 64 (a pointer) the same OverflowError; past 64 bits it was Python's own
    "int too large to convert to C long"."""
    free(alloc(1000))  # started: memory_stats() of a runtime not started is {} whatever the device
    for device in (2**31, 2**63, -2**63 - 1, 2**70):
        with pytest.raises(OverflowError, match=r"^memory_stats\(\): argument 'device' is out of range$"):
            npualloc.memory_stats(device)
    for ptr in (2**64, -2**64, 2**100):
        with pytest.raises(OverflowError, match=r"^caching_allocator_delete\(\): argument 'mem_ptr' is out of range$"):
            npualloc.caching_allocator_delete(ptr)


def test_parse_size_refuses_what_follows_a_nul():
    assert npualloc.parse_size("8 KiB") == 8192
    with pytest.raises(ValueError, match=r"^'8\\x00 KiB' is not a size"):  # it read "8" and gave 8
        npualloc.parse_size("8\x00 KiB")
