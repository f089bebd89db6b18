"""`python -m npualloc replay` and `python -m npualloc demo`, in subprocesses: tables, JSON, plots, and one-line
errors, no traceback: exit status 2 for usage errors, 1 for a run that failed (missing, unreadable and
malformed traces, outputs that cannot be written)."""
import json
import os
import pickle
import re
import resource
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import npualloc
from npualloc import workload

PKG_PARENT = str(Path(npualloc.__file__).resolve().parent.parent)  # the checkout this test imported


def _limit_address_space():
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


UNDER_ASAN = "libasan" in os.environ.get("LD_PRELOAD", "")


def cli(*args, cwd=None, timeout=120, input=None, limit_memory=False):
    """Runs the CLI; limit_memory caps its address space at 2 GiB (a runaway read fails instead of
    taking the machine's memory), except under AddressSanitizer (make pytest-asan), whose shadow
    memory needs terabytes of address space: there a runaway read would still fail the test, later."""
    return subprocess.run([sys.executable, "-m", "npualloc", *map(str, args)], cwd=cwd, env=_cli_env(),
                          capture_output=True, text=input is None, timeout=timeout, input=input,
                          preexec_fn=_limit_address_space if limit_memory and not UNDER_ASAN else None)


def cli_reading(producer, *args, timeout=60):
    """Runs the CLI with its standard input fed by the shell command `producer`, memory limited as cli()'s."""
    command = f"{producer} | {shlex.quote(sys.executable)} -m npualloc {' '.join(shlex.quote(str(a)) for a in args)}"
    return subprocess.run(command, shell=True, env=_cli_env(), capture_output=True, text=True, timeout=timeout,
                          preexec_fn=None if UNDER_ASAN else _limit_address_space)


def _cli_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NPUALLOC_", "PYTORCH_"))}
    env["PYTHONPATH"] = PKG_PARENT + os.pathsep + env.get("PYTHONPATH", "")
    env["MPLBACKEND"] = "Agg"
    return env


def assert_one_line_error(p, *needles, status, command="replay"):
    assert p.returncode == status, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith(f"python -m npualloc {command}: error: "), lines[0]
    for n in needles:
        assert n in lines[0], lines[0]


def assert_usage_error(p, *needles, command="replay"):
    """The command line itself is wrong: exit status 2, as argparse's usage errors."""
    assert_one_line_error(p, *needles, status=2, command=command)


def assert_run_error(p, *needles, command="replay"):
    """A valid command line whose run failed (input or output): exit status 1."""
    assert_one_line_error(p, *needles, status=1, command=command)


@pytest.fixture(scope="module")
def tiny_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "tiny.pickle"
    with open(path, "wb") as f:
        pickle.dump(workload.transformer_trace("tiny"), f)
    return path


def test_replay_prints_a_row_per_setting_next_to_the_recorded_run(tiny_trace, tmp_path):
    out_json, out_png = tmp_path / "r.json", tmp_path / "t.png"
    p = cli("replay", tiny_trace, "--conf", "", "--conf", "max_split_size_mb:128", "--conf",
            "garbage_collection_threshold:0.8,per_process_memory_fraction:0.9", "--device-memory", "2GiB",
            "--json", out_json, "--plot", out_png)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("setting"))
    for col in ("peak req", "peak alloc", "peak active", "peak resv", "frag", "dev allocs", "dev frees", "retries",
                "OOMs", "wall ms", "Mev/s"):
        assert col in lines[header]
    assert lines[header + 2].startswith("(recorded run)")
    assert lines[header + 3].startswith("default ")
    assert lines[header + 4].startswith("max_split_size_mb:128 ")
    assert lines[header + 5].startswith("garbage_collection_threshold:0.8,per_process_memory_fraction:0.9")
    assert "reconstructed" in p.stdout and "device memory 2.00 GiB" in p.stdout
    data = json.loads(out_json.read_text())
    assert [r["label"] for r in data["results"]][:2] == ["default", "max_split_size_mb:128"]
    assert data["results"][0]["recorded"]["peak_reserved"] > 0
    # the answer: the least peak reserved among the three (none has an OOM), in the table and the JSON
    ranked = [r for r in data["results"] if not r["ooms"]]
    best = min(ranked, key=lambda r: (r["peak_reserved"], r["label"] != "default"))
    (verdict,) = [line for line in lines if line.startswith("least waste: ")]
    assert verdict.startswith(f"least waste: {best['label']}, peak reserved ")
    assert data["least_waste"] == [{"trace": best["trace"], "device": best["device"], "label": best["label"],
                                    "peak_reserved": best["peak_reserved"]}]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "%" not in p.stderr  # no progress bar: not a tty, short trace


