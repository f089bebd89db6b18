"""pyACL argument conventions over every acl.rt function (TypeError for wrong types, codes for
bad values), the constants against acl_rt.h, environment configuration errors, and the README."""
import inspect
import re

import pytest

import npualloc
from conftest import ROOT, run_python
from npualloc import acl

rt = acl.rt

PROP = {"handleType": 0, "allocationType": 0, "memAttr": 4, "location": {"id": 0, "type": 1}, "reserve": 0}
CALLBACK = (lambda data: None)

# name -> argument names, as the binding's TypeErrors name them (launch_callback's user_data, which the binding
# never checks, is named as in acl_rt.h and CANN's userData; pyACL's documentation calls it user_data_list);
# "prop", "fn", "user_data", "key" and "pid_list" are not ints, every other argument is.
SIGNATURES = {
    "set_device": ["device_id"],
    "reset_device": ["device_id"],
    "reset_device_force": ["device_id"],
    "get_device": [],
    "get_device_count": [],
    "create_context": ["device_id"],
    "destroy_context": ["context"],
    "set_context": ["context"],
    "get_context": [],
    "ctx_get_current_default_stream": [],
    "get_run_mode": [],
    "synchronize_device": [],
    "synchronize_device_with_timeout": ["timeout"],
    "device_can_access_peer": ["device_id", "peer_device_id"],
    "device_enable_peer_access": ["peer_device_id", "flags"],
    "device_disable_peer_access": ["peer_device_id"],
    "malloc": ["size", "policy"],
    "malloc_align32": ["size", "policy"],
    "malloc_cached": ["size", "policy"],
    "free": ["dev_ptr"],
    "malloc_host": ["size"],
    "free_host": ["host_ptr"],
    "memset": ["dev_ptr", "max_count", "value", "count"],
    "memcpy": ["dst", "dest_max", "src", "count", "kind"],
    "memcpy2d": ["dst", "dpitch", "src", "spitch", "width", "height", "kind"],
    "get_mem_info": ["attr"],
    "mem_get_allocation_granularity": ["prop", "option"],
    "malloc_physical": ["size", "prop", "flags"],
    "free_physical": ["handle"],
    "reserve_mem_address": ["size", "alignment", "expect_ptr", "flags"],
    "release_mem_address": ["vir_ptr"],
    "map_mem": ["vir_ptr", "size", "offset", "handle", "flags"],
    "unmap_mem": ["vir_ptr"],
    "create_stream": [],
    "create_stream_with_config": ["priority", "flag"],
    "destroy_stream": ["stream"],
    "synchronize_stream": ["stream"],
    "synchronize_stream_with_timeout": ["stream", "timeout"],
    "stream_query": ["stream"],
    "memcpy_async": ["dst", "dest_max", "src", "count", "kind", "stream"],
    "memcpy2d_async": ["dst", "dpitch", "src", "spitch", "width", "height", "kind", "stream"],
    "memset_async": ["dev_ptr", "max_count", "value", "count", "stream"],
    "launch_callback": ["fn", "user_data", "block_type", "stream"],
    "create_event": [],
    "create_event_with_flag": ["flag"],
    "create_event_ex_with_flag": ["flag"],
    "destroy_event": ["event"],
    "reset_event": ["event", "stream"],
    "record_event": ["event", "stream"],
    "query_event": ["event"],
    "query_event_status": ["event"],
    "query_event_wait_status": ["event"],
    "synchronize_event": ["event"],
    "synchronize_event_with_timeout": ["event", "timeout"],
    "event_elapsed_time": ["start", "end"],
    "stream_wait_event": ["stream", "event"],
    "subscribe_report": ["thread_id", "stream"],
    "unsubscribe_report": ["thread_id", "stream"],
    "process_report": ["timeout"],
    # cross-process sharing (csrc/python/ipc_py.c; "key" is a str and "pid_list" a list)
    "mem_export_to_shareable_handle": ["handle", "handle_type", "flags"],
    "mem_set_pid_to_shareable_handle": ["shareable_handle", "pid_list"],
    "mem_import_from_shareable_handle": ["shareable_handle", "device_id"],
    "device_get_bare_tgid": [],
    "ipc_mem_get_export_key": ["dev_ptr", "size", "len", "flags"],
    "ipc_mem_set_import_pid": ["key", "pid_list"],
    "ipc_mem_import_by_key": ["key", "flags"],
    "ipc_mem_close": ["key"],
}


