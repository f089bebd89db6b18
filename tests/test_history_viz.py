"""Optional: PyTorch's own memory viewer (torch.cuda._memory_viz) reads a snapshot dumped by
npualloc.  Skipped when torch is not installed (it is not a dependency of npualloc); the
functions used work on CPU-only builds of torch.

torch/cuda/_memory_viz.py needs only the standard library for what is used here, so it is loaded
from the installed torch by itself (importing all of torch takes seconds); if that ever fails,
the module is imported the ordinary way."""
import base64
import importlib.util
import io
import json
import pickle
import re
from pathlib import Path

import pytest

import npualloc
from conftest_memory import MiB, mem  # noqa: F401


def _load_memory_viz():
    spec = importlib.util.find_spec("torch")  # finds the package without running it
    if spec is None or not spec.origin:
        pytest.skip("torch is not installed", allow_module_level=True)
    path = Path(spec.origin).parent / "cuda" / "_memory_viz.py"
    try:
        mod_spec = importlib.util.spec_from_file_location("_npualloc_test_torch_memory_viz", path)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
        return module
    except Exception:  # a torch whose viewer needs torch itself
        return pytest.importorskip("torch.cuda._memory_viz")


viz = _load_memory_viz()

memory = npualloc.memory


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"global {module}.{name} refused")


def _no_globals_load(data):
    return _NoGlobals(io.BytesIO(data)).load()


def _flamegraph_lines(text):
    """format_flamegraph's input as given (torch would pipe it to flamegraph.pl)."""
    return text


def make_weights():
    return [npualloc.caching_allocator_alloc(4 * MiB) for _ in range(2)]


def make_activations():
    return [npualloc.empty(64 * 1024) for _ in range(4)]


def drop_activations(acts):
    acts.clear()


@pytest.fixture
def dumped(mem, tmp_path):
    """A small workload recorded with every stack and dumped with _dump_snapshot: (path, weights)."""
    memory._record_memory_history()
    try:
        weights = make_weights()
        acts = make_activations()
        drop_activations(acts)
        keep = make_activations()
        path = tmp_path / "npualloc_snapshot.pickle"
        memory._dump_snapshot(str(path))
        yield path, keep
    finally:
        memory._record_memory_history(None)
    for p in weights:
        npualloc.caching_allocator_delete(p)


def test_torch_reads_the_snapshot(dumped):
    path, _ = dumped
    data = _no_globals_load(path.read_bytes())

    segs = viz.segments(data, format_flamegraph=_flamegraph_lines)
    assert "make_weights" in segs and "make_activations" in segs
    for line in segs.splitlines():  # stream_<s>;seg_<addr>;<state>;<frames> <bytes>
        assert re.fullmatch(r"stream_\d+;seg_\d+;(active_allocated|inactive|active_pending_free);.* \d+", line)
    mem_lines = viz.memory(data, format_flamegraph=_flamegraph_lines)
    assert "test_history_viz.py" in mem_lines and "make_weights" in mem_lines
    assert "drop_activations" not in mem_lines  # freed blocks carry no stack

    summary = viz.segsum(data)  # checks that blocks tile the segments and that sizes add up
    assert f"segments: {len(data['segments'])}\n" in summary
    assert re.search(r"^\[\S+\s*\] 20\.0MiB allocated", summary, re.M)  # the weights' segment
    text = viz.trace(data)
    assert "entries" in text and "cudaMalloc(" in text  # the history, as torch prints it
    assert "TOTAL MEM" in text


def test_snapshot_has_torch_2_6_keys_and_torch_reads_it(dumped):
    """torch >= 2.6 snapshots carry "external_annotations" (a list of record_function annotations,
    which the memory_viz page reads); npualloc records none, so the list is empty."""
    path, _ = dumped
    data = _no_globals_load(path.read_bytes())
    assert set(data) == {"segments", "device_traces", "allocator_settings", "external_annotations"}
    assert data["external_annotations"] == []
    html = viz.trace_plot(data)  # the page gets the key with the rest of the snapshot
    files = json.loads(re.search(r"const local_files = (\[.*\])", html).group(1))
    embedded = _no_globals_load(base64.b64decode(files[0]["base64"]).rstrip(b"\0"))
    assert embedded["external_annotations"] == []
    assert "TOTAL MEM" in viz.trace(data) and viz.segsum(data)


@pytest.mark.parametrize("plot", ["trace_plot", "segment_plot"])
def test_torch_plots_embed_the_snapshot(dumped, plot):
    path, _ = dumped
    data = _no_globals_load(path.read_bytes())
    html = getattr(viz, plot)(data)
    assert html.lstrip().startswith("<!DOCTYPE html>")
    files = json.loads(re.search(r"const local_files = (\[.*\])", html).group(1))
    embedded = base64.b64decode(files[0]["base64"]).rstrip(b"\0")
    again = _no_globals_load(embedded)  # what the web viewer unpickles: still plain data
    assert again == data
    assert b"make_activations" in embedded and b"drop_activations" in embedded


def test_torch_compares_two_snapshots(mem):
    memory._record_memory_history()
    try:
        before = memory._snapshot()
        weights = make_weights()
        after = memory._snapshot()
    finally:
        memory._record_memory_history(None)
    text = viz.compare(before["segments"], after["segments"], format_flamegraph=_flamegraph_lines)
    assert text.startswith("only_after;stream_0;seg_") and "make_weights" in text
    assert "only_before" not in text
    for p in weights:
        npualloc.caching_allocator_delete(p)
