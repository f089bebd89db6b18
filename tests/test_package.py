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
