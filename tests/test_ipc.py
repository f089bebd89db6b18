"""Cross-process sharing through acl.rt: shareable handles (export, pid whitelist, import) and IPC
keys, with real separate processes.

The test process is one side; `Worker` processes (fresh interpreters, each its own runtime with
the SMALL configuration) are the others.  A worker runs the code it is sent and sends back `ret`.
"""
import base64
import ctypes
import os
import pickle
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

import npualloc
from conftest import MiB, ROOT, SMALL
from npualloc import _C, acl

rt = acl.rt
G2 = 2 * MiB
PROP = {"handleType": 0, "allocationType": 0, "memAttr": acl.ACL_HBM_MEM_HUGE, "location": {"id": 0, "type": 1},
        "reserve": 0}

NOT_PERMITTED = acl.ACL_ERROR_RT_DRV_INTERNAL_ERROR  # 507899: CANN's code for -EACCES
NO_SUCH_HANDLE = acl.ACL_ERROR_RT_INVALID_HANDLE  # 107017: "Share handle doesn't exist"

_WORKER = r"""
import base64, ctypes, os, pickle, sys, traceback
sys.path.insert(0, sys.argv[1])
import npualloc
import npualloc
from npualloc import _C, acl
npualloc.configure(**pickle.loads(base64.b64decode(sys.argv[2])))
g = {"npualloc": npualloc, "acl": acl, "rt": acl.rt, "_C": _C, "ctypes": ctypes, "os": os, "sys": sys}
def reply(obj):
    sys.stdout.write(base64.b64encode(pickle.dumps(obj)).decode() + "\n")
    sys.stdout.flush()
reply(("ready", os.getpid()))
for line in sys.stdin:
    code, kw = pickle.loads(base64.b64decode(line))
    g.update(kw)
    g["ret"] = None
    try:
        exec(code, g)
        reply(("ok", g["ret"]))
    except BaseException:
        reply(("err", traceback.format_exc()))
"""


class Worker:
    """Another process with its own npualloc runtime; `call(code, **names)` runs code there."""

    def __init__(self, env=None, **config):
        cfg = dict(SMALL)
        cfg.update(config)
        full_env = {k: v for k, v in os.environ.items() if not k.startswith(("NPUALLOC_", "PYTORCH_NPU_ALLOC"))}
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(ROOT), base64.b64encode(pickle.dumps(cfg)).decode()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=full_env, cwd=ROOT, text=True)
        kind, self.pid = self._read()
        assert kind == "ready"

    def _read(self):
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"worker {self.proc.pid} died (exit {self.proc.wait()})")
        return pickle.loads(base64.b64decode(line))

    def send(self, code, **kw):
        self.proc.stdin.write(base64.b64encode(pickle.dumps((code, kw))).decode() + "\n")
        self.proc.stdin.flush()

    def recv(self):
        kind, value = self._read()
        if kind == "err":
            raise AssertionError(f"in worker {self.pid}:\n{value}")
        return value

    def call(self, code, **kw):
        self.send(code, **kw)
        return self.recv()

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=20)
        self.proc.stdout.close()


@pytest.fixture
def workers():
    """workers(n, **config) -> list of Workers, closed after the test."""
    made = []

    def _make(n=1, **config):
        new = [Worker(**config) for _ in range(n)]
        made.extend(new)
        return new

    yield _make
    for w in made:
        if w.proc.poll() is None:
            w.kill()
        w.proc.stdout.close()


def exported(size=G2, flags=acl.ACL_RT_VMM_EXPORT_FLAG_DEFAULT, fill=b"P", dev=0):
    """A physical handle of the test process, mapped and filled, and its shareable value."""
    p = dict(PROP, location={"id": dev, "type": 1})
    handle, ret = rt.malloc_physical(size, p, 0)
    assert ret == 0
    va, ret = rt.reserve_mem_address(size, 0, 0, 0)
    assert ret == 0 and rt.map_mem(va, size, 0, handle, 0) == 0
    ctypes.memset(va, fill[0], size)
    value, ret = rt.mem_export_to_shareable_handle(handle, acl.ACL_MEM_HANDLE_TYPE_NONE, flags)
    assert ret == 0
    return handle, va, value


def release(handle, va):
    assert rt.unmap_mem(va) == 0 and rt.release_mem_address(va) == 0
    assert rt.free_physical(handle) == 0


IMPORT_MAP = """
h, r = rt.mem_import_from_shareable_handle(value, device)
ret = [h, r, 0]
if r == 0:
    va, r2 = rt.reserve_mem_address(size, 0, 0, 0)
    assert r2 == 0 and rt.map_mem(va, size, 0, h, 0) == 0
    ret[2] = va
"""

UNMAP_FREE = """
assert rt.unmap_mem(va) == 0 and rt.release_mem_address(va) == 0
ret = rt.free_physical(h)
"""


def import_map(w, value, size=G2, device=0):
    """Imports and maps a value in a worker: (handle, ret, va)."""
    return w.call(IMPORT_MAP, value=value, device=device, size=size)


def fd_count(w=None):
    code = "ret = len(os.listdir('/proc/self/fd'))"
    if w is not None:
        return w.call(code)
    return len(os.listdir("/proc/self/fd"))


def clients_after_they_left():
    """This process's server's client count once it is 0, or after 5 s.  A client can stay a moment after
    it left (a dead importer's connection), and any process's failed import asks every npualloc server on
    the machine, ours included, for a moment."""
    for _ in range(500):
        n = _C.ipc.counts()["clients"]
        if n == 0:
            break
        time.sleep(0.01)
    return n


