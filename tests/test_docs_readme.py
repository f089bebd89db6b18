"""README.md as written: its Python examples run in a fresh interpreter with the runtime's defaults and print what
their comments say, the make targets it names exist, and the allocator lab's command runs (when ../shared/traces
is there) and prints what the text after it lists."""
import re

import pytest

from docs_examples import ROOT, blocks, make_targets, printed_claims, run_python

DOC = "README.md"
BLOCKS = blocks(DOC)
PYTHON = [b for b in BLOCKS if b.lang == "python"]
SHELL = [b for b in BLOCKS if b.lang == "sh"]

LAB = "import runpy, sys; sys.argv = ['npualloc'] + sys.argv[1:]; runpy.run_module('npualloc', run_name='__main__')"


def test_the_blocks_are_the_ones_tested_here():
    assert [b.lang for b in BLOCKS] == ["sh", "python", "python", "sh", "python"], BLOCKS


@pytest.mark.parametrize("block", PYTHON, ids=repr)
def test_python_example_prints_what_it_says(block):
    claims = printed_claims(block.text)
    assert claims, f"{block}: no print with its output in a comment"
    proc = run_python(block.text)
    assert proc.returncode == 0, f"{block} failed:\n{proc.stderr}"
    out = iter(proc.stdout.splitlines())
    for claim in claims:        # in order, among the other lines printed (memory_summary's table)
        assert any(line == claim for line in out), f"{block}: {claim!r} not printed:\n{proc.stdout}"


def test_the_make_targets_exist():
    commands = SHELL[0].text
    named = set(re.findall(r"^make (\S+)", commands, re.M))
    assert named == {"demo", "test"}
    prose = (ROOT / DOC).read_text()
    named |= set(re.findall(r"`make ([\w-]+)", prose))
    assert {"bench", "bench-count", "fuzz", "stress"} <= named
    assert named <= make_targets(), named - make_targets()


def test_the_lab_command_runs_and_prints_what_the_text_says(tmp_path):
    command = SHELL[1].text.replace("\\\n", " ")
    words = command.split()
    assert words[:3] == ["python", "-m", "npualloc"], command
    trace = ROOT / words[4]
    if not trace.exists():
        pytest.skip(f"{words[4]} absent")
    args = [a.strip('"') if a != '""' else "" for a in words[3:]]
    args[1] = str(trace)
    args[args.index("--plot") + 1] = str(tmp_path / "timeline.png")
    proc = run_python(LAB, args=args, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "timeline.png").stat().st_size > 0
    out = proc.stdout.splitlines()
    header = next(line for line in out if line.startswith("setting "))
    for column in ("peak req", "peak alloc", "peak active", "peak resv", "frag", "dev allocs", "dev frees", "retries",
                   "OOMs", "wall ms", "Mev/s"):
        assert column in header, column
    rows = [line.split()[0] for line in out if line.split() and line.split()[0] in
            ("(recorded", "default", "expandable_segments:True", "max_split_size_mb:128")]
    assert rows == ["(recorded", "default", "expandable_segments:True", "max_split_size_mb:128"], out
    assert any(line.startswith("least waste: expandable_segments:True, peak reserved ") for line in out), out


def test_on_oom_stop_is_an_option():
    proc = run_python(LAB, args=["replay", "--help"])
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"--on-oom \{[^}]*\bstop\b", proc.stdout), proc.stdout


def test_the_graph_benchmark_named_exists():
    text = (ROOT / DOC).read_text()
    assert "PYTHONPATH=. python3 benchmarks/bench_graph.py [TRACE.pickle ...]" in text
    assert (ROOT / "benchmarks" / "bench_graph.py").is_file()
    assert "1.05" in (ROOT / "tests" / "test_graph.py").read_text()


def test_the_hot_path_test_named_exists():
    assert (ROOT / "tests" / "c" / "test_hot_path.c").is_file()


def test_memory_stats_has_the_pairs_the_text_counts():
    assert "`memory_stats()` builds its 123 pairs" in (ROOT / DOC).read_text()
    proc = run_python("import npualloc; npualloc.caching_allocator_alloc(1); print(len(npualloc.memory_stats()))")
    assert proc.stdout.strip() == "123", proc.stdout + proc.stderr



def test_a_lab_error_is_one_line_with_the_status_the_text_gives(tmp_path):
    text = " ".join((ROOT / DOC).read_text().split())
    assert ("An error is one line on stderr, with exit status 2 for a usage error (the command line itself is wrong, "
            "as argparse reports) and 1 for a run that failed") in text
    trace = tmp_path / "t.pickle"
    made = run_python("import sys, npualloc; from npualloc import memory; memory._record_memory_history(); "
                      "npualloc.caching_allocator_delete(npualloc.caching_allocator_alloc(1 << 20)); "
                      "memory._dump_snapshot(sys.argv[1])", args=[str(trace)])
    assert made.returncode == 0, made.stderr
    for args, status in ((["replay", str(trace), "--bogus"], 2), (["replay", str(tmp_path / "none.pickle")], 1),
                         (["replay", str(trace), "--json", str(tmp_path / "no" / "dir.json")], 1)):
        proc = run_python(LAB, args=args)
        assert proc.returncode == status, (args, proc.returncode, proc.stderr)
        assert len(proc.stderr.splitlines()) == 1, (args, proc.stderr)


def test_the_graph_memory_api_named_exists():
    import inspect

    import npualloc
    text = (ROOT / DOC).read_text().split("## Graph memory", 1)[1].split("\n## ", 1)[0]
    for name in ("set_graph_mem_access", "graph_pool_handle", "use_mem_pool", "MemPool", "Graph", "Stream"):
        assert f"`{name}" in text or f"npualloc.{name}" in text, name
        assert hasattr(npualloc, name), name
    assert {"stream", "access", "pool"} <= set(inspect.signature(npualloc.Graph.capture).parameters)
    assert "checked" in inspect.signature(npualloc.Graph).parameters
    assert "allocator" in inspect.signature(npualloc.MemPool).parameters
    for part in ("`with g.capture(stream=s):`", "`capture(access=...)`", "`Graph(checked=True)`", "`capture(pool=...)`",
                 "`MemPool(allocator=...)`", "`g.instantiate()`", "`launch(s)`"):
        assert part in " ".join(text.split()), part
