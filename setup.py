"""Builds the npualloc._C extension from the C core (csrc/) and its Python binding (csrc/python/)."""
import glob
import os
import shutil

from setuptools import Extension, setup
from setuptools.command.build_py import build_py


class build_py_with_headers(build_py):
    """Also installs the C headers (csrc/include) as npualloc/include: npualloc.get_include() finds
    them there, for a pluggable allocator built against an installed npualloc."""

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "npualloc", "include")
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree("csrc/include", target)


core = sorted(glob.glob("csrc/*.c"))
binding = sorted(glob.glob("csrc/python/*.c"))

setup(
    cmdclass={"build_py": build_py_with_headers},
    ext_modules=[
        Extension(
            "npualloc._C",
            sources=core + binding,
            include_dirs=["csrc", "csrc/include", "csrc/python"],
            extra_compile_args=["-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-Werror", "-O2",
                                "-fvisibility=hidden", "-flto=auto"],
            # link-time optimisation: the hot path inlines across the core's small files (the link
            # re-diagnoses inlined code with false maybe-uninitialized warnings: checked at compile)
            extra_link_args=["-pthread", "-O2", "-flto=auto", "-Wno-maybe-uninitialized"],
        )
    ],
)