def valid_value(argname):
    return {"prop": PROP, "fn": CALLBACK, "user_data": None, "key": "", "pid_list": [1]}.get(argname, 0)


def test_every_acl_rt_function_is_covered():
    public = {name for name in dir(rt) if not name.startswith("_")}
    assert public == set(SIGNATURES)


INT_ARGS = [(name, i, arg) for name, args in SIGNATURES.items() for i, arg in enumerate(args)
            if arg not in ("prop", "fn", "user_data", "key", "pid_list")]


@pytest.mark.usefixtures("npu")
@pytest.mark.parametrize("bad", ["1", 1.0, None, [1], b"\x01"], ids=["str", "float", "None", "list", "bytes"])
@pytest.mark.parametrize("name,index,argname", INT_ARGS, ids=[f"{n}.{a}" for n, _, a in INT_ARGS])
def test_wrong_type_raises_type_error_naming_function_and_argument(name, index, argname, bad):
    args = [valid_value(a) for a in SIGNATURES[name]]
    args[index] = bad
    with pytest.raises(TypeError, match=rf"acl\.rt\.{name}\(\) argument '{argname}' must be int"):
        getattr(rt, name)(*args)


@pytest.mark.usefixtures("npu")
@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_wrong_argument_count_raises_type_error(name):
    args = [valid_value(a) for a in SIGNATURES[name]]
    with pytest.raises(TypeError, match=rf"acl\.rt\.{name}\(\) takes exactly {len(args)} argument"):
        getattr(rt, name)(*args, 0)
    if args:
        with pytest.raises(TypeError, match=rf"acl\.rt\.{name}\(\) takes exactly"):
            getattr(rt, name)(*args[:-1])
    with pytest.raises(TypeError):
        getattr(rt, name)(*args, keyword=1)


@pytest.mark.usefixtures("npu")
@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_argument_errors_start_with_pyacls_args_parse_failed(name):
    """A wrong argument count, a keyword argument and a wrong type: TypeError with pyACL's message
    "acl.rt.NAME args parse failed", then ": " and npualloc's reason."""
    fn = getattr(rt, name)
    args = [valid_value(a) for a in SIGNATURES[name]]
    cases = [(args + [0], {}, f"takes exactly {len(args)} argument{'' if len(args) == 1 else 's'} "
                              f"({len(args) + 1} given)"),
             (args, {"keyword": 1}, "takes no keyword arguments")]
    if args:
        cases.append(([object()] + args[1:], {}, f"argument '{SIGNATURES[name][0]}' must be "))
    for call_args, kwargs, reason in cases:
        with pytest.raises(TypeError) as err:
            fn(*call_args, **kwargs)
        assert str(err.value).startswith(f"acl.rt.{name} args parse failed: acl.rt.{name}() {reason}"), err.value


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_text_signature_names_the_arguments_the_binding_takes(name):
    """help() and inspect.signature() read the text signature of each docstring (csrc/python/rt_binding.h:
    RT_DOC): the binding's names, positional-only (RT_BEGIN refuses keywords), none with a default (it takes
    an exact count)."""
    fn = getattr(rt, name)
    params = inspect.signature(fn).parameters.values()
    assert [p.name for p in params] == SIGNATURES[name]
    assert all(p.kind is p.POSITIONAL_ONLY and p.default is p.empty for p in params)
    assert fn.__text_signature__ == "($module" + "".join(f", {p}" for p in SIGNATURES[name]) + ", /)"


@pytest.mark.usefixtures("npu")
@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_calls_made_from_the_signature_are_the_bindings(name):
    """Calls built from inspect.signature() alone, so that a wrong signature fails here: its count is the one
    the binding takes; each argument, positional-only in the signature, is refused by name; a value of the
    wrong type in each position raises the error that names the signature's parameter."""
    fn = getattr(rt, name)
    params = list(inspect.signature(fn).parameters.values())
    args = [valid_value(p.name) for p in params]
    with pytest.raises(TypeError, match=rf"takes exactly {len(params)} argument"):
        fn(*args, 0)
    if params:
        with pytest.raises(TypeError, match=rf"takes exactly {len(params)} argument"):
            fn(*args[:-1])
    for i, p in enumerate(params):
        assert p.kind is p.POSITIONAL_ONLY  # (a keyword-capable one would need a call by name that works)
        with pytest.raises(TypeError, match="takes no keyword arguments"):
            fn(*args[:i], *args[i + 1:], **{p.name: args[i]})
        if p.name == "user_data":
            continue  # any object is user data: no wrong type to name it
        wrong = list(args)
        wrong[i] = object()
        if p.name == "pid_list":  # pyACL's words, which number the argument
            with pytest.raises(ValueError, match=f"argument {i + 1} only support the format of list"):
                fn(*wrong)
        else:
            with pytest.raises(TypeError, match=rf"acl\.rt\.{name}\(\) argument '{p.name}' must be "):
                fn(*wrong)