@pytest.mark.parametrize("given, written, magic", [
    ("t", "t.png", b"\x89PNG"),      # no extension: .png appended, and the message says so
    ("t.", "t.png", b"\x89PNG"),
    ("t.SVG", "t.SVG", b"<?xml"),     # the extension picks the format, in any case
    ("t.pdf", "t.pdf", b"%PDF"),
])
def test_plot_names_the_file_it_wrote(tiny_trace, tmp_path, given, written, magic):
    p = cli("replay", tiny_trace, "--plot", tmp_path / given)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[-1] == f"timeline plot: {tmp_path / written}"
    assert (tmp_path / written).read_bytes().startswith(magic)
    assert sorted(f.name for f in tmp_path.iterdir()) == [written]


def test_plot_with_an_unknown_extension_fails_before_the_replay(tiny_trace, tmp_path):
    p = cli("replay", tiny_trace, "--plot", tmp_path / "t.xyz")
    assert_usage_error(p, "--plot", "t.xyz", "cannot write .xyz files", ".png", ".svg")
    assert p.stdout == ""  # no table: the replay did not run
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("existing", [True, False])
def test_plot_to_a_directory_is_refused_before_the_replay(tiny_trace, tmp_path, existing):
    plots = tmp_path / "plots"
    if existing:
        plots.mkdir()
    given = plots if existing else f"{plots}{os.sep}"  # a path ending in a separator names a directory
    p = cli("replay", tiny_trace, "--plot", given)
    assert_run_error(p, "is a directory", f"such as {plots / 'timeline.png'}")
    assert p.stdout == ""
    assert [f.name for f in tmp_path.iterdir()] == (["plots"] if existing else [])  # no plots.png beside it
    assert not existing or list(plots.iterdir()) == []


@pytest.mark.parametrize("option, name, written", [("--json", "r.json", "r.json"), ("--plot", "t", "t.png"),
                                                    ("--export-events", "e.bin", "e.bin")])
def test_an_output_in_a_missing_directory_fails_before_the_replay(tiny_trace, tmp_path, option, name, written):
    missing = tmp_path / "no-such-dir"
    p = cli("replay", tiny_trace, option, missing / name)
    assert_run_error(p, f"{option} {missing / written}: cannot write (the directory {missing} does not exist)")
    assert p.stdout == ""  # no table: the replay did not run


@pytest.mark.parametrize("option", ["--json", "--plot", "--export-events"])
def test_an_output_that_is_the_trace_is_refused(tiny_trace, tmp_path, option):
    trace = tmp_path / "t.png" if option == "--plot" else tmp_path / "t.pickle"  # --plot names its format
    trace.write_bytes(tiny_trace.read_bytes())
    p = cli("replay", trace, option, trace)
    assert_usage_error(p, f"{option} {trace} is a trace given on the command line: it would be overwritten")
    assert trace.read_bytes() == tiny_trace.read_bytes()  # --json wrote over it


def test_two_outputs_in_one_file_are_refused(tiny_trace, tmp_path):
    p = cli("replay", tiny_trace, "--json", tmp_path / "out.png", "--plot", tmp_path / "out.png")
    assert_usage_error(p, f"--plot {tmp_path / 'out.png'} is the --json file")
    assert list(tmp_path.iterdir()) == []


def test_an_output_that_is_a_directory_fails_before_the_replay(tiny_trace, tmp_path):
    for option in ("--json", "--export-events"):
        p = cli("replay", tiny_trace, option, tmp_path)
        assert_run_error(p, f"{option} {tmp_path}: is a directory")
        assert p.stdout == ""


