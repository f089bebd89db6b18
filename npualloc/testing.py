"""Testing code that uses npualloc: a fresh virtual NPU per test, with the allocator settings you choose.

The caching allocator reads ``PYTORCH_NPU_ALLOC_CONF`` once, at its first use, and the devices are
configured once, before their first use.  To try several settings in one process (one per test, or one
per cell of a notebook), restart the runtime in between::

    from npualloc.testing import restart

    restart("expandable_segments:True", device_memory="8GiB")
    ...                                   # the allocator runs with these settings
    restart("max_split_size_mb:128", device_memory="8GiB")  # everything released; new settings (the
                                          # devices too: what is not given comes from NPUALLOC_*)

With pytest, enable the plugin in a ``conftest.py``::

    pytest_plugins = ["npualloc.testing"]

    def test_fragmentation(npualloc_runtime):
        npualloc_runtime("max_split_size_mb:128", device_memory="8GiB")
        ...

The ``npualloc_runtime`` fixture restarts the runtime before the test (allocator defaults, the
``NPUALLOC_*`` device configuration), hands the test ``restart`` to choose other settings, and after the
test checks every device's allocator invariants (a broken invariant fails the test), forgets OOM observers,
restores the environment variables it changed and releases everything.
"""
import gc
import os
import sys

from . import _C, configure, memory

__all__ = ["restart", "check_invariants", "npualloc_runtime"]

_ALLOC_VARS = ("PYTORCH_NPU_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_NO_NPU_MEMORY_CACHING")


def _set_alloc_vars(values):
    """Sets the allocator variables to ``values`` ({name: text}); the others are removed."""
    for var in _ALLOC_VARS:
        if values.get(var) is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = values[var]


def restart(alloc_conf="", *, no_caching=False, device_count=None, device_memory=None, huge_memory=None,
            huge1g_memory=None, ddr_memory=None):
    """Releases the whole virtual runtime and starts it again with these settings.

    Every pointer, stream, event, handle and ``Buffer`` of the old runtime becomes invalid (the Python
    objects turn stale; freeing them does nothing).  ``alloc_conf`` becomes ``PYTORCH_NPU_ALLOC_CONF``
    ("" is the allocator's defaults; ``PYTORCH_ALLOC_CONF`` is removed) and ``no_caching`` sets
    ``PYTORCH_NO_NPU_MEMORY_CACHING``: both stay in ``os.environ``, as if set before the first use.
    The device values are those of :func:`npualloc.configure`; the ones not given come from the
    ``NPUALLOC_*`` environment or the defaults.  The settings are parsed at once: a malformed
    ``alloc_conf`` raises here (``ValueError`` or ``RuntimeError``, with torch_npu's message), as does a bad
    device value (``TypeError`` or ``ValueError``, as from ``configure``), and leaves the runtime stopped,
    its variables cleared: the old runtime is gone either way.  As ``aclFinalize``, it is for a moment when no other thread
    uses the runtime; from a stream's callback it raises ``RuntimeError`` and changes nothing, and while a
    view of a ``Buffer``'s memory is exported (a ``memoryview``, a NumPy array) ``BufferError``.
    """
    if not isinstance(alloc_conf, str):
        raise TypeError(f"restart() argument 'alloc_conf' must be str, not {type(alloc_conf).__name__}")
    _C.shutdown()
    _set_alloc_vars({"PYTORCH_NPU_ALLOC_CONF": alloc_conf or None,
                     "PYTORCH_NO_NPU_MEMORY_CACHING": "1" if no_caching else None})
    try:
        configure(device_count=device_count, device_memory=device_memory, huge_memory=huge_memory,
                  huge1g_memory=huge1g_memory, ddr_memory=ddr_memory)
        memory._snapshot()  # starts the runtime and reads the settings: a bad one raises now
    except BaseException:
        _C.shutdown()
        _set_alloc_vars({})
        raise


def _shutdown_at_teardown():
    """``_C.shutdown()`` after a test.  A failed test's exception stays in ``sys.last_traceback`` (for
    post-mortem debugging) with the test's locals, a ``memoryview`` of a ``Buffer`` among them, under which
    shutdown() refuses to unmap the memory: that exception is dropped and the shutdown tried again once."""
    try:
        _C.shutdown()
    except BufferError:
        for name in ("last_type", "last_value", "last_traceback", "last_exc"):
            if hasattr(sys, name):
                setattr(sys, name, None)
        gc.collect()
        _C.shutdown()


def check_invariants():
    """Checks the caching allocator's invariants on every device of a running runtime (blocks tile their
    segments, free blocks are indexed, stats match the blocks, ...).  Raises ``AssertionError`` naming
    the first broken one; does nothing when the runtime is not running."""
    if not memory.is_initialized():
        return
    for device in range(memory.device_count()):
        memory._check(device)


try:
    import pytest
except ImportError:  # the plugin needs pytest; restart() and check_invariants() do not
    pytest = None

if pytest is not None:
    @pytest.fixture
    def npualloc_runtime():
        """A freshly restarted runtime for the test; call it to restart with other settings
        (the arguments of :func:`restart`).  Afterwards: invariants checked, everything released,
        the allocator variables as they were before the test."""
        saved = {var: os.environ.get(var) for var in _ALLOC_VARS}
        try:
            restart()
            yield restart
            check_invariants()
        finally:
            memory._clear_out_of_memory_observers()
            try:
                _shutdown_at_teardown()
            finally:
                _set_alloc_vars(saved)