def out_of_range(argname):
    """An argument that makes the call fail with a code and change nothing: ints out of their C range (but
    len 65, as a larger one raises ValueError), the other arguments valid."""
    if argname in ("prop", "fn", "user_data", "key", "pid_list"):
        return valid_value(argname)
    return 65 if argname == "len" else 2**64


@pytest.mark.usefixtures("dev0")
@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_docstring_gives_the_call_form_and_what_the_call_returns(name):
    """The docstring opens with pyACL's call form, "RET = acl.rt.NAME(ARGS)" with the signature's arguments,
    then one to three lines on the C function; RET is what the call returns: ``ret``, an int, or a tuple of
    outputs with ``ret`` last (pyACL's convention)."""
    fn = getattr(rt, name)
    params = list(inspect.signature(fn).parameters)
    call_form, *description = fn.__doc__.split("\n")
    returns, _, call = call_form.partition(" = ")
    assert call == f"acl.rt.{name}({', '.join(params)})"
    assert 1 <= len(description) <= 3 and description[0].startswith("aclrt"), fn.__doc__
    result = fn(*[out_of_range(p) for p in params])
    if returns == "ret":
        assert type(result) is int
    else:
        outputs = returns.removeprefix("(").removesuffix(")").split(", ")
        assert len(outputs) >= 2 and outputs[-1] == "ret", returns
        assert type(result) is tuple and len(result) == len(outputs) and type(result[-1]) is int, result
    if name in ("create_stream", "create_event"):  # the calls without arguments that make something
        assert result[1] == 0
        assert (rt.destroy_stream if name == "create_stream" else rt.destroy_event)(result[0]) == 0


@pytest.mark.usefixtures("npu")
def test_int_subclasses_and_index_objects_are_ints():
    class Index:
        def __index__(self):
            return 0

    assert rt.set_device(True) == 0  # bool is an int, as for pyACL
    assert rt.get_device() == (1, 0)
    assert rt.set_device(Index()) == 0
    assert rt.get_device() == (0, 0)


@pytest.mark.usefixtures("npu")
@pytest.mark.parametrize("name,prop_index", [("malloc_physical", 1), ("mem_get_allocation_granularity", 0)])
def test_prop_dict_type_errors(name, prop_index):
    fn = getattr(rt, name)

    def call(prop):
        args = [valid_value(a) for a in SIGNATURES[name]]
        args[prop_index] = prop
        args[0 if prop_index else 1] = 2 << 20 if name == "malloc_physical" else 0
        return fn(*args)

    pre = rf"acl\.rt\.{name}\(\) argument "
    for not_dict in (None, [PROP], "prop", 4):
        with pytest.raises(TypeError, match=pre + "'prop' must be dict"):
            call(not_dict)
    for key in ("handleType", "allocationType", "memAttr", "location", "reserve"):
        missing = {k: v for k, v in PROP.items() if k != key}
        with pytest.raises(TypeError, match=pre + f"'prop' has no key '{key}'"):
            call(missing)
        if key != "location":
            with pytest.raises(TypeError, match=pre + f"'prop.{key}' must be int, not str"):
                call(dict(PROP, **{key: "4"}))
    for key in ("id", "type"):
        loc = {k: v for k, v in PROP["location"].items() if k != key}
        with pytest.raises(TypeError, match=pre + f"'prop' has no key 'location.{key}'"):
            call(dict(PROP, location=loc))
        with pytest.raises(TypeError, match=pre + rf"'prop.location.{key}' must be int, not float"):
            call(dict(PROP, location=dict(PROP["location"], **{key: 1.0})))
    with pytest.raises(TypeError, match=pre + "'prop' key 'location' must be dict, not tuple"):
        call(dict(PROP, location=(0, 1)))
    # extra keys are ignored, like pyACL
    assert call(dict(PROP, extra="ignored"))[1] == 0


