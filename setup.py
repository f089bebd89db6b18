"""Builds the npualloc._C extension from the C core (csrc/) and its Python binding (csrc/python/)."""
import glob

from setuptools import Extension, setup

core = sorted(glob.glob("csrc/*.c"))
binding = sorted(glob.glob("csrc/python/*.c"))

setup(
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
