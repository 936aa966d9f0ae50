"""Declares the C extension ``amesh._native._ext``; everything else is in pyproject.toml.

The extension links against nothing: it drives the NNG that pynng already loaded,
through function addresses handed over at import (see ext/nng.c). Its sources are a file
per concern (SOURCES below), built into the one module.

Build switches (environment variables):
    AMESH_EXT_DEBUG=1: ``-O0 -g``, assertions on, AddressSanitizer and UBSan. Run the
        tests with ``LD_PRELOAD=$(gcc -print-file-name=libasan.so)`` and
        ``ASAN_OPTIONS=detect_leaks=0`` (the interpreter itself is not instrumented).
"""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup

extra_compile_args = ["-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"]
extra_link_args: list[str] = []
undef_macros: list[str] = []
if os.environ.get("AMESH_EXT_DEBUG") == "1":
    sanitize = "-fsanitize=address,undefined"
    extra_compile_args += ["-O0", "-g3", "-fno-omit-frame-pointer", sanitize]
    extra_link_args += [sanitize]
    undef_macros += ["NDEBUG"]

# One file per concern, built into the one module (ext/module.c says what each holds).
SOURCES = ["module", "nng", "beat", "frame_reader", "frame_writer", "envelope", "bytes", "process"]

ext_modules = []
if sys.platform != "win32":  # POSIX threads and an eventfd or pipe
    ext_modules.append(
        Extension(
            "amesh._native._ext",
            sources=[f"ext/{name}.c" for name in SOURCES],
            depends=["ext/amesh_ext.h"],
            extra_compile_args=extra_compile_args,
            extra_link_args=extra_link_args,
            undef_macros=undef_macros,
        )
    )

setup(ext_modules=ext_modules)
