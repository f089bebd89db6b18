"""npualloc.testing: restart() gives a fresh runtime with the settings asked for, check_invariants(), and the
npualloc_runtime pytest fixture (run in an inner pytest session, as a user's suite would)."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import npualloc
from npualloc import _C, memory, testing

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
GiB = 1 << 30
ALLOC_VARS = ("PYTORCH_NPU_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_NO_NPU_MEMORY_CACHING")


@pytest.fixture
def clean(monkeypatch):
    """restart() writes the allocator variables into os.environ: put them back afterwards."""
    for var in ALLOC_VARS:
        monkeypatch.setenv(var, "")  # recorded, so the teardown restores (or removes) each one
        monkeypatch.delenv(var)
    yield
    memory._clear_out_of_memory_observers()
    _C.shutdown()


def test_restart_applies_settings_and_device_configuration(clean):
    testing.restart("expandable_segments:True", device_count=1, device_memory="1GiB")
    assert os.environ["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"
    assert memory._snapshot()["allocator_settings"]["expandable_segments"] is True
    assert npualloc.device_count() == 1 and npualloc.mem_get_info(0)[1] == GiB
    p = npualloc.caching_allocator_alloc(30 * MiB)
    assert npualloc.memory_reserved() == 40 * MiB  # two 20 MiB pages of an expandable segment
    npualloc.caching_allocator_delete(p)
    testing.restart("max_split_size_mb:64", device_count=2, device_memory="2GiB")
    settings = memory._snapshot()["allocator_settings"]
    assert settings["expandable_segments"] is False and settings["max_split_size"] == 64 * MiB
    assert npualloc.device_count() == 2 and npualloc.mem_get_info(1)[1] == 2 * GiB
    assert npualloc.memory_reserved() == 0  # a new runtime: nothing of the old one is left


def test_restart_defaults_clear_the_environment(clean, monkeypatch):
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:40")
    testing.restart(device_count=1, device_memory="1GiB")
    assert all(var not in os.environ for var in ALLOC_VARS)
    assert memory._snapshot()["allocator_settings"]["max_split_size"] == -1  # the allocator's defaults


def test_restart_makes_old_objects_stale(clean):
    testing.restart(device_count=1, device_memory="1GiB")
    buf = npualloc.empty(1000)
    ptr = npualloc.caching_allocator_alloc(1000)
    assert npualloc.memory_allocated() > 0
    testing.restart(device_count=1, device_memory="1GiB")
    buf.free()  # stale: nothing happens, nothing breaks
    assert npualloc.memory_allocated() == 0
    with pytest.raises(RuntimeError):
        npualloc.caching_allocator_delete(ptr)  # unknown to the new runtime
    testing.check_invariants()


def test_restart_from_a_stream_callback_is_refused(clean):
    # It would wait for every stream, the callback's own included: refused, and the runtime lives on.
    from npualloc import acl
    testing.restart()
    s = npualloc.Stream()
    p = npualloc.caching_allocator_alloc(4096)
    seen = []

    def callback(_):
        try:
            testing.restart()
        except RuntimeError as e:
            seen.append(str(e))

    assert acl.rt.launch_callback(callback, None, acl.ACL_CALLBACK_BLOCK, s.npu_stream) == 0
    s.synchronize()
    assert seen == ["npualloc: the runtime cannot be shut down from a stream's task (error 207000): it would "
                    "wait for that task's own stream"]
    assert acl.rt.memset_async(p, 4096, 1, 4096, s.npu_stream) == 0   # the stream and the memory still live
    s.synchronize()
    assert acl.util.ptr_to_bytes(p, 2) == b"\x01\x01"
    npualloc.caching_allocator_delete(p)


def test_restart_with_bad_settings_raises_at_once(clean):
    with pytest.raises(ValueError, match="Unrecognized key 'no_such_key' in NPU allocator config"):
        testing.restart("no_such_key:1", device_count=1, device_memory="1GiB")
    assert "PYTORCH_NPU_ALLOC_CONF" not in os.environ and not npualloc.is_initialized()
    with pytest.raises(RuntimeError, match="cannot be enabled with `expandable_segments`"):
        testing.restart("expandable_segments:True,max_split_size_mb:40", device_count=1, device_memory="1GiB")
    with pytest.raises(TypeError, match="argument 'alloc_conf' must be str, not int"):
        testing.restart(40)
    testing.restart(device_count=1, device_memory="1GiB")  # and then it starts again
    assert npualloc.caching_allocator_alloc(0) == 0


@pytest.mark.parametrize("kwargs,message", [
    (dict(device_count=0), "NPUALLOC_DEVICE_COUNT must be from 1 to 64"),
    (dict(device_count=65), "NPUALLOC_DEVICE_COUNT must be from 1 to 64"),
    (dict(device_memory=0), "NPUALLOC_DEVICE_MEMORY must be more than 0"),
    (dict(device_memory=(1 << 50) + 1), "NPUALLOC_DEVICE_MEMORY must be at most 1024 TiB"),
    (dict(device_memory="1GiB", huge_memory="2GiB"), "NPUALLOC_HUGE_MEMORY must not exceed NPUALLOC_DEVICE_MEMORY"),
    (dict(device_memory="1GiB", huge1g_memory="2GiB"), "NPUALLOC_HUGE1G_MEMORY must not exceed NPUALLOC_DEVICE_MEMORY"),
    (dict(device_memory="4GiB", huge1g_memory="1536MiB"), "NPUALLOC_HUGE1G_MEMORY must be a whole number of GiB"),
    (dict(ddr_memory=(1 << 50) + 1), "NPUALLOC_DDR_MEMORY must be at most 1024 TiB"),
    # beyond 64 bits: too large as well (they used to wrap round: 2**64 + 1 GiB made a 1 GiB device)
    (dict(device_memory=(1 << 64) + (1 << 30)), "NPUALLOC_DEVICE_MEMORY must be at most 1024 TiB"),
    (dict(device_memory=1 << 64), "NPUALLOC_DEVICE_MEMORY must be at most 1024 TiB"),
    (dict(ddr_memory=(1 << 64) + (1 << 20)), "NPUALLOC_DDR_MEMORY must be at most 1024 TiB"),
    (dict(device_count=(1 << 32) + 1), "NPUALLOC_DEVICE_COUNT must be from 1 to 64"),
    (dict(device_count=-(1 << 40)), "NPUALLOC_DEVICE_COUNT must be from 1 to 64"),
])
def test_restart_refuses_a_device_configuration_out_of_range(clean, kwargs, message):
    with pytest.raises(ValueError, match=message):
        testing.restart(**kwargs)
    assert not npualloc.is_initialized()
    testing.restart(device_count=1, device_memory="1GiB")  # and then it starts again
    assert npualloc.device_count() == 1


def test_restart_without_caching(clean):
    testing.restart(no_caching=True, device_count=1, device_memory="1GiB")
    assert os.environ["PYTORCH_NO_NPU_MEMORY_CACHING"] == "1"
    buf = npualloc.empty(1000)
    assert npualloc.memory_reserved() == 0  # not from the cache
    buf.free()


def test_check_invariants(clean):
    _C.shutdown()
    testing.check_invariants()  # not running: nothing to check, nothing started
    assert not npualloc.is_initialized()
    testing.restart(device_count=2, device_memory="1GiB")
    ptrs = [npualloc.caching_allocator_alloc(n * 1000, device=n % 2) for n in range(1, 50)]
    for p in ptrs[::2]:
        npualloc.caching_allocator_delete(p)
    testing.check_invariants()


SUITE = '''
import os
import npualloc
from npualloc import memory

MiB = 1 << 20

def test_default_runtime(npualloc_runtime):
    p = npualloc.caching_allocator_alloc(1000)
    assert npualloc.memory_stats()["allocation.all.current"] == 1
    npualloc.caching_allocator_delete(p)

def test_other_settings(npualloc_runtime):
    npualloc_runtime("max_split_size_mb:128", device_count=1, device_memory="1GiB")
    assert memory._snapshot()["allocator_settings"]["max_split_size"] == 128 * MiB
    assert os.environ["PYTORCH_NPU_ALLOC_CONF"] == "max_split_size_mb:128"

def test_the_next_test_has_the_defaults(npualloc_runtime):
    assert "PYTORCH_NPU_ALLOC_CONF" not in os.environ
    assert memory._snapshot()["allocator_settings"]["max_split_size"] == -1

def test_after_the_fixture_the_environment_is_back():
    assert os.environ.get("PYTORCH_NPU_ALLOC_CONF") == "from the user"
    assert not npualloc.is_initialized()  # and the runtime is released

def test_a_broken_invariant_fails_the_test(monkeypatch, npualloc_runtime):  # patched until the fixture is done
    def broken(device=None):
        raise AssertionError("segment 0x1000: blocks do not tile it")
    monkeypatch.setattr(memory, "_check", broken)
    npualloc.caching_allocator_alloc(1000)
'''


def test_the_pytest_fixture(tmp_path):
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["npualloc.testing"]\n')
    (tmp_path / "test_suite.py").write_text(textwrap.dedent(SUITE))
    env = {k: v for k, v in os.environ.items() if k not in ALLOC_VARS and not k.startswith("NPUALLOC_")}
    env.update(PYTHONPATH=str(ROOT), NPUALLOC_DEVICE_COUNT="2", NPUALLOC_DEVICE_MEMORY="1GiB",
               PYTORCH_NPU_ALLOC_CONF="from the user")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout
    assert "5 passed, 1 error" in out, out + proc.stderr
    assert "ERROR at teardown of test_a_broken_invariant_fails_the_test" in out
    assert "segment 0x1000: blocks do not tile it" in out


def test_the_fixture_after_a_failed_test_that_held_a_view(tmp_path):
    # The failed test's locals (a memoryview of a Buffer) stay alive in sys.last_traceback through teardown, and
    # shutdown() refuses to unmap memory under a view: the fixture's teardown failed, the next test's setup too,
    # and the environment was left with the failed test's settings.
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["npualloc.testing"]\n')
    (tmp_path / "test_views.py").write_text(textwrap.dedent("""
        import os
        import npualloc

        def test_a_fails_holding_a_view(npualloc_runtime):
            npualloc_runtime("expandable_segments:True")
            view = memoryview(npualloc.empty(4096))
            assert view[0] == 99

        def test_b_has_a_fresh_runtime(npualloc_runtime):
            assert os.environ.get("PYTORCH_NPU_ALLOC_CONF", "") == ""
            assert npualloc.memory_allocated() == 0

        def test_c_the_environment_is_back():
            assert "PYTORCH_NPU_ALLOC_CONF" not in os.environ
    """))
    env = {k: v for k, v in os.environ.items() if k not in ALLOC_VARS and not k.startswith("NPUALLOC_")}
    env.update(PYTHONPATH=str(ROOT), NPUALLOC_DEVICE_COUNT="1", NPUALLOC_DEVICE_MEMORY="1GiB")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert "1 failed, 2 passed" in proc.stdout, proc.stdout + proc.stderr
    assert "assert 0 == 99" in proc.stdout