# Values of the right type that are out of range: an ACL code, never an exception.
BIG = 2**64
BAD_VALUES = [
    ("set_device", (-1,), acl.ACL_ERROR_RT_INVALID_DEVICEID),
    ("set_device", (BIG,), acl.ACL_ERROR_RT_INVALID_DEVICEID),
    ("reset_device", (-BIG,), acl.ACL_ERROR_RT_INVALID_DEVICEID),
    ("reset_device_force", (BIG,), acl.ACL_ERROR_RT_INVALID_DEVICEID),
    ("malloc", (-1, 0), (0, acl.ACL_ERROR_INVALID_PARAM)),
    ("malloc", (BIG, 0), (0, acl.ACL_ERROR_INVALID_PARAM)),
    ("malloc", (BIG - 1, 0), (0, acl.ACL_ERROR_INVALID_PARAM)),  # size + 31 + pad overflows, as in CANN's ACL
    ("malloc", (BIG - 65, 0), (0, acl.ACL_ERROR_RT_MEMORY_ALLOCATION)),
    ("malloc", (64, BIG), (0, acl.ACL_ERROR_INVALID_PARAM)),
    ("malloc_align32", (-(2**100), 0), (0, acl.ACL_ERROR_INVALID_PARAM)),
    ("malloc_cached", (0, 0), (0, acl.ACL_ERROR_INVALID_PARAM)),
    ("free", (-1,), acl.ACL_ERROR_RT_MEMORY_FREE),
    ("free", (BIG,), acl.ACL_ERROR_RT_MEMORY_FREE),
    ("malloc_host", (-1,), (0, acl.ACL_ERROR_INVALID_PARAM)),
    ("free_host", (BIG,), acl.ACL_ERROR_RT_MEMORY_FREE),
    ("memset", (-1, 1, 0, 1), acl.ACL_ERROR_INVALID_PARAM),
    ("memcpy", (1, BIG, 1, 1, 1), acl.ACL_ERROR_INVALID_PARAM),
    ("get_mem_info", (BIG,), (0, 0, 0)),
    ("malloc_physical", (-(2 << 20), PROP, 0), (0, acl.ACL_ERROR_INVALID_PARAM)),
    ("malloc_physical", (2 << 20, PROP, BIG), (0, acl.ACL_ERROR_INVALID_PARAM)),
    ("malloc_physical", (2 << 20, dict(PROP, memAttr=BIG), 0), (0, acl.ACL_ERROR_INVALID_PARAM)),
    ("malloc_physical", (2 << 20, dict(PROP, location={"id": -1, "type": 1}), 0),
     (0, acl.ACL_ERROR_RT_INVALID_DEVICEID)),
    ("mem_get_allocation_granularity", (PROP, BIG), (0, acl.ACL_ERROR_RT_FEATURE_NOT_SUPPORT)),
    ("free_physical", (-5,), acl.ACL_ERROR_RT_INVALID_HANDLE),
    ("free_physical", (12345,), acl.ACL_ERROR_RT_INVALID_HANDLE),
    ("reserve_mem_address", (BIG, 0, 0, 0), (0, acl.ACL_ERROR_INVALID_PARAM)),
    ("reserve_mem_address", (2 << 20, -1, 0, 0), (0, acl.ACL_ERROR_INVALID_PARAM)),
    ("release_mem_address", (-1,), acl.ACL_ERROR_RT_PARAM_INVALID),
    ("map_mem", (-1, 2 << 20, 0, 1, 0), acl.ACL_ERROR_RT_INVALID_HANDLE),
    ("unmap_mem", (BIG,), acl.ACL_ERROR_RT_PARAM_INVALID),
    ("destroy_stream", (-1,), acl.ACL_ERROR_INVALID_PARAM),
    ("synchronize_stream", (BIG,), acl.ACL_ERROR_INVALID_PARAM),
    ("synchronize_stream_with_timeout", (BIG, -1), acl.ACL_ERROR_INVALID_PARAM),
    ("synchronize_stream_with_timeout", (0, BIG), acl.ACL_ERROR_RT_PARAM_INVALID),
    ("stream_query", (-1,), (acl.ACL_STREAM_STATUS_RESERVED, acl.ACL_ERROR_INVALID_PARAM)),
    ("memcpy_async", (1, 1, 1, 1, 1, -1), acl.ACL_ERROR_INVALID_PARAM),
    ("memset_async", (1, 1, BIG, 1, 0), acl.ACL_ERROR_INVALID_PARAM),
    ("launch_callback", (CALLBACK, None, BIG, 0), acl.ACL_ERROR_INVALID_PARAM),
    ("destroy_event", (-1,), acl.ACL_ERROR_INVALID_PARAM),
    ("record_event", (BIG, 0), acl.ACL_ERROR_INVALID_PARAM),
    ("query_event", (-1,), (0, acl.ACL_ERROR_INVALID_PARAM)),
    ("query_event_status", (BIG,), (0, acl.ACL_ERROR_INVALID_PARAM)),
    ("query_event_wait_status", (BIG,), (0, acl.ACL_ERROR_INVALID_PARAM)),
    ("create_event_with_flag", (BIG,), (0, acl.ACL_ERROR_RT_PARAM_INVALID)),
    ("create_event_with_flag", (-1,), (0, acl.ACL_ERROR_RT_PARAM_INVALID)),
    ("create_event_ex_with_flag", (BIG,), (0, acl.ACL_ERROR_RT_PARAM_INVALID)),
    ("create_stream_with_config", (BIG, 0), (0, acl.ACL_ERROR_INVALID_PARAM)),
    ("create_stream_with_config", (0, BIG), (0, acl.ACL_ERROR_RT_PARAM_INVALID)),
    ("reset_event", (-1, 0), acl.ACL_ERROR_INVALID_PARAM),
    ("reset_event", (BIG, 0), acl.ACL_ERROR_INVALID_PARAM),
    ("synchronize_device_with_timeout", (-BIG,), acl.ACL_ERROR_RT_PARAM_INVALID),
    ("synchronize_device_with_timeout", (-2,), acl.ACL_ERROR_RT_PARAM_INVALID),
    ("synchronize_event", (-1,), acl.ACL_ERROR_INVALID_PARAM),
    ("synchronize_event_with_timeout", (-1, 10), acl.ACL_ERROR_INVALID_PARAM),
    ("synchronize_event_with_timeout", (-1, -BIG), acl.ACL_ERROR_RT_PARAM_INVALID),
    ("event_elapsed_time", (-1, BIG), (0.0, acl.ACL_ERROR_INVALID_PARAM)),
    ("stream_wait_event", (0, -1), acl.ACL_ERROR_INVALID_PARAM),
    ("subscribe_report", (1, -1), acl.ACL_ERROR_INVALID_PARAM),
    ("unsubscribe_report", (-1, 0), acl.ACL_ERROR_RT_STREAM_SUBSCRIBE),
    ("process_report", (BIG,), acl.ACL_ERROR_INVALID_PARAM),
    ("device_can_access_peer", (0, BIG), (0, acl.ACL_ERROR_RT_INVALID_DEVICEID)),
    ("device_enable_peer_access", (1, -1), acl.ACL_ERROR_FEATURE_UNSUPPORTED),
    ("device_disable_peer_access", (-BIG,), acl.ACL_ERROR_RT_INVALID_DEVICEID),
]


