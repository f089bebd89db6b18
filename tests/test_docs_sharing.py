"""docs/sharing.md as written: each of its three examples (an exporting part, then an importing part) runs in two
processes, with the doc's lines as they are: every `ret` they get is 0, and the importer reads, at the pointer the
example gives it, the bytes the exporter wrote. The glue only fills in what the doc leaves to the reader (the size,
the property, the pid, carrying the value across) and puts the check where the doc writes `...`."""
import ast
import os
import re
import subprocess
import sys

import pytest

from docs_examples import ROOT, blocks

DOC = "docs/sharing.md"
BLOCKS = blocks(DOC)

PRELUDE = """
import os, pickle, sys
import npualloc
from npualloc import acl
acl.rt.set_device(0)
size = nbytes = 2 << 20
prop = {"handleType": 0, "allocationType": 0, "memAttr": 4, "location": {"id": 0, "type": 1}, "reserve": 0}
"""

# per example: (what the exporter sends, how it fills the memory, the importer's pointer)
GLUE = [
    ("sh", "w, r = acl.rt.reserve_mem_address(size, 0, 0, 0); assert r == 0\n"
           "assert acl.rt.map_mem(w, size, 0, handle, 0) == 0\n"
           "assert acl.rt.memset(w, size, 0x5A, size) == 0\n", "va"),
    ("key", "assert acl.rt.memset(ptr, size, 0x5A, size) == 0\n", "p"),
    ("handle", "assert acl.rt.memset(ptr, nbytes, 0x5A, nbytes) == 0\n", "p"),
]


def test_the_blocks_are_the_ones_tested_here():
    assert [b.lang for b in BLOCKS] == ["python"] * len(GLUE), BLOCKS


def _checked(code, check="raise SystemExit('no check')"):
    """The doc's lines, each `ret` they get asserted 0 (also of the acl.rt calls whose result they drop), `check`
    in place of `...`."""
    out = []
    for stmt in ast.parse(code).body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and stmt.value.value is Ellipsis:
            out.append(check)
            continue
        if isinstance(stmt, ast.Expr) and ast.unparse(stmt.value.func if isinstance(stmt.value, ast.Call)
                                                       else stmt.value).startswith("acl.rt."):
            stmt = ast.Assign(targets=[ast.Name("ret")], value=stmt.value, lineno=0)
        out.append(ast.unparse(stmt))
        if "ret" in {n.id for t in getattr(stmt, "targets", ()) for n in ast.walk(t) if isinstance(n, ast.Name)}:
            out.append(f"assert ret == 0, ({out[-1]!r}, ret)")
    return "\n".join(out) + "\n"


def _parts(block):
    """(exporter, importer): the block split at its second top-level comment."""
    lines = block.text.splitlines(keepends=True)
    heads = [i for i, line in enumerate(lines) if line.startswith("# ")]
    assert len(heads) == 2 and heads[0] == 0, block
    return "".join(lines[:heads[1]]), "".join(lines[heads[1]:])


