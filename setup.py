"""Builds the optional C helpers of the record path (acrobat/_native.c). Everything else
is configured in pyproject.toml. Without a C compiler the build goes on without them and
acrobat runs the same steps in Python (config.NATIVE)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "acrobat._native",
            ["acrobat/_native.c"],
            optional=True,  # a failed compile is a warning, not a failed install
            extra_compile_args=["-O2"],
        )
    ]
)