@pytest.mark.usefixtures("dev0")
@pytest.mark.parametrize("name,args,expected", BAD_VALUES, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD_VALUES)])
def test_bad_values_return_codes(name, args, expected):
    assert getattr(rt, name)(*args) == expected


def test_constants_match_acl_rt_h():
    header = ROOT / "csrc" / "include" / "acl_rt.h"
    if not header.exists():
        pytest.skip("no source checkout")
    text = header.read_text()
    found = {}
    for m in re.finditer(r"#define\s+(ACL_\w+)\s+(0x[0-9A-Fa-f]+|\d+)U?L?\b", text):
        found[m.group(1)] = int(m.group(2), 0)
    for m in re.finditer(r"\b(ACL_\w+)\s*=\s*(0x[0-9A-Fa-f]+|\d+)", text):
        found[m.group(1)] = int(m.group(2), 0)
    assert len(found) > 100
    missing = sorted(name for name in found if not hasattr(acl, name))
    assert not missing, f"constants of acl_rt.h missing from npualloc.acl: {missing}"
    wrong = {name: (getattr(acl, name), value) for name, value in found.items() if getattr(acl, name) != value}
    assert not wrong
    assert acl.ACL_ERROR_REPEAT_FINALIZE == 100037


def test_configure_after_start_raises_runtime_error(dev0):
    with pytest.raises(RuntimeError, match=r"already initialised.*npualloc\.testing\.restart\(\.\.\.\) starts it again"):
        npualloc.configure(device_count=2)
    assert rt.get_device_count() == (dev0["device_count"], 0)


