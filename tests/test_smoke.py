"""The extension imports and drives the virtual runtime."""
from npualloc import acl


def test_malloc_free_roundtrip():
    assert acl.rt.set_device(0) == 0
    ptr, ret = acl.rt.malloc(1000, 0)
    assert ret == 0 and ptr != 0
    assert acl.rt.free(ptr) == 0
    assert acl.rt.free(ptr) == 207002
