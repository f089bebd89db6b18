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


def _documented_api():
    """(qualified name, object) for every function and class in npualloc.__all__ and npualloc.replay.__all__,
    and for the public methods and properties those classes define (members inherited from Python's own
    classes, such as an exception's ``args``, are Python's to document)."""
    import inspect

    import npualloc
    from npualloc import replay

    for module, prefix in ((npualloc, "npualloc."), (replay, "npualloc.replay.")):
        for name in module.__all__:
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or inspect.isroutine(obj)):
                continue  # a submodule
            yield prefix + name, obj
            if not inspect.isclass(obj):
                continue
            for klass in obj.__mro__:
                if not klass.__module__.startswith("npualloc"):
                    continue
                for member, value in vars(klass).items():
                    if member.startswith("_") or inspect.ismemberdescriptor(value):
                        continue  # private, or a __slots__ attribute (data, not a method)
                    if isinstance(value, (classmethod, staticmethod)):
                        value = value.__func__
                    yield f"{prefix}{name}.{member}", value


def test_public_functions_classes_and_methods_have_docstrings():
    api = dict(_documented_api())
    # the listed ones are covered (not skipped by the walk above)
    for name in ("npualloc.memory_allocated", "npualloc.get_allocator_backend", "npualloc.GraphExec.launch",
                 "npualloc.GraphExec.replay", "npualloc.GraphExec.destroyed", "npualloc.MemPool.device",
                 "npualloc.Stream.device_index", "npualloc.Event.npu_event", "npualloc.replay.Trace.device_events",
                 "npualloc.replay.Comparison.format", "npualloc.replay.RecordedRun.to_dict"):
        assert name in api, name
    undocumented = sorted(name for name, obj in api.items() if not (obj.__doc__ or "").strip())
    assert undocumented == []
