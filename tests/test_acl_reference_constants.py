"""Every ACL_* constant the reference lists (../shared/reference/npu-acl-runtime.md from the repository
root) is an attribute of npualloc.acl and a definition in csrc/include/acl_rt.h, with the reference's value.

The reference writes most constants as ``ACL_NAME=value``; in its error-code section a group abbreviates
names after the first (``ACL_ERROR_INTERNAL_ERROR=500000, FAILURE=500001, GE_FAILURE=500002``), so a bare
name there takes the prefix (``ACL_ERROR_`` or ``ACL_ERROR_RT_``) of the last full error name before it.
"""
import re
from pathlib import Path

import pytest

from npualloc import acl

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT.parent / "shared" / "reference" / "npu-acl-runtime.md"
HEADER = ROOT / "csrc" / "include" / "acl_rt.h"

# One or more names joined by "=" and then a number: `ACL_SUCCESS` = `ACL_ERROR_NONE` = 0, HUGE_FIRST=0, ...
CHAIN = re.compile(r"((?:`?[A-Z][A-Z0-9_]*`?\s*=\s*)+)(0x[0-9A-Fa-f]+|\d+)\b")
NAME = re.compile(r"[A-Z][A-Z0-9_]*")


def reference_constants(text):
    """name -> value for every ACL_* constant the reference gives a value."""
    found = {}
    in_errors = False
    prefix = None
    for line in text.splitlines():
        if line.startswith("#"):
            in_errors = "Error codes" in line
            prefix = None
            continue
        for chain, value in CHAIN.findall(line):
            for name in NAME.findall(chain):
                if name.startswith("ACL_ERROR_"):
                    prefix = "ACL_ERROR_RT_" if name.startswith("ACL_ERROR_RT_") else "ACL_ERROR_"
                elif not name.startswith("ACL_"):
                    if not (in_errors and prefix):
                        continue  # an enum member the reference names without its C prefix
                    name = prefix + name
                found[name] = int(value, 0)
    return found


def header_constants(text):
    """name -> value of the header's #defines and enum members (integer literals only)."""
    found = {}
    for name, value in re.findall(r"#define\s+(ACL_\w+)\s+(0x[0-9A-Fa-f]+|\d+)U?L?\b", text):
        found[name] = int(value, 0)
    for name, value in re.findall(r"\b(ACL_\w+)\s*=\s*(0x[0-9A-Fa-f]+|\d+)U?L?\b", text):
        found[name] = int(value, 0)
    return found


@pytest.fixture(scope="module")
def reference():
    if not REFERENCE.is_file():
        pytest.skip(f"the reference is not here: {REFERENCE} (it lives beside the repository, in ../shared)")
    return reference_constants(REFERENCE.read_text(encoding="utf-8"))


def test_the_parser_reads_full_abbreviated_and_chained_names():
    text = ("## B2\n- `ACL_HOST_REG_MAPPED=0x2`, `HUGE_ONLY=1`\n### Error codes\n"
            "  - `ACL_SUCCESS` = `ACL_ERROR_NONE` = 0\n  - `ACL_ERROR_INTERNAL_ERROR=500000`, `GE_FAILURE=500002`\n"
            "  - `ACL_RT_SUCCESS=0`\n  - `ACL_ERROR_RT_PARAM_INVALID=107000`, `TS_ERROR=507001`\n  - `OTHER=1`\n"
            "## B3\n- `IGNORED=5`\n")
    assert reference_constants(text) == {
        "ACL_HOST_REG_MAPPED": 2, "ACL_SUCCESS": 0, "ACL_ERROR_NONE": 0, "ACL_ERROR_INTERNAL_ERROR": 500000,
        "ACL_ERROR_GE_FAILURE": 500002, "ACL_RT_SUCCESS": 0, "ACL_ERROR_RT_PARAM_INVALID": 107000,
        "ACL_ERROR_RT_TS_ERROR": 507001, "ACL_ERROR_RT_OTHER": 1}


def test_the_reference_lists_the_constants_this_test_guards(reference):
    # a parser that silently found nothing would pass the checks below
    for name, value in {"ACL_ERROR_GE_FAILURE": 500002, "ACL_ERROR_RT_TS_ERROR": 507001,
                        "ACL_ERROR_RT_DEVICE_TASK_ABORT": 107022, "ACL_IPC_EVENT_HANDLE_SIZE": 64,
                        "ACL_HOST_REG_PINNED": 0x10000000, "ACL_HBM_MEM_P2P_HUGE1G": 11}.items():
        assert reference.get(name) == value, name
    assert len(reference) > 80


def test_every_reference_constant_is_in_npualloc_acl(reference):
    wrong = {name: (value, getattr(acl, name, "missing")) for name, value in reference.items()
             if getattr(acl, name, None) != value}
    assert not wrong, f"npualloc.acl differs from the reference (name: (reference, acl)): {wrong}"


def test_every_reference_constant_is_in_acl_rt_h(reference):
    header = header_constants(HEADER.read_text(encoding="utf-8"))
    wrong = {name: (value, header.get(name, "missing")) for name, value in reference.items()
             if header.get(name) != value}
    assert not wrong, f"acl_rt.h differs from the reference (name: (reference, header)): {wrong}"


def test_shared_handle_types_have_cann_names(reference):
    # the reference gives these without their C prefix (DEFAULT=1, FABRIC=2); CANN's header spells them so
    assert "`DEFAULT=1`, `FABRIC=2`" in REFERENCE.read_text(encoding="utf-8")
    header = header_constants(HEADER.read_text(encoding="utf-8"))
    for name, value in {"ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT": 1, "ACL_MEM_SHARE_HANDLE_TYPE_FABRIC": 2}.items():
        assert getattr(acl, name) == value and header[name] == value, name