@pytest.mark.skipif(shutil.which("xelatex") is not None, reason="xelatex installed: .pgf can be written")
def test_plot_format_whose_writer_is_missing_is_a_one_line_error(tiny_trace, tmp_path):
    assert_run_error(cli("replay", tiny_trace, "--plot", tmp_path / "t.pgf"), "t.pgf: cannot write the plot",
                          "xelatex")


@pytest.mark.parametrize("command", ["demo", "replay", "include"])
def test_module_usage_lists_every_option_of_the_command(command, capsys):
    from npualloc import __main__ as cli_module

    with pytest.raises(SystemExit):
        cli_module.main([command, "--help"])
    parsed = set(re.findall(r"\[(--[a-z0-9-]+)", capsys.readouterr().out)) - {"--help"}
    usage = cli_module.__doc__.split("\n\n")[1]  # the block after the title
    documented = re.split(r"^    python -m npualloc ", usage, flags=re.M)
    (entry,) = [e for e in documented if e.split(None, 1)[:1] == [command]]
    assert set(re.findall(r"\[(--[a-z0-9-]+)", entry)) == parsed


def test_replay_progress_bar_on_request(tiny_trace):
    p = cli("replay", tiny_trace, "--progress")
    assert p.returncode == 0
    assert "100%" in p.stderr and "[" in p.stderr


def test_replay_cuda_rounding_and_export(tiny_trace, tmp_path):
    p = cli("replay", tiny_trace, "--rounding", "cuda")
    assert p.returncode == 0 and " cuda " in p.stdout
    p = cli("replay", tiny_trace, "--export-events", tmp_path / "e.bin")
    assert p.returncode == 0 and (tmp_path / "e.bin").read_bytes()[:8] == b"NPUREPL1"


@pytest.mark.parametrize("options", [["--conf", "max_split_size_mb:1"], ["--json", "r.json"], ["--plot", "t.png"],
                                     ["--device-memory", "1GiB"], ["--rounding", "npu"], ["--on-oom", "stop"],
                                     ["--fraction", "0.5"], ["--huge1g-memory", "1GiB"], ["--progress"]])
def test_export_events_refuses_the_replay_options_it_would_ignore(tiny_trace, tmp_path, options):
    p = cli("replay", tiny_trace, "--export-events", tmp_path / "e.bin", *options)
    assert_usage_error(p, "--export-events writes the events and stops", f"{options[0]} would have no effect")
    assert sorted(tmp_path.iterdir()) == []  # neither the events nor the ignored outputs were written


def test_export_events_of_a_trace_of_several_devices_asks_for_the_option(tmp_path):
    path = tmp_path / "two.pickle"
    ev = [{"action": "alloc", "addr": 0x1000, "size": 5 << 20, "stream": 0}]
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [ev, ev]}))
    assert_run_error(cli("replay", path, "--export-events", tmp_path / "e.bin"),
                     "events on devices [0, 1]: choose one with --device")  # was "with device="
    p = cli("replay", path, "--export-events", tmp_path / "e.bin", "--device", "1")
    assert p.returncode == 0 and "wrote 1 events" in p.stdout


def test_missing_file(tmp_path):
    assert_run_error(cli("replay", tmp_path / "nope.pickle"), "nope.pickle", "no such file")


