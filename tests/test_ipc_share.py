"""npualloc.share / open_shared / close_shared: caching-allocator blocks (plain and expandable
segments) opened by other processes, and the sharing pin that keeps the owner from reusing a
block while someone still has it open."""
import ctypes
import os
import pickle
import signal
import socket
import struct
import time

import pytest

import npualloc
from conftest import MiB
from npualloc import _C, acl
from test_ipc import workers  # noqa: F401  (fixture)

OPEN = """
ptr = npualloc.open_shared(pickle.loads(blob))
ret = (ptr, ctypes.string_at(ptr, 4), ctypes.string_at(ptr + size - 4, 4))
ctypes.memmove(ptr, b"seen", 4)
"""


@pytest.fixture(params=["plain", "expandable"])
def segments(request, dev0):
    if request.param == "expandable":
        npualloc.memory._set_allocator_settings("expandable_segments:True")
    return request.param


def wait_for(pred, timeout=5.0):
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def counts():
    return _C.ipc.counts()


@pytest.mark.parametrize("size", [3 * MiB, 100_000, 45 * MiB])
def test_open_shared_sees_the_owners_bytes(segments, workers, size):  # noqa: F811
    (w,) = workers()
    w.call("import pickle")
    ptr = npualloc.caching_allocator_alloc(size, 0)
    ctypes.memset(ptr, 0x53, size)
    handle = npualloc.share(ptr)
    assert handle.kind == ("e" if segments == "expandable" else "c")
    assert (handle.owner_pid, handle.device) == (acl.rt.device_get_bare_tgid()[0], 0)
    assert handle.size >= size
    assert npualloc.share(ptr) == handle  # sharing again: the same handle
    blob = pickle.dumps(handle)
    assert len(blob) < 512  # small
    wptr, head, tail = w.call(OPEN, blob=blob, size=size)
    assert head == b"SSSS" and tail == b"SSSS"
    assert ctypes.string_at(ptr, 5) == b"seenS"  # the opener's write, seen by the owner
    ctypes.memmove(ptr + size - 4, b"back", 4)
    assert w.call("ret = ctypes.string_at(p, 4)", p=wptr + size - 4) == b"back"
    # opened twice: the same pointer; closed as many times
    assert w.call("ret = npualloc.open_shared(pickle.loads(blob))", blob=blob) == wptr
    w.call("npualloc.close_shared(p); npualloc.close_shared(p)", p=wptr)
    with pytest.raises(AssertionError, match="was not opened"):
        w.call("npualloc.close_shared(p)", p=wptr)
    assert w.call("ret = (_C.ipc.counts()['opens'], _C.ipc.counts()['sessions'], _C.vmm_counts())") == \
        (0, 0, {"physical_handles": 0, "reservations": 0, "mappings": 0, "fds_kept": 0})
    npualloc.caching_allocator_delete(ptr)
    assert wait_for(lambda: counts()["shares"] == 0 and counts()["exports"] == 0)


def test_owner_does_not_reuse_a_block_until_the_last_opener_closed(segments, workers):  # noqa: F811
    a, b = workers(2)
    for w in (a, b):
        w.call("import pickle")
    size = 3 * MiB
    ptr = npualloc.caching_allocator_alloc(size, 0)
    ctypes.memset(ptr, 0x41, size)
    blob = pickle.dumps(npualloc.share(ptr))
    pa = a.call(OPEN, blob=blob, size=size)[0]
    pb = b.call(OPEN, blob=blob, size=size)[0]
    assert counts()["pins"] == 2
    npualloc.caching_allocator_delete(ptr)  # returns at once; the memory stays the openers'
    others = [npualloc.caching_allocator_alloc(size, 0) for _ in range(3)]
    assert ptr not in others
    for p in others:
        npualloc.caching_allocator_delete(p)
    npualloc.empty_cache()  # does not wait for the openers, and does not release the block
    assert npualloc.memory._check() is None
    # a freed block can no longer be opened
    (c,) = workers()
    with pytest.raises(AssertionError, match="no longer shared"):
        c.call("import pickle; npualloc.open_shared(pickle.loads(blob))", blob=blob)
    a.call("npualloc.close_shared(p)", p=pa)
    assert wait_for(lambda: counts()["pins"] == 1)
    assert npualloc.caching_allocator_alloc(size, 0) != ptr  # b still has it
    b.call("npualloc.close_shared(p)", p=pb)
    assert wait_for(lambda: counts()["pins"] == 0 and counts()["shares"] == 0)
    assert npualloc.caching_allocator_alloc(size, 0) == ptr  # back in the cache: reused
    assert npualloc.memory._check() is None


