"""docs/reliability.md, and what every doc says about the make targets: each `make ...` a doc names is a target of
the Makefile (none is run here: they are the long ones), the Makefile's variables have the defaults the doc gives,
the fault switch's examples work as written, every fenced block of every doc is one a test_docs_* module runs, and
every Python name (`npualloc.*`, `acl.rt.*`, `memory._*`) and C name (`aclrt*`, `npualloc_*`, `ACL_*`) a doc gives
exists."""
import re
from collections import Counter

from docs_examples import DOCS, ROOT, blocks, make_targets, run_python

TEXT = (ROOT / "docs" / "reliability.md").read_text()
MAKEFILE = (ROOT / "Makefile").read_text()


def test_every_make_target_a_doc_names_exists():
    named = set()
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for command in re.findall(r"`make ([^`]+)`", text) + re.findall(r"^make (.+?)(?:\s+#.*)?$", text, re.M):
            named.update(w for w in command.split() if "=" not in w)    # make CC=clang BUILD=... ctest-tsan
    assert {"test", "fuzz", "stress", "valgrind", "pytest-asan", "ctest-tsan", "ctest-asan", "lib", "demo", "bench",
            "bench-count"} <= named
    assert named <= make_targets(), named - make_targets()


def test_the_makefile_variables_have_the_defaults_the_doc_gives():
    defaults = dict(re.findall(r"^(\w+)\s*\?=\s*(\S*)", MAKEFILE, re.M))
    assert "`FUZZ_CI_SECONDS` (10 s" in TEXT and defaults["FUZZ_CI_SECONDS"] == "10"
    assert "`FUZZ_SECONDS` (60 s" in TEXT and defaults["FUZZ_SECONDS"] == "60"
    assert "`FUZZ_JOBS=2` runs two at once" in TEXT and "FUZZ_JOBS=$(FUZZ_JOBS)" in MAKEFILE
    assert "8 threads x 1M operations" in TEXT and "(`STRESS_THREADS`, `STRESS_OPS`)" in TEXT
    assert defaults["STRESS_THREADS"] == "8" and defaults["STRESS_OPS"] == "1000000"
    assert '`VALGRIND_SKIP="test_x ..."`' in TEXT and "VALGRIND_SKIP" in defaults


def test_the_fault_switch_examples():
    assert '`NPUALLOC_FAULT="device_alloc:3,map:5"`' in TEXT
    assert '`with npualloc.faults.inject("map", 3): ...`' in TEXT
    armed = run_python("""
import npualloc
for n in range(5):
    npualloc.caching_allocator_alloc(64 << 20)     # a segment each: the third fails once, so does the fifth
                                                   # map, and the allocator's retry makes each
assert npualloc.faults.counts("device_alloc")[1] == 1 and npualloc.faults.counts("map")[1] == 1
assert npualloc.memory_stats()["num_alloc_retries"] == 2
""", env={"NPUALLOC_FAULT": "device_alloc:3,map:5"})
    assert armed.returncode == 0, armed.stderr
    for malformed in ("device_alloc", "map:-1", "map: 5", "map:+5", "map:99999999999999999999"):
        bad = run_python("import npualloc; npualloc.caching_allocator_alloc(1)", env={"NPUALLOC_FAULT": malformed})
        assert f"NPUALLOC_FAULT='{malformed}' is malformed" in bad.stderr, bad.stderr
    inject = run_python("""
import npualloc
from npualloc import acl
acl.rt.set_device(0)
prop = {"handleType": 0, "allocationType": 0, "memAttr": 4, "location": {"id": 0, "type": 1}, "reserve": 0}
h, ret = acl.rt.malloc_physical(2 << 20, prop, 0)
va, ret = acl.rt.reserve_mem_address(2 << 20, 0, 0, 0)
with npualloc.faults.inject("map", 1):
    assert acl.rt.map_mem(va, 2 << 20, 0, h, 0) != 0
assert acl.rt.map_mem(va, 2 << 20, 0, h, 0) == 0
""")
    assert inject.returncode == 0, inject.stderr