# ---- zero copy, whitelist ----


def test_zero_copy_both_ways(dev0, workers):
    (w,) = workers()
    handle, va, value = exported(size=4 * G2)
    assert rt.mem_set_pid_to_shareable_handle(value, [w.pid]) == 0
    h, r, wva = import_map(w, value, size=4 * G2)
    assert r == 0
    # the exporter's bytes, read in the importer
    assert w.call("ret = ctypes.string_at(wva + off, 4)", wva=wva, off=4 * G2 - 4) == b"PPPP"
    # the importer writes, the exporter reads; the exporter writes, the importer reads
    w.call("ctypes.memmove(wva + 100, b'from importer', 13)", wva=wva)
    assert ctypes.string_at(va + 100, 13) == b"from importer"
    ctypes.memmove(va + 5 * MiB, b"from exporter", 13)
    assert w.call("ret = acl.util.ptr_to_bytes(wva + 5 * 2**20, 13)", wva=wva) == b"from exporter"
    # device memory on both sides: the runtime's memset works on the imported mapping
    assert w.call("ret = rt.memset(wva, 16, 0x51, 16)", wva=wva) == 0
    assert ctypes.string_at(va, 16) == b"Q" * 16
    assert w.call(UNMAP_FREE, va=wva, h=h) == 0
    release(handle, va)


def test_whitelist_allows_the_listed_process_only(dev0, workers):
    a, b = workers(2)
    handle, va, value = exported()
    assert rt.mem_set_pid_to_shareable_handle(value, [a.pid]) == 0
    assert import_map(a, value)[1] == 0
    assert import_map(b, value)[1] == NOT_PERMITTED
    # listed later: allowed from then on (the whitelist accumulates)
    assert rt.mem_set_pid_to_shareable_handle(value, [b.pid, 424242]) == 0
    assert import_map(b, value)[1] == 0
    # DISABLE_PID_VALIDATION: any process of this user, and set-pid is refused
    h2, va2, v2 = exported(flags=acl.ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION)
    assert rt.mem_set_pid_to_shareable_handle(v2, [a.pid]) == acl.ACL_ERROR_RT_NO_PERMISSION
    assert import_map(b, v2)[1] == 0
    for w in (a, b):
        w.close()
    release(handle, va)
    release(h2, va2)


def test_a_process_cannot_lie_about_its_pid(dev0, workers):
    """The exporter learns who connects from the kernel (SO_PEERCRED); the pid a request claims
    is never read, and the kernel refuses to let a process send credentials of another pid."""
    listed, liar = workers(2)
    handle, va, value = exported()
    assert rt.mem_set_pid_to_shareable_handle(value, [listed.pid]) == 0
    name = _C.ipc.server_name(os.getpid(), _C.ipc.counts()["secret"])
    liar_code = """
import socket, struct, errno
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect("\\0" + name)
# a request claiming to come from the listed process
req = struct.pack("<IHHiIQ16s", 0x4955504e, 2, 1, claimed, 1, value, b"\\0" * 16)  # version 2, id 1
s.send(req)
msg, anc, flags, addr = s.recvmsg(64, socket.CMSG_SPACE(16))
status = struct.unpack("<IHHIiiIQ", msg)[4]
# and credentials of the listed process, sent explicitly: an unprivileged process gets EPERM from
# the kernel; a privileged one may send them, and the exporter ignores them (it reads SO_PEERCRED)
try:
    s.sendmsg([req], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, struct.pack("iII", claimed, os.getuid(), os.getgid()))])
    msg, anc2, flags, addr = s.recvmsg(64, socket.CMSG_SPACE(16))
    creds = struct.unpack("<IHHIiiIQ", msg)[4]
except PermissionError:
    creds = "EPERM"
ret = (status, len(anc), creds)
"""
    status, fds, creds = liar.call(liar_code, name=name, claimed=listed.pid, value=value)
    assert status == NOT_PERMITTED and fds == 0
    assert creds in ("EPERM", NOT_PERMITTED)
    # the same raw requests from the listed process succeed and carry a descriptor, whatever pid
    # they claim
    status, fds, creds = listed.call(liar_code, name=name, claimed=liar.pid, value=value)
    assert status == 0 and fds > 0 and creds in ("EPERM", 0)
    release(handle, va)


def test_forged_and_unknown_values(dev0, workers):
    (w,) = workers()
    handle, va, value = exported(flags=acl.ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION)
    device = value & (0xFF << 32)
    rng = random.Random(7)
    forged = [device | (rng.getrandbits(64) & ~(0xFF << 32)) for _ in range(5)]  # guessed random bits
    forged += [value ^ (1 << bit) for bit in (0, 21, 22, 31, 40, 63)]  # one bit off
    forged += [value ^ (1 << 32),  # another device
               device, 0, 2**64 - 1]
    got = w.call("ret = [rt.mem_import_from_shareable_handle(v, 0)[1] for v in forged]", forged=forged)
    assert got == [NO_SUCH_HANDLE] * len(forged)
    assert import_map(w, value)[1] == 0  # the real one still works
    release(handle, va)