def test_an_opener_that_dies_releases_its_pins(segments, workers):  # noqa: F811
    victim, survivor = workers(2)
    for w in (victim, survivor):
        w.call("import pickle")
    size = 5 * MiB
    ptr = npualloc.caching_allocator_alloc(size, 0)
    ctypes.memset(ptr, 0x44, size)
    blob = pickle.dumps(npualloc.share(ptr))
    victim.call(OPEN, blob=blob, size=size)
    ps = survivor.call(OPEN, blob=blob, size=size)[0]
    npualloc.caching_allocator_delete(ptr)
    victim.kill()
    assert wait_for(lambda: counts()["pins"] == 1)
    assert survivor.call("ret = ctypes.string_at(p + 4, 4)", p=ps) == b"DDDD"  # the other opener is fine
    survivor.kill()
    assert wait_for(lambda: counts()["pins"] == 0 and counts()["clients"] == 0 and counts()["shares"] == 0)
    assert npualloc.caching_allocator_alloc(size, 0) == ptr
    assert npualloc.memory._check() is None


def test_expandable_pages_of_a_pinned_block_stay_mapped(dev0, workers):  # noqa: F811
    npualloc.memory._set_allocator_settings("expandable_segments:True")
    (w,) = workers()
    w.call("import pickle")
    size = 45 * MiB  # three 20 MiB pages
    ptr = npualloc.caching_allocator_alloc(size, 0)
    ctypes.memset(ptr, 0x45, size)
    reserved = npualloc.memory_reserved(0)
    blob = pickle.dumps(npualloc.share(ptr))
    wptr = w.call(OPEN, blob=blob, size=size)[0]
    npualloc.caching_allocator_delete(ptr)
    npualloc.empty_cache()
    assert npualloc.memory_reserved(0) == reserved  # nothing of the pinned block was unmapped
    ctypes.memmove(ptr + size - 4, b"live", 4)  # still the owner's mapping of the same pages
    assert w.call("ret = ctypes.string_at(p, 4)", p=wptr + size - 4) == b"live"
    w.call("npualloc.close_shared(p)", p=wptr)
    assert wait_for(lambda: counts()["pins"] == 0)
    npualloc.empty_cache()
    assert npualloc.memory_reserved(0) == 0  # now the pages go


def test_open_shared_for_another_device(dev0, workers):  # noqa: F811
    (w,) = workers()
    w.call("import pickle")
    ptr = npualloc.caching_allocator_alloc(MiB, 0)
    ctypes.memset(ptr, 0x4F, MiB)
    blob = pickle.dumps(npualloc.share(ptr))
    with pytest.raises(AssertionError, match="peer access"):
        w.call("npualloc.open_shared(pickle.loads(blob), device=1)", blob=blob)
    w.call("rt.set_device(1); rt.device_enable_peer_access(0, 0)")
    wptr = w.call("ret = npualloc.open_shared(pickle.loads(blob), device='npu:1')", blob=blob)
    assert w.call("ret = ctypes.string_at(p, 2)", p=wptr) == b"OO"
    w.call("npualloc.close_shared(p)", p=wptr)


