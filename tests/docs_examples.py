"""The fenced example blocks of the docs, for the tests/test_docs_*.py modules: each block with its doc, the
line it starts on, its language and its text; and a fresh interpreter to run a Python example in."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/allocator.md", "docs/runtime.md", "docs/sharing.md", "docs/reliability.md",
        "benchmarks/README.md")


class Block:
    def __init__(self, doc, line, lang, text):
        self.doc, self.line, self.lang, self.text = doc, line, lang, text

    def __repr__(self):
        return f"{self.doc}:{self.line} ```{self.lang}"


def blocks(doc):
    """Every fenced block of `doc` (a path relative to the checkout), in order."""
    out = []
    lines = (ROOT / doc).read_text().splitlines(keepends=True)
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        out.append(Block(doc, i + 1, m.group(1), "".join(lines[i + 1:end])))
        i = end + 1
    return out


def run_python(code, env=None, timeout=60, args=(), stdin=None):
    """`code` in a fresh interpreter importing this checkout, with no PYTORCH_* or NPUALLOC_* variables (the
    runtime's defaults, as a reader has them) unless `env` sets some."""
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("NPUALLOC_", "PYTORCH_")) and k != "TORCH_NPU_COMPACT_ERROR_OUTPUT"}
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=full_env, capture_output=True,
                          text=True, timeout=timeout, input=stdin)


def printed_claims(code):
    """The output a Python example says its prints give: the comment after each `print(...)` that has one."""
    return [m.group(1).strip() for m in re.finditer(r"^\s*print\(.*\)\s*#\s*(.*)$", code, re.M)]


def make_targets():
    """The targets the Makefile defines."""
    return set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.M))