def test_errors_of_the_exporter_side(dev0, workers):
    (w,) = workers()
    handle, va, value = exported()
    # one shareable handle per handle
    assert rt.mem_export_to_shareable_handle(handle, 0, 0) == (0, NOT_PERMITTED)
    assert rt.mem_export_to_shareable_handle(handle, 0, 1) == (0, NOT_PERMITTED)
    assert rt.mem_export_to_shareable_handle(handle, 2, 0)[1] == acl.ACL_ERROR_INVALID_PARAM
    assert rt.mem_export_to_shareable_handle(handle, 0, 2)[1] == acl.ACL_ERROR_RT_PARAM_INVALID
    assert rt.mem_export_to_shareable_handle(0, 0, 0)[1] == acl.ACL_ERROR_INVALID_PARAM
    assert rt.mem_export_to_shareable_handle(0x4800000000000001, 0, 0)[1] == NO_SUCH_HANDLE
    # the exporter importing its own handle
    assert rt.mem_import_from_shareable_handle(value, 0) == (0, NOT_PERMITTED)
    assert rt.mem_import_from_shareable_handle(value, 99)[1] == acl.ACL_ERROR_RT_INVALID_DEVICEID
    assert rt.mem_import_from_shareable_handle(value, -1)[1] == acl.ACL_ERROR_RT_INVALID_DEVICEID
    # set-pid: a list, of ints; only the exporter
    with pytest.raises(ValueError, match="argument 2 only support the format of list"):
        rt.mem_set_pid_to_shareable_handle(value, (1, 2))
    with pytest.raises(TypeError):
        rt.mem_set_pid_to_shareable_handle(value, ["1"])
    with pytest.raises(TypeError):
        rt.mem_set_pid_to_shareable_handle("x", [1])
    assert rt.mem_set_pid_to_shareable_handle(value, []) == acl.ACL_ERROR_INVALID_PARAM
    assert rt.mem_set_pid_to_shareable_handle(value, [2**40]) == acl.ACL_ERROR_INVALID_PARAM
    theirs = w.call("""
h, r = rt.malloc_physical(size, prop, 0)
ret, r = rt.mem_export_to_shareable_handle(h, 0, 0)
assert r == 0
""", size=G2, prop=PROP)
    assert rt.mem_set_pid_to_shareable_handle(theirs, [5]) == NOT_PERMITTED  # another process's value
    assert rt.mem_set_pid_to_shareable_handle(theirs ^ (1 << 63), [5]) == NO_SUCH_HANDLE  # nobody's
    assert rt.device_get_bare_tgid() == (os.getpid(), 0)
    with pytest.raises(TypeError):
        rt.device_get_bare_tgid(1)
    release(handle, va)
    assert rt.mem_set_pid_to_shareable_handle(value, [5]) == NO_SUCH_HANDLE  # freed: not exported any more
    assert _C.ipc.counts()["exports"] == 0


DROP_REOPEN_CAPS = r"""
class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
class Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
libc = ctypes.CDLL(None, use_errno=True)
header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
assert libc.capget(ctypes.byref(header), data) == 0
for cap in (21, 40):  # CAP_SYS_ADMIN, CAP_CHECKPOINT_RESTORE
    for field in ("effective", "permitted", "inheritable"):
        setattr(data[cap // 32], field, getattr(data[cap // 32], field) & ~(1 << (cap % 32)))
assert libc.capset(ctypes.byref(header), data) == 0
"""

MAP_FILES_REOPEN = r"""
# a file-backed mapping (the first line may be anonymous, e.g. ASan's shadow, which has no entry there)
line = next(l for l in open("/proc/self/maps") if l.split()[-1].startswith("/"))
start, end = (int(x, 16) for x in line.split()[0].split("-"))
try:
    os.close(os.open("/proc/self/map_files/%x-%x" % (start, end), os.O_RDONLY))
    ret = "reopened"
except PermissionError:
    ret = "refused"
"""

EXPORT_PAST_THE_BUDGET = """
assert rt.set_device(0) == 0
h, r = rt.malloc_physical(size, prop, 0)
assert r == 0 and _C.vmm_counts()["fds_kept"] == 0  # past the budget: no descriptor kept
value, r_value = rt.mem_export_to_shareable_handle(h, 0, 1)
p, r = rt.malloc(size, 0)
assert r == 0
key, r_key = rt.ipc_mem_get_export_key(p, size, 65, 0)
ret = (r_value, r_key, _C.ipc.counts()["exports"])
"""


def test_export_past_the_descriptor_budget_needs_the_reopen_capabilities(workers):
    # Memory created past NPUALLOC_FD_BUDGET is served through /proc/self/map_files, which needs
    # CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE.  Without them the export itself fails with 207005
    # (docs/runtime.md); it used to succeed, and every import then failed with 207001.
    budget0 = {"NPUALLOC_FD_BUDGET": "0"}
    (w,) = workers(env=budget0)
    w.call(DROP_REOPEN_CAPS)
    if w.call(MAP_FILES_REOPEN) != "refused":
        pytest.skip("/proc/self/map_files still reopens without CAP_SYS_ADMIN and CAP_CHECKPOINT_RESTORE")
    assert w.call(EXPORT_PAST_THE_BUDGET, size=G2, prop=PROP) == (
        acl.ACL_ERROR_RT_RESOURCE_ALLOC_FAIL, acl.ACL_ERROR_RT_RESOURCE_ALLOC_FAIL, 0)
    # with the capabilities (root), the same exports work and serve an import
    (w2, importer) = workers(2, env=budget0)
    if w2.call(MAP_FILES_REOPEN) != "reopened":
        return  # not privileged here: the failing half is what this test is about
    assert w2.call(EXPORT_PAST_THE_BUDGET, size=G2, prop=PROP) == (0, 0, 2)
    assert importer.call("ret = rt.mem_import_from_shareable_handle(v, 0)[1]", v=w2.call("ret = value")) == 0


