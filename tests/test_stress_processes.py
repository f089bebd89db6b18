"""Processes: fork() under load, and many processes starting at once.

A child made by fork() starts with fresh devices (docs/runtime.md): it must work at once (allocate,
copy, stream work, invariant checker) although other threads of the parent were inside the allocator
when it forked, while the parent keeps its memory and its data.  (Scenarios with memory shared between
processes live with the sharing tests.)
"""
import os
import sys
import threading

import numpy as np
import pytest

import npualloc
from conftest import run_python
from npualloc import acl

rt = acl.rt
MiB = 1 << 20
GiB = 1 << 30

CHILD_WORK = r"""
def child_work():
    import npualloc
    from npualloc import acl
    rt = acl.rt
    # fresh devices: nothing allocated, nothing reserved, every byte free
    assert npualloc.memory_allocated(0) == 0 and npualloc.memory_reserved(0) == 0
    assert rt.set_device(0) == 0
    free, total, ret = rt.get_mem_info(acl.ACL_HBM_MEM)
    assert ret == 0 and free == total, (free, total)
    ptrs = [npualloc.caching_allocator_alloc(n) for n in (1, 1000, 3 << 20, 25 << 20)]
    for p in ptrs:
        acl.util.ptr_to_numpy(p, (512,), 2)[:] = 7
    s = npualloc.Stream()
    npualloc.record_stream(ptrs[0], s)
    buf, ret = rt.malloc(1 << 20, 0)
    assert ret == 0
    assert rt.memset(buf, 1 << 20, 9, 1 << 20) == 0
    assert rt.memcpy(ptrs[1], 512, buf, 512, acl.ACL_MEMCPY_DEVICE_TO_DEVICE) == 0
    assert (acl.util.ptr_to_numpy(ptrs[1], (512,), 2) == 9).all()
    s.synchronize()
    for p in ptrs:
        npualloc.caching_allocator_delete(p)
    assert rt.free(buf) == 0
    npualloc.memory._check(0)
    npualloc.empty_cache()
    assert npualloc.memory_reserved(0) == 0
"""
exec(CHILD_WORK)  # defines child_work() here; the text also runs in fresh interpreters below


def _hammer(stop, errors, device):
    try:
        while not stop.is_set():
            ptrs = [npualloc.caching_allocator_alloc(n, device=device) for n in (512, 70000, 2 * MiB + 1)]
            for p in ptrs:
                npualloc.caching_allocator_delete(p)
            if np.random.randint(8) == 0:
                npualloc.empty_cache()
    except BaseException as e:  # noqa: BLE001
        errors.append(e)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_fork_under_load_child_works_parent_keeps_its_data(restart):
    restart(device_count=2, device_memory=GiB, huge_memory=GiB, huge1g_memory=0, ddr_memory=0)
    # the parent's data: a caching-allocator block, an aclrtMalloc buffer, a pinned host buffer
    keep = npualloc.caching_allocator_alloc(5 * MiB)
    pattern = (np.arange(5 * MiB, dtype=np.uint64) % 251).astype(np.uint8)
    acl.util.ptr_to_numpy(keep, (5 * MiB,), 2)[:] = pattern
    assert rt.set_device(0) == 0
    buf, ret = rt.malloc(MiB, 0)
    assert ret == 0 and rt.memset(buf, MiB, 0x3C, MiB) == 0
    host, ret = rt.malloc_host(4096)
    assert ret == 0
    acl.util.ptr_to_numpy(host, (4096,), 2)[:] = 0x77
    stop, errors = threading.Event(), []
    threads = [threading.Thread(target=_hammer, args=(stop, errors, d)) for d in (0, 1, 0)]
    for t in threads:
        t.start()
    forks = 12
    try:
        for _ in range(forks):
            pid = os.fork()
            if pid == 0:  # the child: only this thread exists here
                code = 1
                try:
                    # pinned host memory is inherited, device memory is not
                    assert (acl.util.ptr_to_numpy(host, (4096,), 2) == 0x77).all()
                    child_work()  # noqa: F821
                    code = 0
                except BaseException as e:  # noqa: BLE001
                    print(f"child failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status:#x}"
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors
    # the parent's data is intact and its allocator consistent
    assert (acl.util.ptr_to_numpy(keep, (5 * MiB,), 2) == pattern).all()
    assert (acl.util.ptr_to_numpy(buf, (MiB,), 2) == 0x3C).all()
    assert (acl.util.ptr_to_numpy(host, (4096,), 2) == 0x77).all()
    for d in (0, 1):
        npualloc.memory._check(d)
    npualloc.caching_allocator_delete(keep)
    assert rt.free(buf) == 0 and rt.free_host(host) == 0
    assert npualloc.memory_allocated(0) == 0 and npualloc.memory_allocated(1) == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_grandchildren_start_fresh_too(restart):
    restart(device_count=1, device_memory=GiB, huge_memory=GiB, huge1g_memory=0, ddr_memory=0)
    p = npualloc.caching_allocator_alloc(MiB)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            q = npualloc.caching_allocator_alloc(MiB)  # the child allocates, then forks again
            pid2 = os.fork()
            if pid2 == 0:
                c2 = 1
                try:
                    child_work()  # noqa: F821
                    c2 = 0
                finally:
                    os._exit(c2)
            _, st = os.waitpid(pid2, 0)
            npualloc.caching_allocator_delete(q)
            npualloc.memory._check(0)
            code = 0 if os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    npualloc.caching_allocator_delete(p)
    npualloc.memory._check(0)


START_AND_WORK = CHILD_WORK + r"""
npualloc.configure(device_count=1, device_memory="1GiB")
child_work()
print("ok")
"""


def test_many_processes_start_at_once():
    import subprocess

    from conftest import ROOT

    env = {k: v for k, v in os.environ.items() if not k.startswith(("NPUALLOC_", "PYTORCH_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    code = "import npualloc\n" + START_AND_WORK
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(8)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and out.strip() == "ok", err
    assert run_python("import npualloc; print('ok')").stdout.strip() == "ok"