def test_not_a_pickle(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello, this is text\n")
    assert_run_error(cli("replay", path), "notes.txt", "not a readable pickle")


def test_a_directory_is_not_a_trace(tmp_path):
    assert_run_error(cli("replay", tmp_path), "is a directory")


def test_a_file_larger_than_memory_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "huge.pickle"
    with open(path, "wb") as f:  # sparse: twice the machine's memory, no disk
        f.truncate(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 2)
    assert_run_error(cli("replay", path, limit_memory=True), "huge.pickle", "too large to load",
                          "half of this machine's memory")


def test_an_endless_stream_is_refused_at_its_first_byte():
    # /dev/zero was read until memory ran out
    assert_run_error(cli("replay", "/dev/zero", limit_memory=True, timeout=60), "/dev/zero",
                          "not a readable pickle (unknown opcode at byte 0)")


def test_a_stream_that_goes_wrong_after_its_first_bytes_is_refused_there():
    # a pickle's PROTO, then /dev/zero: was read to half the machine's memory before the opcodes were checked
    assert_run_error(cli_reading("(printf '\\200\\004'; exec cat /dev/zero)", "replay", "/dev/stdin"), "/dev/stdin",
                     "not a readable pickle (unknown opcode at byte 2)")


@pytest.mark.parametrize("start, message", [
    ("\\200\\004\\216\\377\\377\\377\\377\\377\\377\\377\\177", "length beyond the memory limit at byte 2"),
    ("\\200\\004\\225\\377\\377\\377\\377\\377\\377\\377\\177", "frame beyond the memory limit at byte 2"),
    ("\\200\\002I", "NUL byte in a line at byte 2"),
])
def test_a_stream_whose_opcode_waits_for_more_than_it_may_hold_is_refused_there(start, message):
    # a length or frame of 2**63 bytes, or a number line that never ends, was read until memory ran out
    assert_run_error(cli_reading(f"(printf '{start}'; exec cat /dev/zero)", "replay", "/dev/stdin"), "/dev/stdin",
                     f"not a readable pickle ({message})")


def test_a_stream_is_read_without_waiting_for_its_writer_to_end(tiny_trace):
    # the pickle came whole, then the writer kept the stream open: the read waited for a whole MiB, or the end
    p = subprocess.Popen([sys.executable, "-m", "npualloc", "replay", "/dev/stdin"], env=_cli_env(),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=False)
    try:
        p.stdin.write(tiny_trace.read_bytes())
        p.stdin.flush()
        status = p.wait(timeout=120)  # the stream stays open all the while
    finally:
        p.stdin.close()
        if p.poll() is None:
            p.kill()
        out, err = p.stdout.read(), p.stderr.read()  # (its output is a few lines: no pipe filled meanwhile)
        p.wait()
    assert status == 0, err[-400:]
    assert b"least waste: " in out


def test_settings_that_copy_out_to_too_many_items_are_one_line_error(tmp_path):
    # 432 bytes: one list referred to 4 times at each of 30 levels (4**30 paths); checking the depth walked every
    # path, and to_dict() would copy every one
    nested = []
    for _ in range(30):
        nested = [nested] * 4
    path = tmp_path / "shared.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [[{"action": "alloc", "addr": 4096, "size": 100}]],
                                   "allocator_settings": {"x": nested}}))
    assert_run_error(cli("replay", path), "shared.pickle", "holds more than 100000 items")


def test_a_stream_is_read_up_to_its_pickles_stop(tiny_trace):
    # what follows the pickle on the stream (here an endless one) is not read: the unpickler would ignore it
    p = cli_reading(f"(cat {shlex.quote(str(tiny_trace))}; exec cat /dev/zero)", "replay", "/dev/stdin")
    assert p.returncode == 0, p.stderr[-400:]
    assert "least waste: " in p.stdout


def test_settings_nested_too_deep_are_one_line_error(tmp_path):
    # allocator_settings 5000 lists deep (built with opcodes, without recursion): to_dict() and json.dump
    # recursed once per level, and --json died with a RecursionError traceback
    path = tmp_path / "deep.pickle"
    traces = pickle.dumps([[{"action": "alloc", "addr": 4096, "size": 100, "stream": 0}]], protocol=2)[2:-1]
    path.write_bytes(b"\x80\x04}(\x8c\x0ddevice_traces" + traces + b"\x8c\x12allocator_settings}\x8c\x01x"
                     + b"]" * 5000 + b"a" * 4999 + b"su.")
    assert_run_error(cli("replay", path, "--json", tmp_path / "out.json"), "deep.pickle",
                     "'allocator_settings' nests more than 32 levels deep")


def test_a_trace_from_a_pipe_replays(tiny_trace):
    p = cli("replay", "/dev/stdin", input=tiny_trace.read_bytes())
    assert p.returncode == 0, p.stderr
    assert b"least waste: " in p.stdout


