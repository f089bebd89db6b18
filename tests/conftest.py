"""Shared fixtures: a freshly restarted virtual NPU runtime per test.

Tests that use `npu` (or `dev0`, or `restart`) start from a clean runtime with a small,
known configuration and leave a stopped one behind, so every test is independent of the others
and of the NPUALLOC_* environment.
"""
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import npualloc
from npualloc import _C, acl
from npualloc.testing import _shutdown_at_teardown

ROOT = Path(__file__).resolve().parent.parent


def held(stream):
    """Holds a stream (an acl.rt handle, 0 for the default one) behind a BLOCK callback until the returned
    gate (a threading.Event) is set, at most 60 s: what is queued behind it has not run, however slowly
    the test's own thread goes, and a test that fails before setting it does not hang."""
    gate = threading.Event()
    assert acl.rt.launch_callback(lambda _: gate.wait(60), None, acl.ACL_CALLBACK_BLOCK, stream) == 0
    return gate

MiB = 1 << 20
GiB = 1 << 30

# Modules whose tests expect exact answers from every npualloc server on the machine (a failed
# import asks them all) or stop one (SIGSTOP: other processes' failed imports then wait for it and
# get 507022): under pytest-xdist (`make test` runs `-n JOBS --dist loadgroup`) they run on one
# worker, one after another, never alongside each other.
ONE_WORKER_MODULES = {"test_ipc.py", "test_ipc_share.py", "test_docs_sharing.py"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the group marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in ONE_WORKER_MODULES:
            item.add_marker(pytest.mark.xdist_group("ipc"))


# The small configuration: every page kind has its own, distinguishable capacity.
#   HBM 4 GiB = 1 GiB pool of 1 GiB pages + 3 GiB of normal/huge pages, of which at most
#   2 GiB huge; DDR 256 MiB.  Memory is committed only when touched, so this is cheap.
SMALL = dict(device_count=4, device_memory=4 * GiB, huge_memory=2 * GiB, huge1g_memory=1 * GiB,
             ddr_memory=256 * MiB)


@pytest.fixture
def restart():
    """restart(**overrides) -> config: stops the runtime (releasing everything) and configures
    it again, SMALL updated with `overrides`; the devices start on the next call."""

    def _restart(**overrides):
        _C.shutdown()
        cfg = dict(SMALL)
        cfg.update(overrides)
        npualloc.configure(**cfg)
        return cfg

    yield _restart
    _shutdown_at_teardown()


@pytest.fixture
def npu(restart):
    """A fresh runtime with the SMALL configuration; no device is current yet."""
    return restart()


@pytest.fixture
def dev0(npu):
    """A fresh runtime with device 0 current on the calling thread."""
    assert acl.rt.set_device(0) == acl.ACL_SUCCESS
    return npu


def built_library():
    """build/release/libnpualloc.a, made by `make -s lib` under a lock: two pytest-xdist workers building it at
    once in a fresh tree (make pytest-asan's copy) wrote one archive over the other while a test linked it."""
    import fcntl

    (ROOT / "build").mkdir(exist_ok=True)
    with open(ROOT / "build" / ".make-lib.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run(["make", "-s", "lib"], cwd=ROOT, check=True, capture_output=True)
    return ROOT / "build" / "release" / "libnpualloc.a"


def run_python(code, env=None, timeout=60):
    """Runs `code` in a fresh interpreter that imports this checkout; returns CompletedProcess."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("NPUALLOC_")}
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout)