# The blocks of each doc and the module that runs them (each module also checks its doc's list itself).
RUN_BY = {
    "README.md": ({"sh": 2, "python": 3}, "test_docs_readme.py"),
    "docs/allocator.md": ({"python": None, "c": 1, "py": 1}, "test_docs_allocator.py, test_docs_allocator_blocks.py"),
    "docs/runtime.md": ({"c": 1, "sh": 1}, "test_docs_runtime.py"),
    "docs/sharing.md": ({"python": 3}, "test_docs_sharing.py"),
    "docs/reliability.md": ({}, "this module"),
    "benchmarks/README.md": ({"sh": 1, "": 1}, "test_docs_benchmarks.py"),
}


def test_every_block_of_every_doc_is_run_by_a_test():
    assert set(RUN_BY) == set(DOCS)
    for doc, (expected, module) in RUN_BY.items():
        found = Counter(b.lang for b in blocks(doc))
        for lang, count in expected.items():
            if count is None:       # test_docs_allocator.py runs every ```python block, however many
                found.pop(lang, None)
            else:
                assert found.pop(lang, 0) == count, (doc, lang, module)
        assert not found, f"{doc}: blocks no test runs: {dict(found)} (add them to {module})"
    runtime = (ROOT / "docs" / "runtime.md").read_text().split("## Using npualloc from C", 1)[1].split("\n## ", 1)[0]
    assert [b.lang for b in blocks("docs/runtime.md")] == re.findall(r"^```(\w+)", runtime, re.M) == ["c", "sh"]


# Names in the docs that are not the code's on purpose: prefixes (`ACL_MEM_*`), the pytest fixture, the functions
# runtime.md says npualloc leaves out, and the `npualloc.h` header (a file, not a module).
LEFT_OUT = {"aclrtStreamWaitEventWithTimeout", "aclGetRecentErrMsg", "acl.get_recent_err_msg"}
NOT_NAMES = {"ACL_DDR_MEM_", "ACL_HBM_MEM_P2P_", "ACL_MEM_", "ACL_MEM_P2P_", "aclrtIpcMem", "npualloc_runtime",
             "npualloc.h", "acl.rt.synchronize_", "acl.rt.NAME"} | LEFT_OUT


def test_the_functions_the_docs_leave_out_are_absent():
    from npualloc import acl

    header = (ROOT / "csrc" / "include" / "acl_rt.h").read_text()
    for name in LEFT_OUT:
        if name.startswith("acl."):
            owner = acl.rt if name.startswith("acl.rt.") else acl
            assert not hasattr(owner, name.split(".")[-1]), name
        else:
            assert not re.search(rf"\b{name}\b", header), name


def test_every_name_the_docs_give_exists():
    import importlib

    import npualloc
    from npualloc import _C, acl, memory
    headers = "".join(p.read_text() for p in (ROOT / "csrc" / "include").rglob("*.h"))
    roots = {"npualloc": npualloc, "acl": acl, "memory": memory, "_C": _C}
    missing = set()
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for m in re.finditer(r"\b((?:npualloc|acl|memory|_C)(?:\.\w+)+)", text):
            if m.group(1) in NOT_NAMES or m.group(1).startswith(("acl.h", "acl.rt.h")):
                continue
            obj, *rest = m.group(1).split(".")
            obj = roots[obj]
            for part in rest:
                try:
                    obj = getattr(obj, part) if hasattr(obj, part) else importlib.import_module(f"{obj.__name__}.{part}")
                except (ImportError, AttributeError):
                    missing.add((doc, m.group(1)))
                    break
        for code in re.findall(r"`[^`]*`", text):
            for name in re.findall(r"\b((?:aclrt|npualloc_|acl[A-Z])\w+|ACL_[A-Z0-9_]+|NPUALLOC_STAT_\w+)\b", code):
                if name not in NOT_NAMES and not re.search(rf"\b{name}\b", headers):
                    missing.add((doc, name))
    assert not missing, sorted(missing)