def test_double_import_returns_the_same_handle(dev0, workers):
    (w,) = workers()
    handle, va, value = exported(flags=1)
    fds0 = fd_count(w)
    code = """
h1, r1 = rt.mem_import_from_shareable_handle(value, 0)
h2, r2 = rt.mem_import_from_shareable_handle(value, 0)
c = _C.ipc.counts()["imports"]
frees = [rt.free_physical(h1), rt.free_physical(h2), rt.free_physical(h1)]
ret = (h1, r1, h2, r2, c, frees, _C.ipc.counts()["imports"], _C.vmm_counts()["physical_handles"])
"""
    h1, r1, h2, r2, imports, frees, after, live = w.call(code, value=value)
    assert r1 == r2 == 0 and h1 == h2 and imports == 1
    assert frees == [0, 0, NO_SUCH_HANDLE]  # one free per import; then it is gone
    assert after == 0 and live == 0
    assert fd_count(w) == fds0  # no descriptor left behind
    release(handle, va)


def test_import_after_the_exporter_freed(dev0, workers):
    (w,) = workers()
    handle, va, value = exported(flags=1)
    release(handle, va)
    assert import_map(w, value)[1] == NO_SUCH_HANDLE


def test_exporter_frees_while_mapped_elsewhere(dev0, workers):
    (w,) = workers()
    handle, va, value = exported(flags=1)
    h, r, wva = import_map(w, value)
    assert r == 0
    release(handle, va)  # the exporter is done: the importer's data lives on
    assert w.call("ret = ctypes.string_at(wva, 4)", wva=wva) == b"PPPP"
    assert import_map(w, value)[1] == 0  # still imported here: the same handle comes back
    w.call("rt.free_physical(h)", h=h)
    assert w.call(UNMAP_FREE, va=wva, h=h) == 0


def test_exporter_exits_before_the_importer_unmaps(dev0, workers):
    (exporter,) = workers()
    value = exporter.call("""
h, r = rt.malloc_physical(size, prop, 0)
va, r = rt.reserve_mem_address(size, 0, 0, 0)
rt.map_mem(va, size, 0, h, 0)
ctypes.memset(va, 0x58, size)
ret, r = rt.mem_export_to_shareable_handle(h, 0, 1)
assert r == 0
""", size=2 * G2, prop=PROP)
    handle, ret = rt.mem_import_from_shareable_handle(value, 0)
    assert ret == 0
    va, _ = rt.reserve_mem_address(2 * G2, 0, 0, 0)
    assert rt.map_mem(va, 2 * G2, 0, handle, 0) == 0
    exporter.close()  # the exporter exits without freeing anything
    assert ctypes.string_at(va, 4) == b"XXXX" and ctypes.string_at(va + 2 * G2 - 4, 4) == b"XXXX"
    ctypes.memset(va, 0x59, 8)
    assert ctypes.string_at(va, 9) == b"YYYYYYYYX"
    assert rt.free_physical(handle) == 0
    assert rt.unmap_mem(va) == 0 and rt.release_mem_address(va) == 0
    assert rt.mem_import_from_shareable_handle(value, 0)[1] == NO_SUCH_HANDLE  # nobody serves it now
    c = _C.vmm_counts()
    assert (c["physical_handles"], c["mappings"]) == (0, 0)


def test_importer_crash_affects_nobody(dev0, workers):
    victim, survivor = workers(2)
    handle, va, value = exported(flags=1)
    assert import_map(victim, value)[1] == 0
    h, r, sva = import_map(survivor, value)
    assert r == 0
    victim.call("ctypes.memset(wva, 0x56, 4)", wva=import_map(victim, value)[2])
    victim.kill()
    assert ctypes.string_at(va, 4) == b"VVVV"  # its writes stay; the memory stays
    ctypes.memset(va, 0x45, 4)
    assert survivor.call("ret = ctypes.string_at(sva, 4)", sva=sva) == b"EEEE"
    assert import_map(survivor, value)[1] == 0  # the exporter still serves
    assert clients_after_they_left() == 0  # the dead importer's connection is gone
    release(handle, va)


def test_eight_importers_at_once(dev0, workers):
    ws = workers(8)
    handle, va, value = exported(size=2 * G2)
    assert rt.mem_set_pid_to_shareable_handle(value, [w.pid for w in ws]) == 0
    code = IMPORT_MAP + "\nctypes.memset(ret[2] + 4096 * index, 0x61 + index, 4096)"
    for i, w in enumerate(ws):
        w.send(code, value=value, device=0, size=2 * G2, index=i)
    results = [w.recv() for w in ws]
    assert [r[1] for r in results] == [0] * 8
    for i in range(8):
        assert ctypes.string_at(va + 4096 * i, 4096) == bytes([0x61 + i]) * 4096
    # each importer sees the others' writes too
    assert ws[0].call("ret = ctypes.string_at(base + 4096 * 7, 2)", base=results[0][2]) == b"hh"
    release(handle, va)


def test_threads_export_and_import_concurrently(dev0, workers):
    (w,) = workers()
    values, handles, errors = [], [], []

    def export_some():
        try:
            for _ in range(8):
                h, v = exported(flags=1)[::2]
                handles.append(h)
                values.append(v)
        except AssertionError as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=export_some) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(values)) == 32
    # 8 threads of the worker import the same value at once: one handle, 8 references
    got = w.call("""
import threading
out = []
def grab():
    out.append(rt.mem_import_from_shareable_handle(value, 0))
ts = [threading.Thread(target=grab) for _ in range(8)]
[t.start() for t in ts]; [t.join() for t in ts]
others = [rt.mem_import_from_shareable_handle(v, 0)[1] for v in values]
ret = (set(out), others)
""", value=values[0], values=values)
    (only,), others = got
    assert only[1] == 0 and others == [0] * 32


