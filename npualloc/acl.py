"""The pyACL face: ``npualloc.acl.rt.*`` functions and CANN's constants.

Conventions as pyACL: outputs first, ``ret`` last; bad values return an error code.
"""
from . import _C

rt = _C.rt