def test_unreadable_file(tmp_path):
    path = tmp_path / "locked.pickle"
    path.write_bytes(pickle.dumps({}))
    path.chmod(0)
    if os.geteuid() != 0:
        assert_run_error(cli("replay", path), "permission denied")
        return
    # root reads every file: run the CLI as nobody, with the trace in a directory nobody may enter
    tmp_path.chmod(0o755)
    if not os.access(PKG_PARENT, os.R_OK | os.X_OK, effective_ids=False) or \
            subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                            "import npualloc"], env=dict(os.environ, PYTHONPATH=PKG_PARENT),
                           capture_output=True).returncode != 0:
        pytest.skip("user nobody cannot import this checkout")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NPUALLOC_", "PYTORCH_"))}
    env["PYTHONPATH"] = PKG_PARENT
    p = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
                        "npualloc", "replay", str(path)], env=env, capture_output=True, text=True, timeout=120)
    assert_run_error(p, "permission denied")


@pytest.mark.parametrize("obj, needle", [
    ({"segments": []}, "no 'device_traces'"),
    ({"device_traces": "nope"}, "list of lists"),
    ({"device_traces": [[{"action": "alloc", "addr": 1, "size": -5}]]}, "'size' is negative"),
    ([1, 2, 3], "the pickle holds a list, not a dict"), ([], "list of segments"),
    ("a string", "holds a str"),
    ({"segments": [{"total_size": 10, "allocated_size": "x", "blocks": []}],
      "device_traces": [[{"action": "alloc", "addr": 1, "size": 5}]]}, "'allocated_size' must be an int"),
    ({"segments": [{"total_size": 10, "allocated_size": [1], "blocks": []}],
      "device_traces": [[{"action": "alloc", "addr": 1, "size": 5}]]}, "segments[0]: 'allocated_size'"),
    # a block alive at the end is reconstructed as an allocation: its address and size go to C as uint64
    ({"segments": [{"total_size": 2 << 20, "blocks": [{"address": 2**64, "size": 512, "state": "active_allocated"}]}],
      "device_traces": [[{"action": "alloc", "addr": 1, "size": 5}]]}, "segments[0].blocks[0]: 'address' is too large"),
    ({"segments": [{"total_size": 2 << 20, "blocks": [{"address": 4096, "size": 2**70, "state": "active_allocated"}]}],
      "device_traces": [[{"action": "alloc", "addr": 1, "size": 5}]]}, "segments[0].blocks[0]: 'size' is too large"),
    ({"segments": [{"total_size": 2 << 20, "blocks": [{"address": 4096, "size": 512, "requested_size": 2**64,
                                                       "state": "active_pending_free"}]}],
      "device_traces": [[{"action": "alloc", "addr": 1, "size": 5}]]},
     "segments[0].blocks[0]: 'requested_size' is too large"),
])
def test_malformed_snapshot(tmp_path, obj, needle):
    path = tmp_path / "bad.pickle"
    with open(path, "wb") as f:
        pickle.dump(obj, f)
    assert_run_error(cli("replay", path), "bad.pickle", needle)


class _Evil:
    def __init__(self, cmd):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def test_malicious_pickle_is_refused_without_running(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pickle"
    payload = pickle.dumps({"device_traces": [[_Evil(f"touch {marker}")]]})
    path.write_bytes(payload)
    assert_run_error(cli("replay", path), "refused to load", "posix.system")
    assert not marker.exists()


def test_conf_takes_several_settings_at_once(tiny_trace):
    p = cli("replay", tiny_trace, "--conf", "", "max_split_size_mb:128", "--conf", "expandable_segments:True",
            "--device-memory", "2GiB")
    assert p.returncode == 0, p.stderr
    rows = [line.split()[0] for line in p.stdout.splitlines()[4:7]]  # after the recorded run
    assert rows == ["default", "max_split_size_mb:128", "expandable_segments:True"], p.stdout


def test_on_oom_stop_and_where(tmp_path):
    path = tmp_path / "oom.pickle"
    ev = [{"action": "alloc", "addr": a, "size": 60 << 20, "stream": 0, "time_us": t}
          for a, t in ((0x1000, 100), (0x2000, 200), (0x3000, 300))]
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [ev]}))
    p = cli("replay", path, "--device-memory", "100MiB", "--on-oom", "stop")
    assert p.returncode == 0, p.stderr
    assert "1 stop" in p.stdout
    assert "first oom.pickle [default]: OOM at device_traces[0][1] (time_us 200): 60.00 MiB" in p.stdout
    p = cli("replay", path, "--device-memory", "100MiB")
    assert "OOM at device_traces[0][1] (time_us 200): 60.00 MiB on stream 0x0 (1 more)" in p.stdout