def test_cross_device_import_follows_peer_access(dev0, workers):
    (w,) = workers()
    handle, va, value = exported(flags=1)
    assert (value >> 32) & 0xFF == 0
    assert import_map(w, value, device=1)[1] == acl.ACL_ERROR_RT_FEATURE_NOT_SUPPORT
    w.call("assert rt.set_device(1) == 0 and rt.device_enable_peer_access(0, 0) == 0")
    h, r, wva = import_map(w, value, device=1)
    assert r == 0
    assert w.call("ret = ctypes.string_at(wva, 2)", wva=wva) == b"PP"
    release(handle, va)
    # exported from device 1: bits 32-39 say so
    h1, va1, v1 = exported(dev=1, flags=1)
    assert (v1 >> 32) & 0xFF == 1
    release(h1, va1)


def test_fork_child_imports_from_its_parent(workers):
    (w,) = workers()
    code = """
h, r = rt.malloc_physical(size, prop, 0)
va, r = rt.reserve_mem_address(size, 0, 0, 0)
rt.map_mem(va, size, 0, h, 0)
ctypes.memset(va, 0x46, size)
value, r = rt.mem_export_to_shareable_handle(h, 0, 0)
import time
rd, wr = os.pipe()
go_rd, go_wr = os.pipe()
pid = os.fork()
if pid == 0:
    code = 1
    try:
        os.write(wr, b"x")
        os.read(go_rd, 1)
        c = _C.ipc.counts()
        assert not c["server_running"] and c["exports"] == 0  # fresh state in the child
        assert rt.mem_set_pid_to_shareable_handle(value, [os.getpid()]) != 0  # not the exporter here
        ch, cr = rt.mem_import_from_shareable_handle(value, 0)
        assert cr == 0, cr
        cva, _ = rt.reserve_mem_address(size, 0, 0, 0)
        assert rt.map_mem(cva, size, 0, ch, 0) == 0
        assert ctypes.string_at(cva, 2) == b"FF"
        ctypes.memset(cva, 0x63, 2)
        code = 0
    finally:
        os._exit(code)
os.read(rd, 1)
assert rt.mem_set_pid_to_shareable_handle(value, [pid]) == 0
os.write(go_wr, b"x")
_, status = os.waitpid(pid, 0)
ret = (os.waitstatus_to_exitcode(status), ctypes.string_at(va, 3))
"""
    code_, data = w.call(code, size=G2, prop=PROP)
    assert code_ == 0 and data == b"ccF"


def test_fork_after_importing(dev0, workers):
    (w,) = workers()
    handle, va, value = exported(flags=1)
    code = IMPORT_MAP + """
pid = os.fork()
if pid == 0:
    ok = 1
    try:
        assert _C.ipc.counts()["imports"] == 0
        h2, r2 = rt.mem_import_from_shareable_handle(value, 0)  # the child imports for itself
        v2, _ = rt.reserve_mem_address(size, 0, 0, 0)
        assert r2 == 0 and rt.map_mem(v2, size, 0, h2, 0) == 0
        ctypes.memset(v2 + 10, 0x6b, 1)
        ok = 0
    finally:
        os._exit(ok)
ret.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""
    h, r, wva, child = w.call(code, value=value, device=0, size=G2)
    assert r == 0 and child == 0
    assert ctypes.string_at(va + 10, 1) == b"k"
    assert w.call("ret = ctypes.string_at(wva + 10, 1)", wva=wva) == b"k"
    release(handle, va)


# ---- IPC keys ----


def test_ipc_keys(dev0, workers):
    a, b = workers(2)
    ptr, ret = rt.malloc(3 * MiB, acl.ACL_MEM_MALLOC_HUGE_FIRST)
    assert ret == 0
    ctypes.memset(ptr, 0x4B, 3 * MiB)
    with pytest.raises(ValueError, match="key len should be less than 1024"):
        rt.ipc_mem_get_export_key(ptr, 3 * MiB, 1024, 0)
    assert rt.ipc_mem_get_export_key(ptr + 512, 512, 65, 0) == ("", acl.ACL_ERROR_RT_PARAM_INVALID)
    assert rt.ipc_mem_get_export_key(ptr, 3 * MiB, 65, 2)[1] == acl.ACL_ERROR_RT_PARAM_INVALID
    key, ret = rt.ipc_mem_get_export_key(ptr, 3 * MiB, 65, acl.ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT)
    assert ret == 0 and isinstance(key, str) and len(key) <= 64
    assert rt.ipc_mem_get_export_key(ptr, 3 * MiB, 65, 0) == (key, 0)  # one key per allocation
    with pytest.raises(ValueError, match="argument 2 only support the format of list"):
        rt.ipc_mem_set_import_pid(key, a.pid)
    with pytest.raises(TypeError):
        rt.ipc_mem_import_by_key(b"bytes", 0)
    assert rt.ipc_mem_import_by_key(key, 0) == (0, NOT_PERMITTED)  # its own key
    assert rt.ipc_mem_set_import_pid(key, [a.pid]) == 0
    code = """
p, r = rt.ipc_mem_import_by_key(key, 0)
ret = [p, r]
if r == 0:
    p2, r2 = rt.ipc_mem_import_by_key(key, 0)
    ret += [p2 == p, ctypes.string_at(p + 3 * 2**20 - 2, 2)]
    ctypes.memset(p, 0x6b, 2)
