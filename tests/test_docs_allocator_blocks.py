"""docs/allocator.md's blocks that are not Python examples (test_docs_allocator.py runs those): the pluggable
allocator's C declarations, built as a library with the doc's command and swapped in as the doc says, and the
pytest plugin's example suite, run as a suite."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from docs_examples import ROOT, blocks, run_python

DOC = "docs/allocator.md"
BLOCKS = blocks(DOC)
TEXT = (ROOT / DOC).read_text()


def _block(lang):
    found = [b for b in BLOCKS if b.lang == lang]
    assert len(found) == 1, found
    return found[0]


# What the declarations leave to the reader: the two functions, on the runtime's own aclrtMalloc / aclrtFree.
DEFINITIONS = r"""
long calls[2];
size_t sizes[2];

void *my_malloc(size_t size, int device, aclrtStream stream)
{
    (void)device, (void)stream;
    void *p = NULL;
    calls[0]++, sizes[0] = size;
    return aclrtMalloc(&p, size, ACL_MEM_MALLOC_HUGE_FIRST) == ACL_SUCCESS ? p : NULL;
}

void my_free(void *ptr, size_t size, int device, aclrtStream stream)
{
    (void)device, (void)stream;
    calls[1]++, sizes[1] = size;
    aclrtFree(ptr);
}
"""

SWAP = r"""
import ctypes, sys
import npualloc
allocator = npualloc.NPUPluggableAllocator(sys.argv[1], "my_malloc", "my_free")
npualloc.change_current_allocator(allocator)
lib = ctypes.CDLL(sys.argv[1])
calls, sizes = (ctypes.c_long * 2).in_dll(lib, "calls"), (ctypes.c_size_t * 2).in_dll(lib, "sizes")
p = npualloc.caching_allocator_alloc(1000)
assert p and list(calls) == [1, 0] and sizes[0] == 1000          # the size asked: no pad, no rounding
npualloc.caching_allocator_delete(p)
assert list(calls) == [1, 1] and sizes[1] == 1000                # what the allocation was
try:
    npualloc.caching_allocator_delete(p + 64)
    raise SystemExit("a foreign pointer freed")
except RuntimeError as e:
    assert str(e).splitlines()[0] == "Trying to free a pointer not allocated here", e   # then torch_npu's [ERROR] line
try:
    npualloc.change_current_allocator(npualloc.NPUPluggableAllocator(sys.argv[1], "my_malloc", "my_free"))
    raise SystemExit("swapped twice")
except RuntimeError as e:
    assert "Can't swap an already initialized allocator" in str(e), e
"""


def test_the_pluggable_allocator_builds_with_the_doc_command_and_is_called(tmp_path):
    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler")
    block = _block("c")
    (tmp_path / "my_allocator.c").write_text(block.text + DEFINITIONS)
    command = re.search(r"Build it with `(cc [^`]*)`", TEXT).group(1)
    assert command == "cc -shared -fPIC -I$(python -m npualloc include) my_allocator.c -o my_allocator.so"
    include = subprocess.run([sys.executable, "-m", "npualloc", "include"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
    command = command.replace("$(python -m npualloc include)", include) + " -std=c11 -Wall -Wextra -Werror"
    subprocess.run(command, shell=True, cwd=tmp_path, check=True)
    proc = run_python(SWAP, args=[str(tmp_path / "my_allocator.so")])
    assert proc.returncode == 0, proc.stderr


def test_the_plugin_example_runs_as_a_suite(tmp_path):
    block = _block("py")
    conftest, suite = block.text.split("# test_memory.py\n")
    assert conftest.startswith("# conftest.py\n")
    (tmp_path / "conftest.py").write_text(conftest)
    # `...`: the test's own work
    body = "    assert npualloc.mem_get_info(0)[1] == 8 << 30\n    npualloc.caching_allocator_alloc(1 << 30)\n"
    assert suite.count("    ...\n") == 1
    (tmp_path / "test_memory.py").write_text(suite.replace("    ...\n", body))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NPUALLOC_", "PYTORCH_"))}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 passed" in proc.stdout, proc.stdout
