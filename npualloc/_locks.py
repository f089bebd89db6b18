"""Locks of npualloc's Python objects, made anew in a fork child.

A lock another thread held when the process forked stays held in the child, where that thread does not
exist: the child's first use of the object would wait for ever.  Objects make their locks here, and an
``os.register_at_fork`` hook gives every live one a fresh lock in the child.
"""
import os
import threading
import weakref

_owners = weakref.WeakKeyDictionary()  # object -> the names of its lock attributes (objects hash by identity)


def fork_safe_lock(owner, name):
    """Sets ``owner.<name>`` to a new lock, which a fork child gets anew; returns it."""
    lock = threading.Lock()
    setattr(owner, name, lock)
    _owners.setdefault(owner, set()).add(name)
    return lock


def _renew_in_child():
    for owner, names in list(_owners.items()):
        for name in names:
            setattr(owner, name, threading.Lock())


os.register_at_fork(after_in_child=_renew_in_child)