def test_share_errors(dev0):
    with pytest.raises(RuntimeError, match="not a live block"):
        npualloc.share(0x1234)
    # the address as it was given (NULL and -1 printed as "0x(nil)")
    for bad in (0, -1, 1 << 70):
        with pytest.raises(RuntimeError, match=rf"^share: {bad} is not a live block of the caching allocator$"):
            npualloc.share(bad)
        with pytest.raises(RuntimeError, match=rf"^close_shared: {bad} was not opened by open_shared$"):
            npualloc.close_shared(bad)
    ptr = npualloc.caching_allocator_alloc(MiB, 0)
    with pytest.raises(RuntimeError, match="not a live block"):
        npualloc.share(ptr + 512)  # inside a block: not a block
    with pytest.raises(TypeError):
        npualloc.share("ptr")
    handle = npualloc.share(ptr)
    with pytest.raises(RuntimeError, match="not permitted"):
        npualloc.open_shared(handle)  # the owner itself
    with pytest.raises(ValueError):
        npualloc.open_shared(b"garbage")
    with pytest.raises(ValueError):
        npualloc.SharedBlock(b"NPUS" + b"\0" * 76)
    with pytest.raises(TypeError):
        npualloc.open_shared(12)
    # the device is checked first: only None, an int, 'npu:N' or an npu device object (a CPU or CUDA device,
    # or a string int() would read, opened the block on NPU 0)
    for bad in ("npu:+0", " 0 ", "0", "npu", "cpu:0", "npu:0 "):
        with pytest.raises(ValueError):
            npualloc.open_shared(handle, device=bad)
    for bad in (True, 1.0, object()):
        with pytest.raises(TypeError):
            npualloc.open_shared(handle, device=bad)

    class Device:  # what torch.device offers
        def __init__(self, type, index):
            self.type, self.index = type, index
    for bad in (Device("cpu", 0), Device("cuda", 0), Device("npu", None)):
        with pytest.raises(ValueError):
            npualloc.open_shared(handle, device=bad)
    with pytest.raises(RuntimeError, match="not permitted"):
        npualloc.open_shared(handle, device=Device("npu", 0))  # accepted: the owner itself is refused
    with pytest.raises(RuntimeError, match="was not opened"):
        npualloc.close_shared(ptr)
    assert pickle.loads(pickle.dumps(handle)) == handle
    assert "kind='c'" in repr(handle)
    npualloc.caching_allocator_delete(ptr)
    with pytest.raises(RuntimeError, match="not a live block"):
        npualloc.share(ptr)
    assert counts()["shares"] == 0


