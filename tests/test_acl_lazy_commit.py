"""Device memory is committed only when touched, and each physical handle is its own memory file.

In a fresh process (the device size is fixed at start-up): a 32 GiB device, 16 GiB malloc'ed cost
next to no resident memory; touching 8 MiB of it costs ~8 MiB; three physical handles are three
distinct memfd files ("/memfd:npualloc", csrc/host.c) in /proc/self/maps, each mapped where it was
mapped into a reserved range.
"""
import json

from conftest import run_python

SCRIPT = r'''
import json, os
from npualloc import acl
rt = acl.rt
MiB, GiB = 1 << 20, 1 << 30
PAGE = os.sysconf("SC_PAGE_SIZE")

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE

def memfds():
    """(start, end, inode) of every npualloc memory-file mapping."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if "/memfd:npualloc" in line:
                fields = line.split()
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                out.append((lo, hi, int(fields[4])))
    return out

assert rt.set_device(0) == 0
before_files = {ino for _, _, ino in memfds()}
r0 = rss()
p, ret = rt.malloc(16 * GiB, acl.ACL_MEM_MALLOC_HUGE_FIRST)
assert ret == 0, ret
r1 = rss()
assert rt.memset(p, 8 * MiB, 1, 8 * MiB) == 0
r2 = rss()
big = [(lo, hi, ino) for lo, hi, ino in memfds() if lo <= p < hi]

prop = {"handleType": 0, "allocationType": 0, "memAttr": acl.ACL_HBM_MEM_HUGE,
        "location": {"id": 0, "type": 1}, "reserve": 0}
handles = []
for _ in range(3):
    h, ret = rt.malloc_physical(2 * MiB, prop, 0)
    assert ret == 0, ret
    handles.append(h)
va, ret = rt.reserve_mem_address(6 * MiB, 0, 0, 0)
assert ret == 0, ret
for i, h in enumerate(handles):
    assert rt.map_mem(va + i * 2 * MiB, 2 * MiB, 0, h, 0) == 0
at_va = [[lo - va, hi - va, ino] for lo, hi, ino in memfds() if va <= lo < va + 6 * MiB]
new_files = {ino for _, _, ino in memfds()} - before_files
print(json.dumps({"r0": r0, "r1": r1, "r2": r2, "big": big, "at_va": at_va, "new_files": len(new_files)}))
'''


def test_memory_is_committed_when_touched_and_each_handle_is_a_memfd():
    proc = run_python(SCRIPT, env={"NPUALLOC_DEVICE_COUNT": "1", "NPUALLOC_DEVICE_MEMORY": "32GiB"})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    MiB = 1 << 20
    assert out["r1"] - out["r0"] < 4 * MiB, f"malloc of 16 GiB made {(out['r1'] - out['r0']) / MiB:.1f} MiB resident"
    touched = out["r2"] - out["r1"]
    assert 7 * MiB <= touched <= 12 * MiB, f"touching 8 MiB made {touched / MiB:.1f} MiB resident"
    # the 16 GiB allocation is one memory file, mapped whole
    assert len(out["big"]) == 1 and out["big"][0][1] - out["big"][0][0] >= 16 << 30, out["big"]
    # three handles: three files, one mapping each at its place in the reserved range
    assert [(lo, hi) for lo, hi, _ in out["at_va"]] == [(0, 2 * MiB), (2 * MiB, 4 * MiB), (4 * MiB, 6 * MiB)], out["at_va"]
    assert len({ino for _, _, ino in out["at_va"]}) == 3
    assert out["new_files"] == 4  # the 16 GiB allocation and the three handles
