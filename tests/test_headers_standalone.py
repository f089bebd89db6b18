"""The public headers (csrc/include) as a C or C++ user includes them: each one alone, twice (its include
guard), compiles as C11 and C99 with -Wall -Wextra -Wpedantic -Werror, and as C++11 and C++17; and a C++
program that calls functions of each links against libnpualloc.a (extern "C") and runs."""
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import built_library

ROOT = Path(__file__).resolve().parent.parent
INCLUDE = ROOT / "csrc" / "include"
HEADERS = sorted(str(p.relative_to(INCLUDE)) for p in INCLUDE.rglob("*.h"))
STRICT = ["-Wall", "-Wextra", "-Wpedantic", "-Werror", "-fsyntax-only", "-I", str(INCLUDE)]
DIALECTS = [("cc", "c", "-std=c11"), ("cc", "c", "-std=c99"), ("c++", "c++", "-std=c++11"), ("c++", "c++", "-std=c++17")]


def compiler(kind):
    names = ["cc", "gcc", "clang"] if kind == "cc" else ["c++", "g++", "clang++"]
    found = next((shutil.which(n) for n in names if shutil.which(n)), None)
    if not found:
        pytest.skip(f"no {kind} compiler")
    return found


def test_every_public_header_is_listed():
    assert {"acl_rt.h", "npualloc.h", "acl/acl.h", "acl/acl_rt.h"} <= set(HEADERS)


@pytest.mark.parametrize("kind,language,std", DIALECTS, ids=[d[2] for d in DIALECTS])
@pytest.mark.parametrize("header", HEADERS)
def test_header_compiles_alone(header, kind, language, std, tmp_path):
    source = tmp_path / "only.c"
    source.write_text(f'#include "{header}"\n#include "{header}"\nint main(void) {{ return 0; }}\n')
    out = subprocess.run([compiler(kind), "-x", language, std, *STRICT, str(source)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


CPP_PROGRAM = r"""
#include "acl/acl.h"
#include "npualloc.h"
#include "npualloc_graph.h"
#include "npualloc_replay.h"

int main() {
    void *p = nullptr;
    if (aclrtSetDevice(0) != ACL_SUCCESS || aclrtMalloc(&p, 64, ACL_MEM_MALLOC_HUGE_FIRST) != ACL_SUCCESS ||
        aclrtFree(p) != ACL_SUCCESS)
        return 1;
    if (npualloc_cache_malloc(0, 512, 0, &p) != ACL_SUCCESS || npualloc_cache_free(p) != ACL_SUCCESS)
        return 2;
    npualloc_graph *g = nullptr;
    if (npualloc_graph_create(0, &g) != ACL_SUCCESS)
        return 3;
    npualloc_graph_destroy(g);
    npualloc_replay_config cfg;
    npualloc_replay_config_default(&cfg);
    npualloc_shutdown();
    return 0;
}
"""


def test_a_cpp_program_links_and_runs(tmp_path):
    cxx = compiler("c++")
    if shutil.which("make") is None:
        pytest.skip("needs make")
    library = built_library()
    (tmp_path / "main.cpp").write_text(CPP_PROGRAM)
    subprocess.run([cxx, "-std=c++11", "-Wall", "-Wextra", "-Werror", "-I", str(INCLUDE), "main.cpp",
                    str(library), "-pthread", "-lm", "-o", "main"],
                   cwd=tmp_path, check=True)
    env = {"NPUALLOC_DEVICE_COUNT": "1", "NPUALLOC_DEVICE_MEMORY": "1GiB", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(["./main"], cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