def test_opener_cannot_touch_neighbouring_blocks(segments, workers):  # noqa: F811
    """open_shared maps only the host pages covering the block: the owner's neighbouring blocks
    of the same segment (or expandable page) fault in the opener beyond those pages."""
    size = 256 * 1024
    lo, mid, hi = sorted(npualloc.caching_allocator_alloc(size, 0) for _ in range(3))
    assert mid - lo < 2 * size and hi - mid < 2 * size  # three neighbours in one segment
    for p, fill in ((lo, 0x4C), (mid, 0x4D), (hi, 0x48)):
        ctypes.memset(p, fill, size)
    handle = npualloc.share(mid)
    blob = pickle.dumps(handle)
    below = -(mid % 4096) - 1  # the last byte before the first page of the block: lo's
    above = -(-(mid + handle.size) // 4096) * 4096 - mid  # the first byte past its last page
    assert lo <= mid + below < mid and mid + handle.size <= mid + above < hi + size
    probe = "import pickle\np = npualloc.open_shared(pickle.loads(blob))\nret = ctypes.string_at(p + off, 1)"
    ws = workers(3)
    # the block itself, first and last byte: readable
    assert ws[0].call(probe, blob=blob, off=0) == b"M"
    assert ws[0].call("ret = ctypes.string_at(p + size - 1, 1)", size=size) == b"M"
    # the bytes just outside its pages belong to other blocks -> SIGSEGV in the opener
    for w, off in ((ws[1], below), (ws[2], above)):
        w.send(probe, blob=blob, off=off)
        assert w.proc.wait(timeout=20) == -signal.SIGSEGV
    ws[0].close()
    for p in (lo, mid, hi):
        npualloc.caching_allocator_delete(p)
    assert wait_for(lambda: counts()["shares"] == 0 and counts()["pins"] == 0)


def test_a_negative_device_is_no_device(dev0, workers):  # noqa: F811
    """Only device=None means the owner's device: a negative index is refused like any device
    that does not exist (it used to open the block on the owner's device)."""
    (w,) = workers()
    w.call("import pickle")
    ptr = npualloc.caching_allocator_alloc(MiB, 0)
    blob = pickle.dumps(npualloc.share(ptr))
    for device in (-1, -5, "npu:-3"):
        with pytest.raises(AssertionError, match=r"invalid device \(ACL error 107001\)"):
            w.call("npualloc.open_shared(pickle.loads(blob), device=d)", blob=blob, d=device)
    assert w.call("ret = _C.ipc.counts()['opens']") == 0
    npualloc.caching_allocator_delete(ptr)


def test_threads_opening_one_handle_get_one_pointer(segments, workers):  # noqa: F811
    """Opening a handle again returns the same pointer, also when threads open it at once (each
    used to map it at a pointer of its own)."""
    (w,) = workers()
    size = 3 * MiB
    ptr = npualloc.caching_allocator_alloc(size, 0)
    ctypes.memset(ptr, 0x54, size)
    blob = pickle.dumps(npualloc.share(ptr))
    code = """
import pickle, threading
h = pickle.loads(blob)
go = threading.Barrier(8)
got = []
def one():
    go.wait()
    got.append(npualloc.open_shared(h))
ts = [threading.Thread(target=one) for _ in range(8)]
for t in ts:
    t.start()
for t in ts:
    t.join()
ret = (sorted(set(got)), _C.ipc.counts()["opens"], ctypes.string_at(got[0], 2))
"""
    for _ in range(3):
        ptrs, opens, head = w.call(code, blob=blob)
        assert len(ptrs) == 1 and opens == 1 and head == b"TT"
        assert wait_for(lambda: counts()["pins"] == 1)  # one open, one pin
        w.call("for _ in range(8): npualloc.close_shared(p)", p=ptrs[0])
        assert w.call("ret = (_C.ipc.counts()['opens'], _C.vmm_counts()['mappings'])") == (0, 0)
        assert wait_for(lambda: counts()["pins"] == 0)
    npualloc.caching_allocator_delete(ptr)
    assert wait_for(lambda: counts()["shares"] == 0)


def test_opens_of_freed_blocks_do_not_cut_off_another_threads_open(dev0, workers):  # noqa: F811
    """Each open of a block its owner freed fails (107017) and counts against the connection, which the
    opener's threads share; the owner used to hang up after 16 such failures, and an open of a live
    block in flight on another thread then failed too."""
    (w,) = workers()
    live = npualloc.caching_allocator_alloc(MiB, 0)
    ctypes.memset(live, ord("L"), MiB)
    blocks = [npualloc.caching_allocator_alloc(4096, 0) for _ in range(40)]
    freed = [pickle.dumps(npualloc.share(b)) for b in blocks]
    for b in blocks:
        npualloc.caching_allocator_delete(b)
    code = """
import collections, pickle, threading, time
live_h = pickle.loads(live); freed_h = [pickle.loads(b) for b in freed]
results = collections.Counter()
stop = threading.Event()
def open_live():
    while not stop.is_set():
        try:
            q = npualloc.open_shared(live_h)
            results["live " + ("ok" if ctypes.string_at(q, 1) == b"L" else "wrong bytes")] += 1
            npualloc.close_shared(q)
        except RuntimeError as e:
            results["live failed: " + str(e)[-30:]] += 1
t = threading.Thread(target=open_live)
t.start()
while not results:
    time.sleep(0.001)
for _ in range(15):  # 600 failures: below the owner's 1000 a second (beyond, it refuses every lookup)
    for h in freed_h:
        try:
            npualloc.open_shared(h)
            results["freed opened"] += 1
        except RuntimeError as e:
            results["freed " + ("107017" if "107017" in str(e) else str(e))] += 1
stop.set()
t.join()
ret = dict(results)
"""
    got = w.call(code, live=pickle.dumps(npualloc.share(live)), freed=freed)
    assert got.pop("freed 107017") == 15 * 40
    assert got.pop("live ok") > 0
    assert got == {}  # no live open failed, none read wrong bytes
    npualloc.caching_allocator_delete(live)
    assert wait_for(lambda: counts()["shares"] == 0)


def test_an_open_after_its_owner_exited_fails_on_the_connection_left_open(dev0, workers):  # noqa: F811
    """An opener keeps its connection to an owner while it has a block of it open; when the owner exits,
    the next open sent on that connection meets the hang-up, is tried once more on a connection of its
    own (an owner hangs up on a connection of 16 failed lookups), and fails 107017: nobody listens."""
    (owner,) = workers()
    owner.call("import pickle")
    code = "p = npualloc.caching_allocator_alloc(4096, 0); ctypes.memset(p, 0x33, 4096); " \
           "ret = pickle.dumps(npualloc.share(p))"
    first, second = owner.call(code), owner.call(code)
    q = npualloc.open_shared(pickle.loads(first))
    assert ctypes.string_at(q, 2) == b"33"
    owner.kill()
    with pytest.raises(RuntimeError, match="107017"):
        npualloc.open_shared(pickle.loads(second))
    assert ctypes.string_at(q, 2) == b"33"  # the open block stays readable
    npualloc.close_shared(q)


def stopped(pid):
    """Every thread of the process is stopped: SIGSTOP stops the others only once the thread that took it
    runs, and meanwhile a server thread still answers (/proc/PID/stat shows the main thread alone)."""
    def state(task):
        with open(f"/proc/{pid}/task/{task}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    return all(state(task) == "T" for task in os.listdir(f"/proc/{pid}/task"))


def test_a_late_reply_answers_nothing_and_leaves_no_pin(dev0, workers, monkeypatch):  # noqa: F811
    """Requests on a connection to an owner carry ids.  Replies that come after their requests
    timed out (the owner was stopped) are dropped by the next request, which gets its own answer
    on the same connection; an open whose grant came late is cancelled, so the owner holds no pin
    for it and frees that block at once.  (The opener used to give the connection up: later
    opens made a second one, and the late grant kept its block pinned until every block opened
    through the first connection was closed.)"""
    monkeypatch.setenv("NPUALLOC_IPC_TIMEOUT_MS", "300")
    (owner,) = workers()
    handles = owner.call("""
bs = [npualloc.caching_allocator_alloc(2**20, 0) for _ in range(4)]
for i, b in enumerate(bs):
    ctypes.memset(b, 0x41 + i, 2**20)
ret = [bytes(npualloc.share(b)) for b in bs]
npualloc.caching_allocator_delete(bs[2])  # no longer shared
""")
    pins = "ret = _C.ipc.counts()['pins']"
    o0 = npualloc.open_shared(handles[0])
    o3 = npualloc.open_shared(handles[3])  # the same connection
    owner.proc.send_signal(signal.SIGSTOP)
    try:
        assert wait_for(lambda: stopped(owner.proc.pid))
        with pytest.raises(RuntimeError, match="did not answer properly"):
            npualloc.open_shared(handles[1])  # granted after SIGCONT
        npualloc.close_shared(o3)  # unanswered too: unmapped here, unpinned there later
    finally:
        owner.proc.send_signal(signal.SIGCONT)
    # the next requests get their own answers, not the late "granted" of handles[1]
    with pytest.raises(RuntimeError, match="no longer shared"):
        npualloc.open_shared(handles[2])
    o3 = npualloc.open_shared(handles[3])
    assert ctypes.string_at(o3, 2) == b"DD" and ctypes.string_at(o0, 2) == b"AA"
    assert counts()["sessions"] == 1  # still the first connection
    assert owner.call(pins) == 2  # o0 and o3: the late grant was cancelled, the late close done
    # nobody has block 1 open: freeing it ends its share at once (a pin would keep it)
    assert owner.call("ret = _C.ipc.counts()['shares']") == 3
    assert owner.call("npualloc.caching_allocator_delete(bs[1]); ret = _C.ipc.counts()['shares']") == 2
    npualloc.close_shared(o0)  # answered on the same connection: the pin goes now
    assert owner.call(pins) == 1
    npualloc.close_shared(o3)
    assert counts()["opens"] == 0 and counts()["sessions"] == 0
    assert wait_for(lambda: owner.call(pins) == 0)


MAGIC = 0x4955504E  # "NPUI", the sharing protocol's
SHARE_DESC_SECRET = 12  # offset of the server's name secret in a share descriptor
# Worker code (needs socket and struct, and `off` = SHARE_DESC_SECRET): a real share's descriptor `h`
# rewritten to name `fake`, a listening socket of this process that the test answers by hand.
FAKE_OWNER = """
b = npualloc.caching_allocator_alloc(2**20, 0)
h = bytearray(bytes(npualloc.share(b)))
fake_secret = (_C.ipc.counts()['secret'] + 1) % 1024
struct.pack_into("<I", h, off, fake_secret)
fake = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
fake.bind("\\0" + _C.ipc.server_name(os.getpid(), fake_secret))
fake.listen()
"""


def test_a_request_of_another_protocol_version_is_refused_with_an_ipc_error(dev0, workers):  # noqa: F811
    """A version-1 request (an older npualloc) gets a version-1 reply with 507022, which its
    sender reads as an IPC error, then the hang-up; a request of a later version gets a reply
    that names version 2, then the hang-up (a bare hang-up reads as an owner that went away)."""
    (owner,) = workers()
    pid, secret = owner.call("""
b = npualloc.caching_allocator_alloc(2**20, 0)
npualloc.share(b)
ret = (os.getpid(), _C.ipc.counts()['secret'])
""")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(10)
        s.connect("\0" + _C.ipc.server_name(pid, secret))
        s.send(struct.pack("<IHHiIQ16s", MAGIC, 1, 3, 0, 0, 0, bytes(16)))  # v1 OPEN
        assert struct.unpack("<IiiIQ", s.recv(64)) == (MAGIC, acl.ACL_ERROR_RT_IPC_ERROR, -1, 0, 0)
        assert s.recv(64) == b""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:  # a later version: the reply says 2
        s.settimeout(10)
        s.connect("\0" + _C.ipc.server_name(pid, secret))
        s.send(struct.pack("<IHHiIQ16s", MAGIC, 7, 3, 0, 5, 0, bytes(16)))
        assert struct.unpack("<IHHIiiIQ", s.recv(64)) == (MAGIC, 2, 0, 0, acl.ACL_ERROR_RT_IPC_ERROR, -1, 0, 0)
        assert s.recv(64) == b""


@pytest.mark.parametrize("version", [1, 3])
def test_an_owner_of_another_protocol_version_is_named_in_the_error(dev0, workers, version):  # noqa: F811
    """An owner whose replies are of another version (version 1's had no version field and 24
    bytes; a later one's says it): open_shared fails with 507022 and says that the two processes
    run different npualloc versions; the connection is given up."""
    (owner,) = workers()
    handle = owner.call("""
import socket, struct, threading
""" + FAKE_OWNER + """def serve():
    conn, _ = fake.accept()
    magic, _, op, _, rid = struct.unpack_from("<IHHiI", conn.recv(64))
    if version == 1:
        conn.send(struct.pack("<IiiIQ", magic, 0, 0, 0, 0))
    else:
        conn.send(struct.pack("<IHHIiiIQ", magic, version, op, rid, 0, 0, 0, 0))
    conn.recv(64)
threading.Thread(target=serve, daemon=True).start()
ret = bytes(h)
""", off=SHARE_DESC_SECRET, version=version)
    expected = (rf"the owner speaks version {version} of npualloc's sharing protocol and this process version 2: "
                r"both must run the same npualloc \(ACL error 507022\)")
    with pytest.raises(RuntimeError, match=expected):
        npualloc.open_shared(handle)
    assert counts()["sessions"] == 0 and counts()["opens"] == 0


def test_a_late_reply_with_a_descriptor_leaks_nothing(dev0, workers, monkeypatch):  # noqa: F811
    """An owner (a hand-made one here) that answers a page import after the opener's timeout:
    the open fails with 507022 and its pin is given back on the same connection (CLOSE, id 3, is
    answered after the late reply), and the descriptor of the late reply is not left open in the
    opener."""
    monkeypatch.setenv("NPUALLOC_IPC_TIMEOUT_MS", "500")
    (owner,) = workers()
    handle = owner.call("""
import socket, struct, threading, time
""" + FAKE_OWNER + """seen = []
def reply(conn, op, rid, size=0, fds=()):
    socket.send_fds(conn, [struct.pack("<IHHIiiIQ", 0x4955504E, 2, op, rid, 0, 0, 0, size)], list(fds))
def serve():
    conn, _ = fake.accept()
    for _ in range(3):
        magic, version, op, pid, rid = struct.unpack_from("<IHHiI", conn.recv(64))
        seen.append((op, rid))
        if op == 2:  # the page import: answered after the opener's timeout, with a descriptor
            time.sleep(0.7)
            mem = os.memfd_create("late")
            os.ftruncate(mem, 2**21)
            reply(conn, op, rid, 2**21, [mem])
            os.close(mem)
        else:
            reply(conn, op, rid)
    conn.recv(64)
server = threading.Thread(target=serve, daemon=True)
server.start()
ret = bytes(h)
""", off=SHARE_DESC_SECRET)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(RuntimeError, match="did not answer properly"):
        npualloc.open_shared(handle)
    assert owner.call("server.join(5); ret = seen") == [(3, 1), (2, 2), (4, 3)]  # OPEN, IMPORT_KEY, CLOSE
    assert len(os.listdir("/proc/self/fd")) == fds
    assert counts()["sessions"] == 0 and counts()["opens"] == 0


def test_share_takes_a_buffer_from_empty(dev0):
    """share() names empty() as a source of blocks, and empty() returns a Buffer: share takes
    it (it raised TypeError), as record_stream does."""
    buf = npualloc.empty(1000)
    handle = npualloc.share(buf)
    assert handle == npualloc.share(buf.ptr) and handle.size >= 1000
    buf.free()
    with pytest.raises(RuntimeError, match="not a live block"):
        npualloc.share(buf)
    assert counts()["shares"] == 0



def test_a_forked_child_has_none_of_its_parents_opens(dev0, workers):  # noqa: F811
    """docs/sharing.md, Fork and threads: the parent's open is not the child's (close_shared
    raises, the range faults); the child opens for itself, and the owner sees two pins."""
    (w,) = workers()
    ptr = npualloc.caching_allocator_alloc(MiB, 0)
    ctypes.memset(ptr, 0x46, MiB)
    code = """
import pickle
p = npualloc.open_shared(pickle.loads(blob))
up_rd, up_wr = os.pipe()
down_rd, down_wr = os.pipe()
pid = os.fork()
if pid == 0:
    code = 1
    try:
        try:
            npualloc.close_shared(p)
        except RuntimeError:  # not opened here
            q = npualloc.open_shared(pickle.loads(blob))
            os.write(up_wr, ctypes.string_at(q, 2))
            os.read(down_rd, 1)  # the owner counted the pins
            npualloc.close_shared(q)
            code = 0
    finally:
        os._exit(code)
ret = os.read(up_rd, 2)
"""
    assert w.call(code, blob=pickle.dumps(npualloc.share(ptr))) == b"FF"
    assert wait_for(lambda: counts()["pins"] == 2)
    assert w.call("os.write(down_wr, b'x'); ret = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])") == 0
    assert wait_for(lambda: counts()["pins"] == 1)
    touch = "ret = os.fork()\nif ret == 0:\n    ctypes.string_at(p, 1)\n    os._exit(0)\n" \
            "ret = os.waitstatus_to_exitcode(os.waitpid(ret, 0)[1])"
    assert w.call(touch) == -signal.SIGSEGV  # the parent's range is not mapped in a child
    assert w.call("ret = ctypes.string_at(p, 2)") == b"FF"
    w.call("npualloc.close_shared(p)")
    assert wait_for(lambda: counts()["pins"] == 0)
    npualloc.caching_allocator_delete(ptr)
