"""Compile cachemgr.fs._dirscan and _unlink and cachemgr.gc._rank (C, Linux) into the package:
wheels and editable installs alike.

setuptools does the compiling (compiler, flags and the extension's file name all come from the
Python being built for); hatchling ships the result and tags the wheel for this platform.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class DirscanBuildHook(BuildHookInterface):  # type: ignore[misc]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        from setuptools import Distribution, Extension
        from setuptools.command.build_ext import build_ext

        exts = [
            Extension(
                f"cachemgr.{name}",
                sources=[f"cachemgr/{name.replace('.', '/')}.c"],
                # (no fused multiply-adds: _rank's values must be the Python path's, bit for bit)
                extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-ffp-contract=off"],
                extra_link_args=["-pthread", "-ldl", "-lm"],  # (dlopen: glibc < 2.34)
            )
            for name in ("fs._dirscan", "fs._unlink", "gc._rank")
        ]
        cmd = build_ext(Distribution({"ext_modules": exts}))
        cmd.inplace = True  # next to its source, where an editable install imports it from
        cmd.ensure_finalized()
        cmd.run()
        for ext in exts:
            built = Path(cmd.get_ext_fullpath(ext.name)).relative_to(Path.cwd())
            build_data["force_include"][str(built)] = str(built)
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
