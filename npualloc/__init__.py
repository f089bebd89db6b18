"""npualloc: a virtual Ascend-NPU memory stack on host memory."""
from . import _C
from . import acl

__all__ = ["acl", "configure", "parse_size", "get_include"]

parse_size = _C.parse_size


def get_include():
    """The directory of npualloc's C headers (``acl_rt.h``, ``npualloc.h``), for code built against
    it, such as a pluggable allocator: ``cc -shared -fPIC -I$(python -m npualloc include) ...``.
    An installed npualloc carries them in the package; a source checkout (or an editable install)
    has them in ``csrc/include``."""
    import os
    here = os.path.dirname(os.path.abspath(__file__))
    for candidate in (os.path.join(here, "include"), os.path.join(os.path.dirname(here), "csrc", "include")):
        if os.path.isfile(os.path.join(candidate, "acl_rt.h")):
            return candidate
    raise RuntimeError(f"npualloc's C headers are missing (looked in {here}/include and ../csrc/include)")


def configure(device_count=None, device_memory=None, huge_memory=None, huge1g_memory=None, ddr_memory=None):
    """Configure the virtual devices before their first use.

    Values not given come from the ``NPUALLOC_*`` environment (or the defaults). Sizes are
    bytes (int) or strings such as ``"64GiB"``. Raises RuntimeError once the devices have
    started, ValueError for an inconsistent configuration.
    """
    cfg = _C.env_config()
    given = {
        "device_count": device_count,
        "device_memory": device_memory,
        "huge_memory": huge_memory,
        "huge1g_memory": huge1g_memory,
        "ddr_memory": ddr_memory,
    }
    if device_memory is not None and huge_memory is None and not __import__("os").environ.get("NPUALLOC_HUGE_MEMORY"):
        given["huge_memory"] = device_memory  # huge pages default to all of the HBM (an empty variable is unset)
    for key, value in given.items():
        if value is None:
            continue
        if key == "device_count":
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"configure() argument 'device_count' must be int, not {type(value).__name__}")
            cfg[key] = value
        elif isinstance(value, str):
            cfg[key] = parse_size(value)
        elif isinstance(value, int) and not isinstance(value, bool):
            if value < 0:
                raise ValueError(f"configure() argument '{key}' must not be negative")
            cfg[key] = value
        else:
            raise TypeError(f"configure() argument '{key}' must be int or str, not {type(value).__name__}")
    # Beyond what C holds, a value is only too large: clamped, it gets the limit's own message (the C call would
    # otherwise wrap a size at 2**64, or refuse a count with OverflowError).
    count = max(min(cfg["device_count"], 2**31 - 1), -2**31)
    sizes = [min(cfg[key], 2**64 - 1) for key in ("device_memory", "huge_memory", "huge1g_memory", "ddr_memory")]
    try:
        _C.configure(count, *sizes)
    except ValueError as e:  # the check names the variables: say where each value named came from
        sources = []
        for key in given:
            var = "NPUALLOC_" + key.upper()
            if var in str(e):
                where = ("given to configure()" if given[key] is not None
                         else f"from {var}" if __import__("os").environ.get(var) else "the default")
                sources.append(f"{key}={cfg[key]} {where}")
        raise ValueError(f"{e} ({'; '.join(sources)})") from None
    except RuntimeError as e:
        raise RuntimeError(f"{e} (npualloc.testing.restart(...) starts it again with other settings)") from None


def _sleep(seconds, stream=None):
    """Test helper (torch's ``torch.cuda._sleep``): queues a delay of ``seconds`` on a stream.

    ``stream`` is a stream handle (None or 0: the current device's default stream).
    Returns ret, as the acl.rt functions do.
    """
    return _C.sleep(seconds, 0 if stream is None else stream)


# ---- the torch_npu-like memory API (npualloc.memory, npualloc.streams) ----
from . import memory  # noqa: E402
from . import streams  # noqa: E402
from .memory import *  # noqa: E402,F401,F403
from .streams import Event, Stream, current_stream, default_stream, set_stream, stream  # noqa: E402,F401

__all__ += memory.__all__ + ["memory", "streams", "Stream", "Event", "stream", "set_stream", "current_stream",
                             "default_stream"]

# ---- cross-process sharing of caching-allocator blocks (npualloc.sharing, docs/sharing.md) ----
from . import sharing  # noqa: E402
from .sharing import SharedBlock, close_shared, open_shared, share  # noqa: E402,F401

__all__ += ["sharing", "SharedBlock", "share", "open_shared", "close_shared"]

# ---- private memory pools and captured graphs with planned memory (npualloc.mempool, npualloc.graph) ----
from . import mempool, graph  # noqa: E402
from .mempool import MemPool, graph_pool_handle, mempool_stats, mempool_summary, use_mem_pool  # noqa: E402,F401
from .graph import (Graph, GraphExec, GraphMemoryError, get_graph_mem_access, is_current_stream_capturing,  # noqa: E402,F401
                    set_graph_mem_access)

__all__ += ["mempool", "graph", "MemPool", "use_mem_pool", "graph_pool_handle", "mempool_stats", "mempool_summary",
            "Graph", "GraphExec", "GraphMemoryError", "set_graph_mem_access", "get_graph_mem_access",
            "is_current_stream_capturing"]

# ---- submodules imported on first attribute access (PEP 562) ----
# `npualloc.replay.replay(...)` works after a plain `import npualloc`, but the import does not pay for modules
# only the allocator lab (replay, workload) or tests (faults, testing, which imports pytest) need.
_LAZY_SUBMODULES = frozenset({"faults", "replay", "testing", "workload"})


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        import importlib
        return importlib.import_module(f".{name}", __name__)  # also binds it here: later lookups skip this
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | _LAZY_SUBMODULES)