"""
    got = a.call(code, key=key)
    assert got[1] == 0 and got[2] is True and got[3] == b"KK"
    assert ctypes.string_at(ptr, 3) == b"kkK"
    assert b.call(code, key=key)[1] == NOT_PERMITTED  # not whitelisted
    forged = key[:-4] + ("0000" if not key.endswith("0000") else "1111")
    assert a.call("ret = rt.ipc_mem_import_by_key(k, 0)[1]", k=forged) == NO_SUCH_HANDLE
    assert a.call("ret = [rt.ipc_mem_close(key), rt.ipc_mem_close(key), rt.ipc_mem_close(key)]", key=key) == \
        [0, 0, NO_SUCH_HANDLE]
    assert a.call("ret = _C.vmm_counts()['mappings'] + _C.ipc.counts()['key_imports']") == 0
    # the exporter closes its key: no new imports
    assert rt.ipc_mem_close(key) == 0
    assert a.call("ret = rt.ipc_mem_import_by_key(key, 0)[1]", key=key) == NO_SUCH_HANDLE
    # DISABLE_PID_VALIDATION keys: anyone of this user, set-pid refused
    ptr2, _ = rt.malloc(MiB, 0)
    key2, ret = rt.ipc_mem_get_export_key(ptr2, MiB, 65, acl.ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION)
    assert rt.ipc_mem_set_import_pid(key2, [b.pid]) == acl.ACL_ERROR_RT_NO_PERMISSION
    assert b.call("ret = rt.ipc_mem_import_by_key(key, 0)[1]", key=key2) == 0
    # an importer on another device: ENABLE_PEER_ACCESS turns peer access on
    got = a.call("rt.set_device(2); ret = rt.ipc_mem_import_by_key(key, 0)[1]", key=key2)
    assert got == acl.ACL_ERROR_RT_FEATURE_NOT_SUPPORT
    assert a.call("ret = rt.ipc_mem_import_by_key(key, 1)[1]", key=key2) == 0
    assert rt.free(ptr) == 0 and rt.free(ptr2) == 0
    assert _C.ipc.counts()["exports"] == 0


# ---- nothing leaks ----


def test_nothing_leaks_on_either_side(dev0, workers):
    (w,) = workers()
    w_fds = fd_count(w)
    my_fds = fd_count()
    for _ in range(20):
        handle, va, value = exported(flags=1)
        h, r, wva = import_map(w, value)
        assert r == 0
        assert w.call(UNMAP_FREE, va=wva, h=h) == 0
        release(handle, va)
    assert fd_count(w) == w_fds  # the importer keeps nothing
    assert clients_after_they_left() == 0
    assert fd_count() <= my_fds + 3  # the exporter: its server's socket, wake-up fd and spare fd at most
    assert _C.ipc.counts()["exports"] == 0
    assert w.call("ret = (_C.ipc.counts()['imports'], _C.vmm_counts())") == \
        (0, {"physical_handles": 0, "reservations": 0, "mappings": 0, "fds_kept": 0})
    _C.shutdown()  # the server goes with the runtime
    assert fd_count() == my_fds
    assert not _C.ipc.counts()["server_running"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_only_the_same_user_by_default(dev0, workers, monkeypatch):
    (w,) = workers(env={"NPUALLOC_IPC_ALLOW_UIDS": "0"})  # the worker accepts exporters of root
    w.call("os.setgid(65534); os.setuid(65534)")  # and becomes nobody
    handle, va, value = exported(flags=acl.ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION)
    assert import_map(w, value)[1] == NOT_PERMITTED  # root's exporter refuses nobody
    monkeypatch.setenv("NPUALLOC_IPC_ALLOW_UIDS", "12,65534")
    h, r, wva = import_map(w, value)
    assert r == 0
    assert w.call("ret = ctypes.string_at(wva, 2)", wva=wva) == b"PP"
    # the importer checks the exporter too: without its permission for root, it refuses root's server
    w.call("os.environ.pop('NPUALLOC_IPC_ALLOW_UIDS')")
    h2, va2, v2 = exported(flags=1)
    assert import_map(w, v2)[1] == NOT_PERMITTED
    release(handle, va)
    release(h2, va2)


# ---- IPC keys: the same guarantees as shareable handles ----

KEY_EXPORT = """
assert rt.set_device(0) == 0
ptr, r = rt.malloc(size, 0)
assert r == 0
ctypes.memset(ptr, fill, size)
key, r = rt.ipc_mem_get_export_key(ptr, size, 65, flags)
assert r == 0
ret = (ptr, key)
"""

KEY_IMPORT = """
p, r = rt.ipc_mem_import_by_key(key, 0)
ret = (p, r, ctypes.string_at(p, 4) if r == 0 else None)
"""

RAW_REQUEST = """
import socket, struct
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect("\\0" + name)
req = struct.pack("<IHHiIQ16s", 0x4955504e, 2, op, claimed, 1, value, token)  # version 2, id 1
s.send(req)
msg, anc, flags, addr = s.recvmsg(64, socket.CMSG_SPACE(16))
fds = []
for level, kind, data in anc:
    fds += list(struct.unpack("%di" % (len(data) // 4), data[:len(data) - len(data) % 4]))
for f in fds:
    os.close(f)
s.close()
ret = (struct.unpack("<IHHIiiIQ", msg)[4], len(fds))
"""


def key_parts(key):
    """(server name, device, token bytes) of a key "npualloc-k1-<pid>-<secret>-<device>-<token>"."""
    _, _, pid, secret, device, token = key.split("-")
    return _C.ipc.server_name(int(pid), int(secret, 16)), int(device), bytes.fromhex(token)


def test_key_exporter_frees_and_exits_while_imported(dev0, workers):
    exporter, importer, late = workers(3)
    ptr, key = exporter.call(KEY_EXPORT, size=3 * MiB, fill=0x4A,
                             flags=acl.ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION)
    p, r, head = importer.call(KEY_IMPORT, key=key)
    assert r == 0 and head == b"JJJJ"
    # the exporter frees its allocation: the importer's mapping and bytes stay
    assert exporter.call("ret = rt.free(ptr)", ptr=ptr) == 0
    assert importer.call("ret = ctypes.string_at(p + 3 * 2**20 - 4, 4)", p=p) == b"JJJJ"
    # a key of freed memory imports no more (107017, as CANN's "Share handle doesn't exist")
    assert late.call(KEY_IMPORT, key=key)[1] == NO_SUCH_HANDLE
    # the exporter exits: still intact, still writable, and the key still names nothing
    exporter.close()
    importer.call("ctypes.memset(p, 0x6a, 2)", p=p)
    assert importer.call("ret = ctypes.string_at(p, 3)", p=p) == b"jjJ"
    assert late.call(KEY_IMPORT, key=key)[1] == NO_SUCH_HANDLE
    assert importer.call("ret = rt.ipc_mem_close(key)", key=key) == 0
    assert importer.call("ret = (_C.vmm_counts()['mappings'], _C.ipc.counts()['key_imports'])") == (0, 0)


def test_key_importer_crash_affects_nobody(dev0, workers):
    victim, survivor = workers(2)
    ptr, ret = rt.malloc(MiB, 0)
    ctypes.memset(ptr, 0x4B, MiB)
    key, ret = rt.ipc_mem_get_export_key(ptr, MiB, 65, acl.ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION)
    assert ret == 0
    vp, r, _ = victim.call(KEY_IMPORT, key=key)
    sp, r2, _ = survivor.call(KEY_IMPORT, key=key)
    assert r == 0 and r2 == 0
    victim.call("ctypes.memset(p, 0x56, 4)", p=vp)
    victim.kill()
    assert ctypes.string_at(ptr, 5) == b"VVVVK"  # its writes stay; the memory stays
    ctypes.memset(ptr, 0x45, 4)
    assert survivor.call("ret = ctypes.string_at(p, 4)", p=sp) == b"EEEE"
    assert survivor.call("ret = [rt.ipc_mem_close(key), rt.ipc_mem_import_by_key(key, 0)[1]]", key=key) == [0, 0]
    assert clients_after_they_left() == 0  # the dead importer's connection goes
    assert rt.free(ptr) == 0


def test_eight_key_importers_at_once(dev0, workers):
    ws = workers(8)
    ptr, ret = rt.malloc(2 * MiB, 0)
    ctypes.memset(ptr, 0x50, 2 * MiB)
    key, ret = rt.ipc_mem_get_export_key(ptr, 2 * MiB, 65, acl.ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT)
    assert rt.ipc_mem_set_import_pid(key, [w.pid for w in ws]) == 0
    code = KEY_IMPORT + "\nif r == 0: ctypes.memset(p + 4096 * (index + 1), 0x61 + index, 4096)"
    for i, w in enumerate(ws):
        w.send(code, key=key, index=i)
    results = [w.recv() for w in ws]
    assert [r[1:] for r in results] == [(0, b"PPPP")] * 8
    for i in range(8):
        assert ctypes.string_at(ptr + 4096 * (i + 1), 4096) == bytes([0x61 + i]) * 4096
    assert ws[3].call("ret = ctypes.string_at(p + 4096 * 8, 2)", p=results[3][0]) == b"hh"
    assert rt.free(ptr) == 0


def test_a_key_importer_cannot_lie_about_its_pid(dev0, workers):
    listed, liar = workers(2)
    ptr, ret = rt.malloc(MiB, 0)
    key, ret = rt.ipc_mem_get_export_key(ptr, MiB, 65, acl.ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT)
    assert rt.ipc_mem_set_import_pid(key, [listed.pid]) == 0
    name, device, token = key_parts(key)
    raw = dict(name=name, op=2, value=device, token=token)  # IMPORT_KEY
    # a raw request claiming the listed pid: refused, no descriptor (the pid comes from SO_PEERCRED)
    assert liar.call(RAW_REQUEST, claimed=listed.pid, **raw) == (NOT_PERMITTED, 0)
    assert liar.call(KEY_IMPORT, key=key)[1] == NOT_PERMITTED
    # the listed process gets the descriptor whatever pid it claims
    assert listed.call(RAW_REQUEST, claimed=liar.pid, **raw) == (0, 1)
    assert listed.call(KEY_IMPORT, key=key)[1] == 0
    assert rt.free(ptr) == 0


# ---- refused and forged imports leave nothing behind ----


def test_refused_and_forged_imports_leak_nothing(dev0, workers):
    (w,) = workers()
    handle, va, value = exported()  # whitelist left empty: the worker is refused
    ptr, ret = rt.malloc(MiB, 0)
    key, ret = rt.ipc_mem_get_export_key(ptr, MiB, 65, acl.ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT)
    w_fds, my_fds = fd_count(w), fd_count()
    failed0 = _C.ipc.counts()["failed"]
    forged_key = key[:-4] + ("0000" if not key.endswith("0000") else "1111")
    code = """
ret = []
for _ in range(10):
    ret.append(rt.mem_import_from_shareable_handle(value, 0)[1])           # not on the whitelist
    ret.append(rt.mem_import_from_shareable_handle(value ^ (1 << 63), 0)[1])  # forged value
    ret.append(rt.ipc_mem_import_by_key(key, 0)[1])                        # key, not whitelisted
    ret.append(rt.ipc_mem_import_by_key(forged, 0)[1])                     # forged key
"""
    got = w.call(code, value=value, key=key, forged=forged_key)
    assert got == [NOT_PERMITTED, NO_SUCH_HANDLE, NOT_PERMITTED, NO_SUCH_HANDLE] * 10
    # every one reached this server and failed (at least: a failed import in any other process, such as
    # another pytest-xdist worker's, asks this server too)
    assert _C.ipc.counts()["failed"] - failed0 >= 40
    # the importer: no descriptor, handle, mapping or import entry; the exporter: no connection
    assert fd_count(w) == w_fds
    assert w.call("ret = (_C.ipc.counts()['imports'], _C.ipc.counts()['key_imports'], _C.vmm_counts())") == \
        (0, 0, {"physical_handles": 0, "reservations": 0, "mappings": 0, "fds_kept": 0})
    for _ in range(100):
        if _C.ipc.counts()["clients"] == 0 and fd_count() == my_fds:
            break
        time.sleep(0.01)
    assert (_C.ipc.counts()["clients"], fd_count()) == (0, my_fds)
    assert _C.ipc.counts()["exports"] == 2  # and the exports are as they were
    release(handle, va)
    assert rt.free(ptr) == 0


def test_share_past_the_descriptor_budget_says_why(workers):
    """npualloc.share of memory the export above refuses (207005) says what is missing; the
    message was "share: failed"."""
    (w,) = workers(env={"NPUALLOC_FD_BUDGET": "0"})
    w.call(DROP_REOPEN_CAPS)
    if w.call(MAP_FILES_REOPEN) != "refused":
        pytest.skip("/proc/self/map_files still reopens without CAP_SYS_ADMIN and CAP_CHECKPOINT_RESTORE")
    with pytest.raises(AssertionError, match=r"share: out of descriptors \(memory created past NPUALLOC_FD_BUDGET"
                                             r" .* CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE\) \(ACL error 207005\)"):
        w.call("npualloc.share(npualloc.caching_allocator_alloc(2**20, 0))")


def test_the_runtime_does_not_free_an_imported_range(dev0, workers):
    """docs/sharing.md: acl.rt.free of a key's imported range (or of one open_shared mapped) is
    refused with 207002, as for the caching allocator's segments; the mapping stays."""
    (w,) = workers()
    ptr, ret = rt.malloc(MiB, 0)
    ctypes.memset(ptr, 0x46, MiB)
    key, ret = rt.ipc_mem_get_export_key(ptr, MiB, 65, acl.ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION)
    block = npualloc.caching_allocator_alloc(MiB, 0)
    ctypes.memset(block, 0x47, MiB)
    got = w.call("""
import pickle
p, r = rt.ipc_mem_import_by_key(key, 0)
o = npualloc.open_shared(pickle.loads(blob))
ret = (r, rt.free(p), rt.free(o), ctypes.string_at(p, 2), ctypes.string_at(o, 2), rt.ipc_mem_close(key))
npualloc.close_shared(o)
""", key=key, blob=pickle.dumps(npualloc.share(block)))
    assert got == (0, acl.ACL_ERROR_RT_MEMORY_FREE, acl.ACL_ERROR_RT_MEMORY_FREE, b"FF", b"GG", 0)
    npualloc.caching_allocator_delete(block)
    assert rt.free(ptr) == 0


CHURN = """
import threading, time
stop = time.monotonic() + seconds
bad = []
def churn():
    while time.monotonic() < stop:
        one()
def one_key():
    p, r = rt.ipc_mem_import_by_key(key, 0)
    if r != 0 or ctypes.string_at(p, 1) != b"C" or rt.ipc_mem_close(key) != 0:
        bad.append(r)
def one_open():
    p = npualloc.open_shared(handle)
    if ctypes.string_at(p, 1) != b"C":
        bad.append(p)
    npualloc.close_shared(p)
one = one_key if key else one_open
ts = [threading.Thread(target=churn) for _ in range(4)]
for t in ts:
    t.start()
for t in ts:
    t.join()
ret = (bad, _C.ipc.counts()["key_imports"], _C.ipc.counts()["opens"], _C.vmm_counts()["mappings"])
"""


def test_threads_importing_and_closing_at_once(dev0, workers):
    """Threads importing and closing one key (or opening and closing one shared block) at once:
    a close read its entry's count after letting go of the lock, so that two closes could both
    see the last one and free it twice (the importer aborted: "double free or corruption")."""
    (w,) = workers()
    ptr, ret = rt.malloc(MiB, 0)
    ctypes.memset(ptr, 0x43, MiB)
    key, ret = rt.ipc_mem_get_export_key(ptr, MiB, 65, acl.ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION)
    assert w.call(CHURN, key=key, handle=None, seconds=1.5) == ([], 0, 0, 0)
    block = npualloc.caching_allocator_alloc(MiB, 0)
    ctypes.memset(block, 0x43, MiB)
    assert w.call(CHURN, key="", handle=npualloc.share(block), seconds=1.5) == ([], 0, 0, 0)
    npualloc.caching_allocator_delete(block)
    assert rt.free(ptr) == 0
