"""docs/allocator.md as written: every ```python example runs (each in a fresh interpreter, checking its own
claims with assert), the settings table lists exactly the keys the PYTORCH_NPU_ALLOC_CONF parser accepts, and
its "example", "run time" and "shown as" columns say what the parser really does with each key."""
import json
import re
from pathlib import Path

import pytest

from conftest_memory import run_python

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "allocator.md"
PARSER = ROOT / "csrc" / "alloc_conf.c"

EXAMPLES = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), re.S | re.M)


# ---- the examples ----

def test_the_doc_has_checked_examples():
    assert 3 <= len(EXAMPLES) <= 6
    for code in EXAMPLES:
        assert "assert " in code, "every example checks what it claims:\n" + code


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_example_runs(index):
    proc = run_python(EXAMPLES[index])
    assert proc.returncode == 0, f"example {index} failed:\n{EXAMPLES[index]}\n{proc.stderr}"


# ---- the settings table ----

def _table():
    """{key: (example, run_time, shown_as)} from the table under "## Settings"."""
    text = DOC.read_text()
    section = text.split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        key = cells[0].strip("`")
        example = cells[1].strip("`")
        assert key not in rows, f"{key} listed twice"
        assert cells[4] in ("yes", "no"), line
        shown = set(re.findall(r"`(\w+)`", cells[5]))
        assert shown or cells[5] == "-", line
        rows[key] = (example, cells[4] == "yes", shown)
    return rows


def _c_list(name):
    body = re.search(r"static const char \*const " + name + r"\[\] = \{(.*?)\};", PARSER.read_text(), re.S).group(1)
    return re.findall(r'"(\w+)"', body)


def test_the_table_lists_exactly_the_accepted_keys():
    table = _table()
    accepted = _c_list("c10_supported_keys") + _c_list("npu_keys")
    assert accepted and len(accepted) == len(set(accepted))
    assert set(table) == set(accepted)
    assert {k for k, (_, rt, _) in table.items() if rt} == set(_c_list("runtime_keys"))
    for key, (example, _, _) in table.items():
        assert example.split(":", 1)[0] == key


# One interpreter tries every row: at start-up (from the variable, after a restart of the runtime, as the doc
# says it is read at the first use) and at run time (_set_allocator_settings on a fresh runtime).
PROBE = r"""
import json, os, sys, warnings
import npualloc
from npualloc import _C, memory

warnings.simplefilter("ignore")
os.environ["TORCH_NPU_COMPACT_ERROR_OUTPUT"] = "1"  # torch_npu's messages without the [ERROR] ... suffix

def fresh(conf):
    _C.shutdown()
    os.environ.pop("PYTORCH_NPU_ALLOC_CONF", None)
    if conf is not None:
        os.environ["PYTORCH_NPU_ALLOC_CONF"] = conf
    npualloc.configure(device_count=1, device_memory="1GiB")

def outcome(fn):
    try:
        fn()
        return "ok"
    except Exception as e:
        return f"{type(e).__name__}: {e}"

def settings():
    s = dict(memory._snapshot()["allocator_settings"])
    del s["PYTORCH_NPU_ALLOC_CONF"]
    return s

def first_use():
    npualloc.caching_allocator_delete(npualloc.caching_allocator_alloc(1))

fresh(None)
first_use()
default = settings()
out = {}
for text in json.loads(sys.argv[1]):
    fresh(text)
    start = outcome(first_use)
    changed = sorted(k for k, v in settings().items() if v != default[k]) if start == "ok" else None
    fraction = npualloc.get_per_process_memory_fraction() if start == "ok" else None
    fresh(None)
    first_use()
    out[text] = {"start": start, "changed": changed, "fraction": fraction,
                 "runtime": outcome(lambda: memory._set_allocator_settings(text))}
print(json.dumps(out))
"""


