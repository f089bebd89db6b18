"""Fixtures and helpers of the torch_npu-like memory API tests (tests/test_memory_*.py).

`mem` gives every test a freshly restarted runtime: 2 devices of 1 GiB HBM (all of it usable
as 2 MiB pages, no 1 GiB pool), no PYTORCH_* allocator variables, compact torch_npu error
messages (TORCH_NPU_COMPACT_ERROR_OUTPUT=1), no OOM observers.  `mem(alloc_conf=..., ...)`
restarts it again with PYTORCH_NPU_ALLOC_CONF (read at the first cache use after a restart),
PYTORCH_NO_NPU_MEMORY_CACHING or other configure() values.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

import npualloc
from npualloc import _C

ROOT = Path(__file__).resolve().parent.parent

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

MEM_CONFIG = dict(device_count=2, device_memory=GiB)
ALLOC_VARS = ("PYTORCH_NPU_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_NO_NPU_MEMORY_CACHING")


@pytest.fixture
def mem(monkeypatch):
    """A fresh runtime (MEM_CONFIG); calling it restarts with other settings."""
    monkeypatch.setenv("TORCH_NPU_COMPACT_ERROR_OUTPUT", "1")

    def restart(alloc_conf=None, no_caching=None, **overrides):
        _C.shutdown()
        for var in ALLOC_VARS:
            monkeypatch.delenv(var, raising=False)
        if alloc_conf is not None:
            monkeypatch.setenv("PYTORCH_NPU_ALLOC_CONF", alloc_conf)
        if no_caching is not None:
            monkeypatch.setenv("PYTORCH_NO_NPU_MEMORY_CACHING", no_caching)
        cfg = dict(MEM_CONFIG)
        cfg.update(overrides)
        npualloc.configure(**cfg)
        return cfg

    restart()
    yield restart
    npualloc.memory._clear_out_of_memory_observers()
    _C.shutdown()


def fmt_size(n):
    """torch's format_size (the OOM message's sizes)."""
    if n <= 1024:
        return f"{n} bytes"
    if n <= 1048576:
        return f"{n / 1024:.2f} KiB"
    if n <= 1073741824:
        return f"{n / 1048576:.2f} MiB"
    return f"{n / 1073741824:.2f} GiB"


def oom_message(alloc_size, device, total, allocated, active, free, reserved, allowed=None):
    """torch_npu's OOM text, byte for byte."""
    allowed_info = "" if allowed is None else f"{fmt_size(allowed)} allowed; "
    return (f"NPU out of memory. Tried to allocate {fmt_size(alloc_size)} (NPU {device}; {fmt_size(total)} total "
            f"capacity; {fmt_size(allocated)} already allocated; {fmt_size(active)} current active; "
            f"{fmt_size(free)} free; {allowed_info}{fmt_size(reserved)} reserved in total by PyTorch).If reserved "
            f"memory is >> allocated memory try setting max_split_size_mb to avoid fragmentation.")


def segments(device=None):
    """memory_snapshot() segments (of one device if given), by address."""
    segs = npualloc.memory_snapshot()
    if device is not None:
        segs = [s for s in segs if s["device"] == device]
    return sorted(segs, key=lambda s: s["address"])


def segment_of(ptr):
    for s in npualloc.memory_snapshot():
        if s["address"] <= ptr < s["address"] + s["total_size"]:
            return s
    raise AssertionError(f"{ptr:#x} is in no segment")


def block_of(ptr):
    for b in segment_of(ptr)["blocks"]:
        if b["address"] == ptr:
            return b
    raise AssertionError(f"no block starts at {ptr:#x}")


def layout(ptr):
    """[(size, state)] of the blocks of ptr's segment."""
    return [(b["size"], b["state"]) for b in segment_of(ptr)["blocks"]]


def check_all():
    for d in range(npualloc.device_count()):
        npualloc.memory._check(d)


def run_python(code, env=None, timeout=60, args=()):
    """Runs `code` (with sys.argv[1:] = args) in a fresh interpreter importing this checkout, without
    PYTORCH_*/NPUALLOC_* variables: 2 devices of 1 GiB unless `env` says otherwise."""
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith("NPUALLOC_") and k not in ALLOC_VARS and k != "TORCH_NPU_COMPACT_ERROR_OUTPUT"}
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env["NPUALLOC_DEVICE_COUNT"] = "2"
    full_env["NPUALLOC_DEVICE_MEMORY"] = "1GiB"
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=full_env, capture_output=True,
                          text=True, timeout=timeout)