@pytest.mark.parametrize("index", range(len(GLUE)))
def test_example_shares_memory_between_two_processes(index):
    block = BLOCKS[index]
    sent, fill, pointer = GLUE[index]
    exporter, importer = _parts(block)
    assert importer.count("\n...\n") == 1, block
    exporter_code = (PRELUDE + "pid_of_b = int(sys.argv[1])\n" + _checked(exporter) + fill
                     + f"print(pickle.dumps({sent}).hex(), flush=True)\nsys.stdin.readline()\n")
    importer_code = (PRELUDE + "print(os.getpid(), flush=True)\n"
                     + f"{sent} = pickle.loads(bytes.fromhex(sys.stdin.readline()))\n"
                     + _checked(importer, f"assert acl.util.ptr_to_bytes({pointer}, 16) == b'Z' * 16")
                     + ("assert pid == os.getpid()\n" if "device_get_bare_tgid" in importer else "")
                     + "print('read', flush=True)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NPUALLOC_", "PYTORCH_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    opts = dict(cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    b = subprocess.Popen([sys.executable, "-c", importer_code], **opts)
    a = None
    try:
        pid = b.stdout.readline().strip()
        assert pid, b.communicate(timeout=30)[1]
        a = subprocess.Popen([sys.executable, "-c", exporter_code, pid], **opts)
        value = a.stdout.readline()
        assert value.strip(), f"{block}, exporter:\n{exporter_code}\n{a.communicate(timeout=30)[1]}"
        out, err = b.communicate(value, timeout=60)
        assert b.returncode == 0 and out.strip() == "read", f"{block}, importer:\n{importer_code}\n{err}"
        _, err = a.communicate("done\n", timeout=60)
        assert a.returncode == 0, f"{block}, exporter:\n{err}"
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


STATED = """
import os
from npualloc import acl
acl.rt.set_device(0)
size = 2 << 20
prop = {"handleType": 0, "allocationType": 0, "memAttr": 4, "location": {"id": 0, "type": 1}, "reserve": 0}
h, ret = acl.rt.malloc_physical(size, prop, 0)
sh, ret = acl.rt.mem_export_to_shareable_handle(h, acl.ACL_MEM_HANDLE_TYPE_NONE, acl.ACL_RT_VMM_EXPORT_FLAG_DEFAULT)
assert ret == 0 and (sh >> 32) & 0xFF == 0
assert acl.rt.mem_export_to_shareable_handle(h, 0, acl.ACL_RT_VMM_EXPORT_FLAG_DEFAULT)[1] == 507899
try:
    acl.rt.mem_set_pid_to_shareable_handle(sh, (os.getpid(),))
    raise SystemExit("a tuple of pids accepted")
except ValueError as e:
    assert str(e) == "argument 2 only support the format of list", e
h2, ret = acl.rt.malloc_physical(size, prop, 0)
sh2, ret = acl.rt.mem_export_to_shareable_handle(h2, 0, acl.ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION)
assert ret == 0 and acl.rt.mem_set_pid_to_shareable_handle(sh2, [os.getpid()]) == 207006
ptr, ret = acl.rt.malloc(size, acl.ACL_MEM_MALLOC_HUGE_FIRST)
key, ret = acl.rt.ipc_mem_get_export_key(ptr, size, 65, acl.ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT)
assert ret == 0 and len(key) <= 64, key
assert re.fullmatch(r"npualloc-k1-%d-[0-9a-f]+-0-[0-9a-f]{32}" % os.getpid(), key), key
assert acl.rt.ipc_mem_get_export_key(ptr, size, 65, 0) == (key, 0)
assert acl.rt.ipc_mem_get_export_key(ptr, size, len(key), 0)[1] == 100000      # no room for the NUL
assert acl.rt.ipc_mem_get_export_key(ptr, size, len(key) + 1, 0) == (key, 0)
assert acl.rt.ipc_mem_get_export_key(ptr + 4096, 4096, 65, 0)[1] == 107000
try:
    acl.rt.ipc_mem_get_export_key(ptr, size, 1024, 0)
    raise SystemExit("len 1024 accepted")
except ValueError as e:
    assert str(e) == "key len should be less than 1024", e
"""


def test_the_values_codes_and_messages_the_doc_states():
    from docs_examples import run_python
    text = " ".join((ROOT / DOC).read_text().split())
    for phrase in ("bits 32-39 are the exporting device", "Exporting a handle again fails with 507899",
                   '(`ValueError("argument 2 only support the format of list")`)', "setting pids fails with 207006",
                   "at most 64 characters (`npualloc-k1-<pid>-<secret>-<device>-<128-bit token>`)",
                   "any other pointer gives 107000", "Asking again for the same allocation returns the same key",
                   '`len >= 1024` raises `ValueError("key len should be less than 1024")`',
                   "a `len` with no room for the key and its NUL gives 100000"):
        assert phrase in text, phrase
    proc = run_python("import re\n" + STATED)
    assert proc.returncode == 0, proc.stderr


CODES = """
from npualloc import acl
acl.rt.set_device(0)
size = 2 << 20
prop = {"handleType": 0, "allocationType": 0, "memAttr": 4, "location": {"id": 0, "type": 1}, "reserve": 0}
h, ret = acl.rt.malloc_physical(size, prop, 0)
assert acl.rt.mem_export_to_shareable_handle(h, 1, 0)[1] == 100000            # handle_type not NONE
assert acl.rt.mem_export_to_shareable_handle(h, 0, 2)[1] == 107000            # export flags above 1
sh, ret = acl.rt.mem_export_to_shareable_handle(h, 0, 0)
assert acl.rt.mem_set_pid_to_shareable_handle(sh, []) == 100000               # an empty pid list
assert acl.rt.mem_import_from_shareable_handle(sh, 0)[1] == 507899            # the exporter importing its own
assert acl.rt.mem_import_from_shareable_handle(sh, 99)[1] == 107001           # no such device
assert acl.rt.mem_import_from_shareable_handle(sh ^ 1, 0)[1] == 107017        # a forged value
ptr, ret = acl.rt.malloc(size, 0)
assert acl.rt.ipc_mem_get_export_key(ptr, 0, 65, 0)[1] == 107000              # size 0
assert acl.rt.ipc_mem_get_export_key(ptr, size, 0, 0)[1] == 107000            # a key buffer of length 0
assert acl.rt.ipc_mem_get_export_key(ptr, 64 << 20, 65, 0)[1] == 107000       # larger than the allocation
key, ret = acl.rt.ipc_mem_get_export_key(ptr, size, 65, 0)
assert acl.rt.ipc_mem_set_import_pid(key, []) == 107000                       # an empty pid list for a key
assert acl.rt.ipc_mem_import_by_key(key[:-1] + ("0" if key[-1] != "0" else "1"), 0)[1] == 107017
"""


def test_the_table_of_codes():
    from docs_examples import run_python
    from npualloc import acl
    rows = re.findall(r"^\| (\d+) `(\w+)` \|", (ROOT / DOC).read_text(), re.M)
    assert len(rows) == 9, rows
    for value, name in rows:
        assert getattr(acl, name) == int(value), name
    proc = run_python(CODES)
    assert proc.returncode == 0, proc.stderr


def test_the_kinds_of_a_shared_block():
    from docs_examples import run_python
    text = (ROOT / DOC).read_text()
    assert "**Plain segments** (`kind == 'c'`)" in text and "(`kind == 'e'`, `expandable_segments:True`)" in text
    code = ("import pickle, npualloc; p = npualloc.caching_allocator_alloc(30 << 20); h = npualloc.share(p); "
            "assert pickle.loads(pickle.dumps(h)) == h == npualloc.share(p); print(h.kind)")
    for conf, kind in (("", "c"), ("expandable_segments:True", "e")):
        proc = run_python(code, env={"PYTORCH_NPU_ALLOC_CONF": conf} if conf else None)
        assert proc.stdout.strip() == kind, proc.stderr
