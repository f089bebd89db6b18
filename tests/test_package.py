"""The npualloc package itself: submodules reachable as attributes without being imported eagerly."""
import json
import textwrap

from conftest import run_python

# submodule -> a function the docs call through it (npualloc.replay.replay(...), npualloc.faults.inject(...), ...)
LAZY_SUBMODULES = {"replay": "replay", "faults": "inject", "testing": "restart", "workload": "transformer_trace"}


def test_submodules_are_attributes_imported_on_first_access():
    p = run_python(textwrap.dedent(f"""
        import json, sys
        import npualloc
        report = {{"pytest_after_import": "pytest" in sys.modules, "in_dir": sorted(dir(npualloc)), "access": {{}}}}
        for name, function in {LAZY_SUBMODULES!r}.items():
            loaded_before = f"npualloc.{{name}}" in sys.modules
            module = getattr(npualloc, name)
            report["access"][name] = {{
                "loaded_before": loaded_before,
                "is_the_submodule": module is sys.modules[f"npualloc.{{name}}"],
                "function_callable": callable(getattr(module, function)),
            }}
        try:
            npualloc.no_such_name
        except AttributeError as e:
            report["unknown"] = str(e)
        report["getattr_default"] = getattr(npualloc, "no_such_name", "default")
        print(json.dumps(report))
    """))
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["pytest_after_import"] is False  # npualloc.testing (which imports pytest) was not imported
    for name in LAZY_SUBMODULES:
        assert report["access"][name] == {"loaded_before": False, "is_the_submodule": True,
                                          "function_callable": True}, name
        assert name in report["in_dir"]
    assert report["unknown"] == "module 'npualloc' has no attribute 'no_such_name'"
    assert report["getattr_default"] == "default"


def _public_modules():
    """(module, prefix, public names) for npualloc, its lazily imported submodules, and every npualloc module or
    namespace reachable from their public names (npualloc.acl, acl.rt, acl.util, npualloc.memory, ...).  A
    module's public names are its ``__all__``, or without one (npualloc.acl, acl.rt, acl.util, npualloc.faults)
    every name without a leading underscore."""
    import importlib
    import inspect

    import npualloc

    todo = [(npualloc, "npualloc.")] + [(importlib.import_module(f"npualloc.{name}"), f"npualloc.{name}.")
                                        for name in sorted(npualloc._LAZY_SUBMODULES)]
    seen = set()
    while todo:
        module, prefix = todo.pop(0)
        if module.__name__ in seen:
            continue
        seen.add(module.__name__)
        names = getattr(module, "__all__", None)
        if names is None:
            names = [name for name in dir(module) if not name.startswith("_")]
        yield module, prefix, names
        for name in names:
            obj = getattr(module, name)
            if inspect.ismodule(obj) and obj.__name__.startswith("npualloc"):  # not an imported contextlib
                todo.append((obj, f"{prefix}{name}."))


def _documented_api():
    """(qualified name, object) for every function and class of the public modules (_public_modules), and for
    the public methods and properties those classes define (members inherited from Python's own classes, such
    as an exception's ``args``, are Python's to document)."""
    import inspect

    for module, prefix, names in _public_modules():
        for name in names:
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or inspect.isroutine(obj)):
                continue  # a submodule (walked by _public_modules) or a constant
            if not (getattr(obj, "__module__", None) or "").startswith("npualloc"):
                continue  # imported from Python's library into a module without __all__
            yield prefix + name, obj
            if not inspect.isclass(obj):
                continue
            for klass in obj.__mro__:
                if not klass.__module__.startswith("npualloc"):
                    continue
                for member, value in vars(klass).items():
                    if member.startswith("_") or inspect.ismemberdescriptor(value) or inspect.isgetsetdescriptor(value):
                        continue  # private, or a __slots__ or C attribute (data, not a method)
                    if isinstance(value, (classmethod, staticmethod)):
                        value = value.__func__
                    yield f"{prefix}{name}.{member}", value


def test_public_functions_classes_and_methods_have_docstrings():
    api = dict(_documented_api())
    # the listed ones are covered (not skipped by the walk above)
    for name in ("npualloc.memory_allocated", "npualloc.get_allocator_backend", "npualloc.GraphExec.launch",
                 "npualloc.GraphExec.replay", "npualloc.GraphExec.destroyed", "npualloc.MemPool.device",
                 "npualloc.Stream.device_index", "npualloc.Event.npu_event", "npualloc.replay.Trace.device_events",
                 "npualloc.replay.Comparison.format", "npualloc.replay.RecordedRun.to_dict",
                 "npualloc.acl.init", "npualloc.acl.rt.malloc", "npualloc.acl.rt.ipc_mem_close",
                 "npualloc.acl.util.ptr_to_bytes", "npualloc.acl.util.ptr_to_numpy", "npualloc.faults.inject",
                 "npualloc.workload.TransformerConfig.of_size", "npualloc.testing.restart"):
        assert name in api, name
    # every acl.rt function (the pyACL face is 67 C functions of csrc/python/acl_rt_py.c and ipc_py.c)
    from npualloc import acl
    rt_functions = {f"npualloc.acl.rt.{name}" for name in dir(acl.rt) if not name.startswith("_")}
    assert len(rt_functions) == 67 and rt_functions <= set(api)
    undocumented = sorted(name for name, obj in api.items() if not (obj.__doc__ or "").strip())
    assert undocumented == []


def test_public_functions_have_signatures():
    """help() and inspect.signature() can tell the parameters of every public function and method, those of
    the C extension (acl.rt, acl.util, npualloc.empty, ...) included: their docstrings carry text signatures."""
    import inspect

    missing = []
    for name, obj in _documented_api():
        if isinstance(obj, property) or inspect.isclass(obj):
            continue
        try:
            inspect.signature(obj)
        except ValueError:
            missing.append(name)
    assert missing == []