def test_inconsistent_configure_raises_value_error(restart, monkeypatch):
    restart()
    npualloc._C.shutdown()
    with pytest.raises(ValueError, match="NPUALLOC_HUGE_MEMORY must not exceed"):
        npualloc.configure(device_memory=1 << 30, huge_memory=2 << 30)
    # the message says where each value it names came from (the variable's name alone misled when the value
    # was given to configure())
    monkeypatch.setenv("NPUALLOC_HUGE_MEMORY", "16GiB")
    with pytest.raises(ValueError) as err:
        npualloc.configure(device_memory="1GiB")
    assert str(err.value) == ("NPUALLOC_HUGE_MEMORY must not exceed NPUALLOC_DEVICE_MEMORY (device_memory=1073741824 "
                              "given to configure(); huge_memory=17179869184 from NPUALLOC_HUGE_MEMORY)")


ENV_SCRIPT = r"""
import npualloc
from npualloc import acl
calls = [
    ("set_device", lambda: acl.rt.set_device(0)),
    ("get_device_count", lambda: acl.rt.get_device_count()),
    ("malloc", lambda: acl.rt.malloc(64, 0)),
    ("malloc_host", lambda: acl.rt.malloc_host(64)),
    ("create_stream", lambda: acl.rt.create_stream()),
    ("create_event", lambda: acl.rt.create_event()),
    ("get_mem_info", lambda: acl.rt.get_mem_info(1)),
    ("reserve_mem_address", lambda: acl.rt.reserve_mem_address(2 << 20, 0, 0, 0)),
    ("acl.init", lambda: acl.init()),
    ("ptr_to_bytes", lambda: acl.util.ptr_to_bytes(1 << 45, 4)),
    ("config", lambda: npualloc._C.config()),
]
for name, call in calls:
    try:
        print(name, "RETURNED", call())
    except ValueError as exc:
        print(name, "ValueError", exc)
"""


@pytest.mark.parametrize("var,value", [("NPUALLOC_DEVICE_MEMORY", "lots"), ("NPUALLOC_DEVICE_MEMORY", "12 parsecs"),
                                       ("NPUALLOC_DEVICE_COUNT", "0"), ("NPUALLOC_DEVICE_COUNT", " 4"),
                                       ("NPUALLOC_DEVICE_COUNT", "+4"), ("NPUALLOC_DDR_MEMORY", "-1"),
                                       ("NPUALLOC_VA_SPACE", "huge"), ("NPUALLOC_FD_BUDGET", "many"),
                                       ("NPUALLOC_IPC_TIMEOUT_MS", "1s")])
def test_malformed_environment_raises_value_error(var, value):
    proc = run_python(ENV_SCRIPT, env={var: value})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 11
    for line in lines:
        name, outcome, message = line.split(" ", 2)
        assert outcome == "ValueError", line
        assert var in message and value in message, line


def test_valid_environment_configures_the_devices():
    code = "from npualloc import acl; print(acl.rt.get_device_count(), acl.rt.set_device(0), acl.rt.get_mem_info(1))"
    proc = run_python(code, env={"NPUALLOC_DEVICE_COUNT": "3", "NPUALLOC_DEVICE_MEMORY": "1.5GiB"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"(3, 0) 0 ({3 << 29}, {3 << 29}, 0)"


def test_configure_takes_an_empty_huge_memory_variable_as_unset():
    # as the runtime does: huge pages then default to all of configure()'s device memory (an empty variable
    # kept the 64 GiB default, and the 1 GiB device was refused as smaller than its huge pages)
    code = 'import npualloc; npualloc.configure(device_memory="1GiB"); print(npualloc._C.config()["huge_memory"])'
    proc = run_python(code, env={"NPUALLOC_HUGE_MEMORY": ""})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(1 << 30)


def test_readme_example_runs_as_written():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    example = next(b for b in blocks if "acl.util.ptr_to_bytes" in b)
    expected = re.search(r"print\(.*\)\s+# (.*)", example).group(1).strip()
    proc = run_python(example)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == expected == "b'ZZZZZZZZZZZZZZZZ'"