def test_the_table_says_what_the_parser_does():
    table = _table()
    texts = [ex for ex, _, _ in table.values()] + ["no_such_key:1", "pinned_free_catch_all:True",
                                                   "max_split_size_mb:10"]
    proc = run_python(PROBE, args=[json.dumps(texts)])
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    for key, (example, run_time, shown) in table.items():
        got = seen[example]
        assert got["start"] == "ok", (example, got)                  # accepted at start-up
        assert set(got["changed"]) == shown, (example, got)           # and shown as the table says
        if run_time:
            assert got["runtime"] == "ok", (example, got)
        else:
            assert got["runtime"] == ("RuntimeError: torch_npu.npu.memory._set_allocator_settings() unsupported "
                                      f"setting: {key}"), (example, got)
    assert seen["per_process_memory_fraction:0.5"]["fraction"] == 0.5
    # what the doc says about malformed text
    assert seen["no_such_key:1"]["start"] == "ValueError: Unrecognized key 'no_such_key' in NPU allocator config, "
    assert seen["pinned_free_catch_all:True"]["start"] == (
        "RuntimeError: torch_npu not support key 'pinned_free_catch_all' in NPU allocator config, ")
    assert seen["max_split_size_mb:10"]["start"] == (
        "ValueError: CachingAllocator option max_split_size_mb too small, must be >= 20")


def test_settings_are_read_at_first_use_and_errors_repeat():
    code = """
import os, npualloc
from npualloc import memory
assert npualloc.memory_stats() == {}          # the runtime has not started: nothing read, nothing raised
os.environ["PYTORCH_NPU_ALLOC_CONF"] = "max_split_size_mb:10"
for call in (lambda: npualloc.caching_allocator_alloc(1), npualloc.memory_stats,
             lambda: memory._set_allocator_settings("max_split_size_mb:40"), memory._snapshot,
             npualloc.memory_snapshot):
    try:
        call()
        raise SystemExit("no error")
    except ValueError as e:
        assert str(e) == "CachingAllocator option max_split_size_mb too small, must be >= 20", e
"""
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    both = run_python("import npualloc; npualloc.caching_allocator_alloc(1)",
                      env={"PYTORCH_NPU_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": ""})
    assert both.returncode == 1
    lines = both.stderr.rstrip().splitlines()
    assert lines[-2] == (
        "RuntimeError: Both PYTORCH_NPU_ALLOC_CONF and PYTORCH_ALLOC_CONF have been set, please set only one of them.")
    assert re.fullmatch(r"\[ERROR\] \S+ \(PID:\d+, Device:0, RankID:-?\d+\) ERR01003 OPS invalid value", lines[-1]), lines


def test_run_time_settings_reset_the_c10_options():
    code = """
from npualloc import memory
import npualloc
npualloc.caching_allocator_delete(npualloc.caching_allocator_alloc(1))
memory._set_allocator_settings("release_lock_on_npumalloc:True")     # an NPU key: nothing reset
s = memory._snapshot()["allocator_settings"]
assert s["garbage_collection_threshold"] == 0.6 and s["max_split_size"] == 40 << 20, s
assert s["max_non_split_rounding_size"] == 40 << 20 and s["roundup_power2_divisions"]["1"] == 4, s
memory._set_allocator_settings("expandable_segments:True")          # a c10 key: c10's pass resets
s = memory._snapshot()["allocator_settings"]
assert s["garbage_collection_threshold"] == 0 and s["max_split_size"] == -1, s
assert s["roundup_power2_divisions"]["1"] == 0 and s["max_non_split_rounding_size"] == 32 << 20, s
assert s["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True" and s["release_lock_on_npumalloc"] is True
assert npualloc.memory_stats()["max_split_size"] == 40 << 20         # fixed when the device's cache started
"""
    proc = run_python(code, env={"PYTORCH_NPU_ALLOC_CONF": "max_split_size_mb:40,garbage_collection_threshold:0.6,"
                                 "roundup_power2_divisions:4,large_segment_size_mb:32,max_non_split_rounding_mb:40"})
    assert proc.returncode == 0, proc.stderr


def _anchors(path):
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", path.read_text(), re.M)}


def test_links_resolve():
    text = DOC.read_text()
    for target, anchor in re.findall(r"\]\(([^)#]*)(?:#([^)]*))?\)", text):
        path = (DOC.parent / target).resolve() if target else DOC
        assert path.exists(), target
        if anchor:
            assert anchor in _anchors(path), (target, anchor)
