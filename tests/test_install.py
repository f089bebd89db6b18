"""`pip install .` and `pip install -e .` work: each into a throwaway venv (with the system's site
packages, so no network: --no-deps --no-build-isolation) from a copy of the tracked files, then a fresh
interpreter outside the checkout imports npualloc from the install and makes a few acl calls.
Marked `install` (about a minute: the extension is compiled twice); `-m 'not install'` deselects it."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r'''
import sys
import npualloc
from npualloc import acl
assert acl.rt.set_device(0) == acl.ACL_SUCCESS
p, ret = acl.rt.malloc(1024, acl.ACL_MEM_MALLOC_HUGE_FIRST)
assert ret == acl.ACL_SUCCESS and acl.rt.memset(p, 1024, 7, 1024) == 0 and acl.rt.free(p) == 0
# the C headers, for a pluggable allocator built against this install
import os, subprocess
inc = npualloc.get_include()
assert os.path.isfile(os.path.join(inc, "acl_rt.h")) and os.path.isfile(os.path.join(inc, "npualloc.h")), inc
cli = subprocess.run([sys.executable, "-m", "npualloc", "include"], capture_output=True, text=True, check=True)
assert cli.stdout.strip() == inc, cli
src = os.path.join(os.getcwd(), "plugin.c")
with open(src, "w") as f:
    f.write('#include "acl_rt.h"\nvoid *m(size_t n, int d, aclrtStream s) { (void)d; (void)s; void *p = 0; '
            'return aclrtMalloc(&p, n, ACL_MEM_MALLOC_HUGE_FIRST) == ACL_SUCCESS ? p : 0; }\n'
            'void f(void *p, size_t n, int d, aclrtStream s) { (void)n; (void)d; (void)s; aclrtFree(p); }\n')
subprocess.run(["cc", "-shared", "-fPIC", "-I", inc, src, "-o", src + ".so"], check=True)
npualloc.change_current_allocator(npualloc.NPUPluggableAllocator(src + ".so", "m", "f"))
q = npualloc.caching_allocator_alloc(4096)
assert q and npualloc.memory_allocated() == 0
npualloc.caching_allocator_delete(q)
print(inc)
print(npualloc.__file__)
'''


def tracked_files():
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout (git ls-files: {e})")
    return [f for f in out.decode().split("\0") if f and (ROOT / f).is_file()]


def run(cmd, cwd, env):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.install
def test_pip_install_and_editable_install_work(tmp_path):
    src = tmp_path / "src"
    for f in tracked_files():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME") and not k.startswith("NPUALLOC_")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    # --without-pip: the venv's own pip and setuptools (65 on Python 3.11) would shadow the system's, and
    # pyproject.toml's SPDX license needs setuptools 77 (build isolation would fetch it; this test has no network)
    run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv], tmp_path, env)
    py = venv / "bin" / "python"
    away = tmp_path / "elsewhere"  # not the copy: `import npualloc` must find the installed package
    away.mkdir()
    pip = [py, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]

    run(pip + [src], tmp_path, env)
    inc, where = map(Path, run([py, "-c", SCRIPT], away, env).strip().splitlines()[-2:])
    assert venv in where.parents, f"npualloc imported from {where}, not from the venv"
    assert inc == where.parent / "include", inc  # the headers installed with the package

    run([py, "-m", "pip", "uninstall", "-q", "-y", "npualloc"], tmp_path, env)
    run(pip + ["-e", src], tmp_path, env)
    inc, where = map(Path, run([py, "-c", SCRIPT], away, env).strip().splitlines()[-2:])
    assert src in where.parents, f"editable install imported npualloc from {where}, not from {src}"
    assert inc == src / "csrc" / "include", inc  # an editable install uses the checkout's headers
