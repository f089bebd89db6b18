"""docs/runtime.md as written: the C example of "Using npualloc from C" builds with the command the doc gives,
against the static library `make lib` builds, and prints what the doc says it prints."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
    subprocess.run(["make", "-s", "lib"], cwd=ROOT, check=True, capture_output=True)
    (tmp_path / "example.c").write_text(source)
    build = build.replace('"$(python -m npualloc include)"', str(ROOT / "csrc" / "include"))
    build = build.replace("build/release/libnpualloc.a", str(ROOT / "build" / "release" / "libnpualloc.a"))
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
