"""benchmarks/README.md as written, without running a benchmark (their figures are measurements): the commands of
its block name targets, programs and options that exist, every program of its tables is there, and the lines its
tables and its sample output name are the lines the programs print."""
import re
import subprocess
import sys

from docs_examples import ROOT, blocks, make_targets

DOC = "benchmarks/README.md"
BLOCKS = blocks(DOC)
TEXT = (ROOT / DOC).read_text()
BENCH = ROOT / "benchmarks"


def test_the_blocks_are_the_ones_tested_here():
    assert [b.lang for b in BLOCKS] == ["sh", ""], BLOCKS


def _options(program):
    """The options a C benchmark's main() compares its arguments with."""
    return set(re.findall(r'strcmp\(argv\[(?:i|1)\], "(--[\w-]+)"\)', (BENCH / f"{program}.c").read_text()))


def test_the_commands_exist():
    lines = [line.split("#")[0].split() for line in BLOCKS[0].text.splitlines()]
    assert [words[:2] for words in lines] == [["make", "bench"], ["python3", "benchmarks/run.py"],
                                              ["build/release/bench/bench_hotpath", "EVENTS"],
                                              ["build/release/bench/bench_hotpath", "EVENTS"]]
    assert {"bench", "bench-count"} <= make_targets()
    assert "$(BUILD)/lto/libnpualloc.a" in (ROOT / "Makefile").read_text()
    proc = subprocess.run([sys.executable, "benchmarks/run.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    skip = re.search(r"--skip \[\{([\w,]+)\}", proc.stdout).group(1).split(",")
    assert lines[1][2] == "--skip" and set(lines[1][3:]) <= set(skip), (lines[1], skip)
    for words in lines[2:]:
        assert set(w for w in words if w.startswith("--")) <= _options("bench_hotpath"), words
    assert (BENCH / "count_hotpath.py").is_file()


def test_the_programs_of_the_tables_exist():
    named = set(re.findall(r"`(?:benchmarks/)?(\w+\.py|bench_\w+)`", TEXT))
    named |= set(re.findall(r"^## (bench_\w+)", TEXT, re.M))
    assert {"bench_hotpath", "bench_caching", "bench_python.py", "bench_threads", "bench_replay", "run.py",
            "bench_graph.py", "bench_ipc", "bench_runtime", "count_hotpath.py"} <= named
    for name in named:
        assert (BENCH / (name if name.endswith(".py") else name + ".c")).is_file(), name
    # "Each C program also runs alone (`--json` ...)"
    for program in (p.stem for p in BENCH.glob("bench_*.c")):
        if program != "bench_runtime":
            assert "--json" in _options(program), program


def test_the_sample_names_the_lines_bench_runtime_prints():
    source = (BENCH / "bench_runtime.c").read_text()
    sample = BLOCKS[1].text.splitlines()
    assert sample[0] == "npualloc bench_runtime: 1 device, 64 GiB HBM; median of 5 repetitions of ~70 ms"
    assert "#define REPS 5" in source and "#define TARGET_NS 70000000.0" in source
    assert sample[1].split() == ["operation", "ops/rep", "ms/rep", "ns/op"]
    for line in sample[2:-1]:
        name = re.match(r"\s*(.*?)\s+\d+\s+[\d.]+\s+[\d.]+", line).group(1)
        assert f'"{name}' in source or f'"  {name}' in source, name
    assert sample[-1].startswith("total ") and '"total %.1f s\\n"' in source


def test_the_tables_name_the_lines_the_programs_print():
    runtime = (BENCH / "bench_runtime.c").read_text()
    section = TEXT.split("## bench_runtime", 1)[1].split("\n## ", 1)[0]
    for cell in re.findall(r"^\| (`.*?) \|", section, re.M):
        for name in re.findall(r"`([^`]+)`", cell):
            for part in name.split(" / "):     # `aclrtMalloc+aclrtFree 4 KiB / 2 MiB / 64 MiB (HUGE_FIRST)`
                assert part.split(" (")[0].split()[0] in runtime, part
    ipc = (BENCH / "bench_ipc.c").read_text()
    reports = re.findall(r'report\("([^"]+)"', ipc)
    section = TEXT.split("## bench_ipc", 1)[1]
    for cell in re.findall(r"^\| (`.*?) \|", section, re.M):
        for name in re.findall(r"`([^`]+)`", cell):
            # `one process: memcpy`, `read`, `write then read`: one prefix for three lines
            assert any(r.startswith(name) or r.startswith("one process: " + name) for r in reports), name