def test_bad_conf_and_options(tiny_trace):
    assert_usage_error(cli("replay", tiny_trace, "--conf", "max_split_size_mb:1"),
                          "max_split_size_mb too small")
    assert_usage_error(cli("replay", tiny_trace, "--device-memory", "lots"), "--device-memory")
    p = cli("replay", tiny_trace, "--rounding", "tpu")
    assert p.returncode == 2 and "Traceback" not in p.stderr


def test_a_bad_setting_is_a_usage_error_before_any_trace_is_read(tmp_path):
    p = cli("replay", tmp_path / "missing.pickle", "--conf", "", "foo:1")
    assert_usage_error(p, "setting 'foo:1': Unrecognized key 'foo' in NPU allocator config")
    assert p.stderr.rstrip("\n").endswith("config")  # not torch_npu's dangling ", "


@pytest.mark.parametrize("device", ["-1", "one"])
def test_a_device_that_is_not_an_index_is_a_usage_error(tmp_path, device):
    p = cli("replay", tmp_path / "missing.pickle", "--device", device)
    assert_usage_error(p, f"argument --device: invalid device index value: '{device}'")


def test_a_trace_taken_for_a_setting_is_pointed_out(tiny_trace):
    p = cli("replay", tiny_trace, "--conf", "expandable_segments:True", tiny_trace)
    assert_usage_error(p, f"setting '{tiny_trace}': Unrecognized key", "(a trace? --conf takes every word after it")
    p = cli("replay", "--conf", "expandable_segments:True", "--", tiny_trace)  # as the hint says
    assert p.returncode == 0, p.stderr
    # --conf first took every trace: argparse's "required: trace" says why too
    p = cli("replay", "--conf", "expandable_segments:True", tiny_trace)
    assert_usage_error(p, "the following arguments are required: trace (--conf takes every word after it: give "
                          "the traces first, or end the settings with --)")
    assert_usage_error(cli("replay"), "the following arguments are required: trace")
    assert "--conf takes" not in cli("replay").stderr


def test_device_memory_beyond_the_largest_device_names_the_option(tiny_trace):
    assert_usage_error(cli("replay", tiny_trace, "--device-memory", "2000000TiB"),
                       "--device-memory must be at most 1 EiB")


def test_huge1g_memory_is_the_pool_of_the_page_size_1g_settings_only(tiny_trace, tmp_path):
    out = tmp_path / "r.json"
    p = cli("replay", tiny_trace, "--conf", "", "page_size:1g", "--device-memory", "2GiB", "--huge1g-memory", "2GiB",
            "--json", out)
    assert p.returncode == 0, p.stderr
    default, huge = json.loads(out.read_text())["results"]
    assert default["huge1g_memory"] == 0 and default["ooms"] == 0  # its device kept its memory
    assert huge["huge1g_memory"] == 2 << 30
    assert_usage_error(cli("replay", tiny_trace, "--huge1g-memory", "1GiB"), "--huge1g-memory",
                       "no --conf setting asks for page_size:1g")


def test_json_of_a_trace_whose_allocator_settings_hold_any_plain_data(tmp_path):
    path, out = tmp_path / "odd.pickle", tmp_path / "r.json"
    ev = [{"action": "alloc", "addr": 0x1000, "size": 5 << 20, "stream": 0}]
    settings = {"bytes": b"abc", (1, 2): "tuple key", "set": {3}, "nan": float("nan"), "nested": {"t": (1, 2)}}
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [ev], "allocator_settings": settings}))
    p = cli("replay", path, "--json", out)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr  # was a TypeError and a half-written file
    text = out.read_text()
    assert "NaN" not in text  # strict JSON
    got = json.loads(text)["results"][0]["recorded"]["settings"]
    assert got == {"bytes": "abc", "(1, 2)": "tuple key", "set": [3], "nan": "nan", "nested": {"t": [1, 2]}}


