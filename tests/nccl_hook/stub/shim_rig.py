"""Builds the NCCL shim test rig with gcc: stub libnccl.so.2, consumer library, driver, shim.

Shared by tests/nccl_hook/test_shim.py and benchmarks/shim_overhead.py. The shim is compiled
from the package's sources with the flags of setup.py, so the tests exercise the current code
even in an editable checkout whose installed copy is older.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
NATIVE = HERE.parents[2] / "src" / "failslow" / "nccl_hook" / "native"
SHIM_SOURCES = ("shim.c", "writer.c", "comms.c", "device.c")
SHIM_FLAGS = (
    "-O2",
    "-fPIC",
    "-shared",
    "-pthread",
    "-fvisibility=hidden",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wl,--no-undefined",
)


def have_gcc() -> bool:
    return shutil.which("gcc") is not None


@dataclass(frozen=True)
class Rig:
    directory: Path
    shim: Path
    stub: Path
    consumer: Path
    driver: Path


def _gcc(*args: str | Path) -> None:
    out = subprocess.run(["gcc", *map(str, args)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"gcc {' '.join(map(str, args))} failed:\n{out.stderr}")


def build_shim(out: Path) -> Path:
    lib = out / "libfailslow_nccl.so"
    _gcc(*SHIM_FLAGS, "-o", lib, *(NATIVE / s for s in SHIM_SOURCES), "-ldl")
    return lib


def build_cudart(out: Path) -> Path:
    """A stand-in ``libcudart.so.13`` (``cudart_stub.c``) for device timing without CUDA."""
    lib = out / "libcudart.so.13"
    _gcc("-O2", "-fPIC", "-shared", "-Wall", "-Wl,-soname,libcudart.so.13", "-o", lib,
         HERE / "cudart_stub.c")  # fmt: skip
    return lib


def build_rig(out: Path, *, old: bool = False, shim: Path | None = None) -> Rig:
    """Stub NCCL (``old``: without the newer entry points), consumer, driver and shim."""
    out.mkdir(parents=True, exist_ok=True)
    define = ["-DSTUB_OLD"] if old else []
    stub = out / "libnccl.so.2"
    _gcc(
        "-O2",
        "-fPIC",
        "-shared",
        "-Wall",
        *define,
        "-Wl,-soname,libnccl.so.2",
        "-o",
        stub,
        HERE / "nccl_stub.c",
    )
    consumer = out / "libconsumer.so"
    _gcc(
        "-O2",
        "-fPIC",
        "-shared",
        "-Wall",
        *define,
        "-o",
        consumer,
        HERE / "consumer.c",
        f"-L{out}",
        "-l:libnccl.so.2",
        "-Wl,-rpath,$ORIGIN",
        "-pthread",
        "-ldl",
    )
    driver = out / "driver"
    _gcc("-O2", "-Wall", "-o", driver, HERE / "driver.c", "-ldl")
    return Rig(out, shim or build_shim(out), stub, consumer, driver)


def clean_env(**extra: str | os.PathLike[str]) -> dict[str, str]:
    """The current environment without FAILSLOW_*, NCCL_* or rank variables, plus ``extra``."""
    drop = ("FAILSLOW_", "NCCL_", "STUB_")
    ranks = {
        "RANK",
        "LOCAL_RANK",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "SLURM_PROCID",
        "SLURM_LOCALID",
        "LD_PRELOAD",
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop) and k not in ranks}
    env.update({k: str(v) for k, v in extra.items()})
    return env
