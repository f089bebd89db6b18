"""docs/runtime.md as written: the C example of "Using npualloc from C" builds with the command the doc gives,
against the static library `make lib` builds, and prints what the doc says it prints; the table of "Devices"
lists the variables `npualloc.configure` and the environment take, with their defaults and ranges."""
import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import npualloc
from conftest import built_library

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "runtime.md"
SECTION = DOC.read_text().split("## Using npualloc from C", 1)[1].split("\n## ", 1)[0]


def test_the_c_example_builds_and_prints_what_the_doc_says(tmp_path):
    if shutil.which("cc") is None or shutil.which("make") is None:
        pytest.skip("needs a C compiler and make")
    source = re.search(r"^```c\n(.*?)^```", SECTION, re.S | re.M).group(1)
    commands = re.search(r"^```sh\n(.*?)^```", SECTION, re.S | re.M).group(1)
    build = next(line for line in commands.splitlines() if line.startswith("cc "))
    expected = [line[2:] for line in commands.splitlines() if line.startswith("# ")]
    library = built_library()
    (tmp_path / "example.c").write_text(source)
    build = build.replace('"$(python -m npualloc include)"', str(ROOT / "csrc" / "include"))
    build = build.replace("build/release/libnpualloc.a", str(library))
    subprocess.run(build + " -Wall -Wextra -Werror", shell=True, cwd=tmp_path, check=True)
    out = subprocess.run(["./example"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == expected


def test_the_include_command_names_the_headers_of_the_doc():
    out = subprocess.run([sys.executable, "-m", "npualloc", "include"], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    include = Path(out.stdout.strip())
    for header in ("acl/acl.h", "acl/acl_rt.h", "npualloc.h"):
        assert (include / header).is_file(), header


# ---- the table of "Devices" ----

def _devices_table():
    section = DOC.read_text().split("\n## Devices\n", 1)[1].split("\n## ", 1)[0]
    return {cells[0].strip("`"): (cells[1], cells[2]) for cells in
            ([c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
             if line.startswith("| `NPUALLOC_"))}


PROBE = """
import npualloc
try:
    npualloc.acl.rt.set_device(0)
    print("ok", npualloc.acl.rt.get_device_count()[0], npualloc.mem_get_info(0)[1])
except ValueError as e:
    print(e)
"""


def _start(var=None, value=None):
    env = {} if var is None else {var: value}
    return subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**{k: v for k, v in os.environ.items() if not k.startswith("NPUALLOC_")},
                               "PYTHONPATH": str(ROOT), **env}).stdout.strip()


@pytest.mark.parametrize("var, good, bad", [
    ("NPUALLOC_DEVICE_COUNT", ["1", "64"], ["0", "65"]),
    ("NPUALLOC_FD_BUDGET", ["0", str((1 << 30) - 1)], [str(1 << 30)]),
    ("NPUALLOC_VA_SPACE", ["1GiB", "128TiB"], ["1023MiB", "129TiB"]),
    ("NPUALLOC_IPC_TIMEOUT_MS", ["1", "3600000"], ["0", "3600001"]),
    ("NPUALLOC_DEVICE_MEMORY", ["2G", "2GiB", str(2 << 30)], ["2X"]),
])
def test_the_ranges_of_the_table(var, good, bad):
    meaning = _devices_table()[var][0]
    if var != "NPUALLOC_DEVICE_MEMORY":
        assert re.search(r"\(1\.\.64\)|0 \.\. 2\^30 - 1|1GiB \.\. 128TiB|1 \.\. 3600000", meaning), meaning
    for value in good:
        assert _start(var, value).startswith("ok "), (var, value)
    for value in bad:                       # "raises ValueError naming the variable and the value"
        assert _start(var, value).startswith(f"{var}='{value}' is not "), (var, value)


def test_the_defaults_of_the_table():
    table = _devices_table()
    assert set(table) == {"NPUALLOC_DEVICE_COUNT", "NPUALLOC_DEVICE_MEMORY", "NPUALLOC_HUGE_MEMORY",
                          "NPUALLOC_HUGE1G_MEMORY", "NPUALLOC_DDR_MEMORY", "NPUALLOC_FD_BUDGET", "NPUALLOC_VA_SPACE",
                          "NPUALLOC_IPC_TIMEOUT_MS"}
    assert table["NPUALLOC_DEVICE_COUNT"][1] == "8" and table["NPUALLOC_DEVICE_MEMORY"][1] == "64GiB"
    assert _start() == f"ok 8 {64 << 30}"
    # "`npualloc.configure(...)` replaces the first five variables"
    first_five = [v[len("NPUALLOC_"):].lower() for v in table][:5]
    assert list(inspect.signature(npualloc.configure).parameters) == first_five


# ---- codes the text gives ----

CODES = """
import os
import npualloc
from npualloc import acl
acl.rt.set_device(0)
assert acl.rt.memcpy(0, 0, 0, 0, 1) == 0 and acl.rt.memset(0, 0, 0, 0) == 0     # 0 bytes, null pointers
p, ret = acl.rt.malloc(4096, 0)
h, ret = acl.rt.malloc_host(4096)
assert acl.rt.memcpy(p, 16, h, 16, 5) == 0 and acl.rt.memcpy(p, 16, h, 16, 6) == 100000
assert acl.rt.memcpy2d(p, 32, h, 24, 16, 4, 1) == 0 and acl.rt.memcpy2d(h, 16, p, 32, 16, 4, 4) == 0   # 2-D copies
assert acl.rt.memcpy2d(p, 32, h, 24, 25, 4, 1) == acl.rt.memcpy2d(p, 32, h, 24, 16, 0, 1) == 100000
assert acl.rt.memcpy2d(p, 32, h, 24, 16, 4, 0) == acl.rt.memcpy2d(p, 32, h, 24, 16, 4, 5) == 100000
assert acl.rt.memcpy2d(p, 32, h, 32, 16, 5242881, 1) == acl.rt.memcpy2d(p, 5000001, h, 5000001, 5000001, 1, 1) == 107000
assert acl.rt.memcpy2d(p, 32, p, 32, 16, 4, 3) == 207000 and acl.rt.memcpy2d(h, 32, h, 32, 16, 4, 1) == 107000
buf = bytearray(128)                                                         # pageable: the kind must fit
b = acl.util.bytes_to_ptr(buf)
assert acl.rt.memcpy2d(p, 32, b, 32, 16, 4, 2) == 107000 and acl.rt.memcpy2d(p, 32, h, 32, 16, 4, 2) == 0
assert acl.rt.malloc((1 << 64) - 64, 0)[1] == 100000                               # rounding and pad overflow
assert acl.rt.malloc((1 << 64) - 65, 0)[1] == 207001 == acl.rt.malloc(1 << 50, 0)[1]
s, ret = acl.rt.create_stream()
assert acl.rt.synchronize_stream_with_timeout(s, -2) == 107000
assert acl.rt.synchronize_stream_with_timeout(s, 0) == 0
assert acl.rt.stream_query(s) == (acl.ACL_STREAM_STATUS_COMPLETE, 0)
assert acl.rt.create_event_with_flag(0x40)[1] == 107000 and acl.rt.create_event_with_flag(0x30)[1] == 107000
assert acl.rt.create_event_with_flag(0x20)[1] == 207000 and acl.rt.create_event_ex_with_flag(0x40)[1] == 207000
assert acl.rt.create_stream_with_config(0, 0x4)[1] == 207000 and acl.rt.create_stream_with_config(0, 0x21)[1] == 107000
pid = os.fork()
if pid == 0:                                   # stale handles in the child; an Event never recorded is not stale
    os._exit(0 if acl.rt.stream_query(s) == (0xFFFF, 100000) and npualloc.Event().query() is True else 3)
assert os.waitpid(pid, 0)[1] == 0
assert acl.rt.reserve_mem_address(2 << 20, 0, 16 << 40, 0)[1] == 107000     # CANN's 16 TiB window
assert acl.rt.memcpy(p, 16, 8, 16, 1) == 107000                              # a host address not mapped
assert acl.rt.memcpy_async(p, 16, 8, 16, 1, s) == 107000 and acl.rt.synchronize_stream(s) == 0   # made at once
assert acl.rt.memset_async(8, 16, 0, 16, s) == 0 and acl.rt.synchronize_stream(s) == 507053         # queued
g = npualloc.Graph()                                                         # capture modes
cs, other = npualloc.Stream(), npualloc.Stream()
with g.capture(stream=cs):
    assert acl.rt.memset(p, 16, 0, 16) == acl.rt.memcpy(h, 16, p, 16, 2) == 107030
    assert acl.rt.memcpy_async(p, 16, b, 16, 1, other.npu_stream) == 107041               # pageable: synchronous
    assert acl.rt.memcpy_async(p, 16, b, 16, 1, cs.npu_stream) == 107027 == acl.rt.synchronize_stream(cs.npu_stream)
with npualloc.Graph().capture(stream=npualloc.Stream(), capture_error_mode="relaxed"):
    assert acl.rt.memset(p, 16, 0, 16) == 0
assert (acl.init(), acl.init(), acl.finalize(), acl.finalize()) == (
    0, acl.ACL_ERROR_REPEAT_INITIALIZE, 0, acl.ACL_ERROR_REPEAT_FINALIZE)
assert acl.rt.malloc(4096, 0)[1] == 0                                        # still works after aclFinalize
assert acl.rt.reset_device(0) == 0 and acl.rt.get_device() == (0, 107002) and acl.rt.reset_device(0) == 0
"""


def test_the_codes_the_text_gives():
    text = " ".join(DOC.read_text().split())
    for phrase in ("A copy or memset of 0 bytes", "null pointers included", "(0..5); any other",
                   "(within 64 bytes of `SIZE_MAX`, 32 without the pad) is `ACL_ERROR_INVALID_PARAM`",
                   "any other size too large for the device is `ACL_ERROR_RT_MEMORY_ALLOCATION`",
                   "below -1 `ACL_ERROR_RT_PARAM_INVALID`", "| `ACL_EVENT_IPC` | 0x40 | 107000 here",
                   "`ACL_EVENT_IPC` alone 207000", "| `ACL_STREAM_PERSISTENT` | 0x4 | 207000",
                   "`acl.rt.stream_query`: `(0xFFFF, 100000)`, `acl.rt.query_event`: `(0, 100000)`",
                   "`ACL_STREAM_STATUS_RESERVED` (0xFFFF) for `acl.rt.stream_query`",
                   "so a failure never reads as COMPLETE",
                   "its `query()` is True",
                   "not in CANN's experimental 16 TiB - 24 TiB window: an address there returns 107000",
                   "returns `ACL_ERROR_RT_PARAM_INVALID` (107000) instead of faulting",
                   "`ACL_ERROR_RT_DEVICE_MEM_ERROR` (507053)", "`ACL_ERROR_RT_CONTEXT_NULL`, 107002",
                   "a reset with no reference left succeeds and does nothing",
                   "returns `ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT` (107030) and does nothing",
                   "another value is `ACL_ERROR_RT_PARAM_INVALID` (107000)",
                   "`ACL_ERROR_RT_STREAM_CAPTURE_WRONG_THREAD` (107038)",
                   "`ACL_ERROR_RT_CAPTURE_MODE_BLOCK_ASYNC` (107041", "`ACL_ERROR_RT_STREAM_CAPTURED` (107027)",
                   "a bad pageable address is the call's 107000, not the stream's",
                   "more than 5242880 rows (5 * 1024 * 1024), or rows longer than 5000000 bytes",
                   "refused by the runtime) | `ACL_ERROR_RT_FEATURE_NOT_SUPPORT` (207000)",
                   "or host to host / device to device memory | 107000",
                   "when the host side is not `aclrtMallocHost` memory | 107000",
                   "`aclrtMemcpy`, `aclrtMemcpy2d` and `aclrtMemset` (`acl.rt.memcpy`, `acl.rt.memcpy2d`,"):
        assert phrase in text, phrase
    proc = subprocess.run([sys.executable, "-c", CODES], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**{k: v for k, v in os.environ.items() if not k.startswith("NPUALLOC_")},
                               "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