def test_traces_of_the_same_file_name_keep_their_own_results(tmp_path):
    paths = []
    for run, seed in (("run1", 0), ("run2", 1)):
        (tmp_path / run).mkdir()
        paths.append(tmp_path / run / "snapshot.pickle")
        paths[-1].write_bytes(pickle.dumps(workload.transformer_trace("tiny", seed=seed)))
    out = tmp_path / "r.json"
    p = cli("replay", *paths, paths[0], "--conf", "", "expandable_segments:True", "--json", out)
    assert p.returncode == 0, p.stderr
    names = [str(paths[0]), str(paths[1]), f"{paths[0]}#2"]
    assert [line.split(" (device")[0] for line in p.stdout.splitlines() if " (device 0): " in line] == names
    data = json.loads(out.read_text())
    assert [w["trace"] for w in data["least_waste"]] == names  # was one winner for the three
    # a file name seen once keeps its short name
    p = cli("replay", paths[0], "--json", out)
    assert json.loads(out.read_text())["least_waste"][0]["trace"] == "snapshot.pickle"


def test_a_reader_that_goes_away_does_not_stop_the_run(tiny_trace, tmp_path):
    """`... --json r.json | head -1`: the table goes nowhere once head has left, the JSON and plot are still
    written, no traceback, exit status 0 (the run ended at the first broken pipe, with status 0 and no files)."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NPUALLOC_", "PYTORCH_"))}
    env["PYTHONPATH"] = PKG_PARENT + os.pathsep + env.get("PYTHONPATH", "")
    env["MPLBACKEND"] = "Agg"
    args = [tiny_trace] * 12 + ["--json", tmp_path / "r.json", "--plot", tmp_path / "t.png"]  # > a pipe buffer
    try:
        p = subprocess.run([sys.executable, "-m", "npualloc", "replay", *map(str, args)], stdout=write_end,
                           stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    finally:
        os.close(write_end)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert len(json.loads((tmp_path / "r.json").read_text())["least_waste"]) == 12
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_a_closed_stdout_is_no_error(tiny_trace, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NPUALLOC_", "PYTORCH_"))}
    env["PYTHONPATH"] = PKG_PARENT + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-m", "npualloc", "replay", str(tiny_trace), "--json",
                        str(tmp_path / "r.json")], stderr=subprocess.PIPE, text=True, env=env, timeout=120,
                       preexec_fn=lambda: os.close(1))  # >&-
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert json.loads((tmp_path / "r.json").read_text())["results"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
@pytest.mark.parametrize("command", [["include"], ["replay", "TRACE"]])
def test_a_full_disk_on_stdout_is_a_one_line_error(tiny_trace, command):
    command = [str(tiny_trace) if c == "TRACE" else c for c in command]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NPUALLOC_", "PYTORCH_"))}
    env["PYTHONPATH"] = PKG_PARENT + os.pathsep + env.get("PYTHONPATH", "")
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "npualloc", *command], stdout=full, stderr=subprocess.PIPE,
                           text=True, env=env, timeout=120)
    assert_run_error(p, "cannot write the output (No space left on device)", command=command[0])


def test_demo_checks_its_options_before_it_runs(tmp_path):
    out = tmp_path / "out"
    p = cli("demo", "--size", "tiny", "--out", out, "--traces-device-memory", "lots", cwd=tmp_path)
    assert_usage_error(p, "--traces-device-memory", command="demo")
    assert p.stdout == "" and not out.exists()  # the generated workload was not replayed first
    (tmp_path / "afile").write_text("")
    p = cli("demo", "--size", "tiny", "--out", out, "--traces", tmp_path / "afile", cwd=tmp_path)
    assert_run_error(p, "--traces", "not a directory", command="demo")
    assert p.stdout == "" and not out.exists()
    (tmp_path / "empty").mkdir()
    p = cli("demo", "--size", "tiny", "--out", out, "--traces", tmp_path / "empty", cwd=tmp_path)
    assert p.returncode == 0 and f"No PyTorch traces (*.pickle) in {tmp_path / 'empty'}." in p.stdout
    assert "traces in" not in p.stdout  # not "PyTorch CUDA traces in DIR (0): replayed with ..."
    shutil.rmtree(out)
    # the output directory as --traces: the generated trace written there is not replayed again as a PyTorch one
    (tmp_path / "again").mkdir()
    p = cli("demo", "--size", "tiny", "--out", tmp_path / "again", "--traces", tmp_path / "again", cwd=tmp_path)
    assert p.returncode == 0 and "No PyTorch traces (*.pickle) in " in p.stdout, p.stdout
    assert len(json.loads((tmp_path / "again" / "results.json").read_text())["least_waste"]) == 1
    p = cli("demo", "--size", "tiny", "--out", out, "--traces", tmp_path, "--no-traces", cwd=tmp_path)
    assert_usage_error(p, "not allowed with argument --traces", command="demo")
    assert not out.exists()


def test_demo_that_cannot_write_its_trace_says_so_on_one_line(tmp_path):
    """The generated trace's file is an output like results.json: a failure to write it is a one-line RunError
    (it was a traceback)."""
    out = tmp_path / "out"
    (out / "transformer-trace.pickle").mkdir(parents=True)
    p = cli("demo", "--size", "tiny", "--out", out, "--no-traces", cwd=tmp_path)
    assert_run_error(p, f"{out / 'transformer-trace.pickle'}: cannot write (Is a directory)", command="demo")


def test_demos_default_row_replays_its_recorded_run(tmp_path):
    p = cli("demo", "--size", "tiny", "--out", tmp_path, "--no-traces", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "recorded from step 0" in p.stdout
    (default,) = [r for r in json.loads((tmp_path / "results.json").read_text())["results"] if r["label"] == "default"]
    assert default["reconstructed_count"] == 0
    assert default["peak_reserved"] == default["recorded"]["peak_reserved"] > 0
    assert f"--plot {tmp_path / 'timeline.png'}" in p.stdout  # the hint writes into the output directory


def test_demo_without_traces_says_how_to_add_them(tmp_path, monkeypatch, capsys):
    main = pytest.importorskip("npualloc.__main__")
    monkeypatch.setattr(main, "_default_traces_dir", lambda: None)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    assert main.main(["demo", "--size", "tiny", "--out", str(tmp_path)]) == 0
    assert "make demo TRACES=DIR" in capsys.readouterr().out
    assert main.main(["demo", "--size", "tiny", "--out", str(tmp_path), "--no-traces"]) == 0
    assert "TRACES=DIR" not in capsys.readouterr().out  # asked for none


def test_demo_on_a_device_without_1g_pages_has_no_1g_row(tmp_path):
    p = cli("demo", "--size", "tiny", "--out", tmp_path, "--no-traces", "--device-memory", "1GiB", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "page_size:1g" not in p.stdout and "expandable_segments:True" in p.stdout


def test_demo_runs_end_to_end(tiny_trace, tmp_path):
    traces = tmp_path / "traces"
    traces.mkdir()
    (traces / "copy.pickle").write_bytes(tiny_trace.read_bytes())
    (traces / "broken.pickle").write_bytes(b"junk")
    out = tmp_path / "out"
    p = cli("demo", "--size", "tiny", "--out", out, "--traces", traces, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    text = p.stdout
    for setting in ("default", "max_split_size_mb:128", "garbage_collection_threshold:0.8 +fraction 0.9",
                    "expandable_segments:True", "page_size:1g", "default (cuda rounding)", "(recorded run)"):
        assert setting in text, setting
    assert "skipped: " in text and "broken.pickle: not a readable pickle" in text
    assert (out / "transformer-trace.pickle").exists() and (out / "results.json").exists()
    assert (out / "timeline-transformer.png").exists() and (out / "timeline-copy.png").exists()
    assert str(out) in text
    # the snapshot it wrote replays, through the restricted loader
    p = cli("replay", out / "transformer-trace.pickle")
    assert p.returncode == 0, p.stderr
    # the default output directory is ./npualloc-demo-out
    p = cli("demo", "--size", "tiny", "--no-traces", cwd=tmp_path)
    assert p.returncode == 0 and (tmp_path / "npualloc-demo-out" / "transformer-trace.pickle").exists()
