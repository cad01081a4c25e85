"""Build step of the native parts (greyhound 4.2, 6); the metadata lives in pyproject.toml.

Two plain C libraries (no Python.h), compiled with gcc, for wheels and for editable installs
(``pip install -e .``, whose build_ext copies them into ``src/``):
``failslow/nccl_hook/native/libfailslow_nccl.so``, the NCCL capture shim, and
``failslow/core/tracking/native/libfailslow_bocd.so``, the detectors' BOCD update.
``FAILSLOW_SKIP_NATIVE=1`` skips both; everything else installs and works without them (the
BOCD update then runs in numpy). ``CC`` picks another compiler.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NATIVE = "src/failslow/nccl_hook/native"
SOURCES = [f"{NATIVE}/{name}" for name in ("shim.c", "writer.c", "comms.c", "device.c")]
HEADERS = [f"{NATIVE}/{name}" for name in ("ring.h", "writer.h", "comms.h", "device.h")]
BOCD = "src/failslow/core/tracking/native/bocd.c"
CFLAGS = [
    "-O2",
    "-fPIC",
    "-shared",
    "-pthread",
    "-fvisibility=hidden",
    "-Wall",
    "-Wextra",
    "-Wl,--no-undefined",
    "-Wl,-z,now",
]


class BuildNative(build_ext):
    """Compiles each as a plain shared library (no Python ABI suffix, no libpython)."""

    def get_ext_filename(self, fullname: str) -> str:
        return os.path.join(*fullname.split(".")) + ".so"

    def build_extension(self, ext: Extension) -> None:
        cc = os.environ.get("CC") or "gcc"
        if shutil.which(cc) is None:
            raise SystemExit(
                f"failslow: cannot build {ext.name}: C compiler {cc!r} not found. Install gcc, "
                "or set FAILSLOW_SKIP_NATIVE=1 to install without the native parts."
            )
        out = Path(self.get_ext_fullpath(ext.name))
        out.parent.mkdir(parents=True, exist_ok=True)
        libs = [f"-l{name}" for name in ext.libraries]
        cmd = [cc, *CFLAGS, "-o", str(out), *ext.sources, *libs]
        print("failslow: " + " ".join(cmd))
        subprocess.run(cmd, check=True)


def _ext_modules() -> list[Extension]:
    if os.environ.get("FAILSLOW_SKIP_NATIVE", "") not in ("", "0"):
        print("failslow: FAILSLOW_SKIP_NATIVE set, not building the native parts")
        return []
    return [
        Extension(
            "failslow.nccl_hook.native.libfailslow_nccl", SOURCES, depends=HEADERS, libraries=["dl"]
        ),
        Extension("failslow.core.tracking.native.libfailslow_bocd", [BOCD], libraries=["m"]),
    ]


setup(ext_modules=_ext_modules(), cmdclass={"build_ext": BuildNative})
