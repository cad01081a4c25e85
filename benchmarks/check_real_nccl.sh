#!/usr/bin/env bash
# Checks the NCCL shim against the real NCCL (not run in CI; needs network and ~300 MB):
# downloads the nvidia-nccl-cu12 wheel, checks that libnccl.so.2 exports every hooked symbol
# under both names (pncclX and ncclX), and that the shim resolves each through its RTLD_NOLOAD
# path: libnccl is first loaded privately (RTLD_LOCAL, as torch does), then
# failslow_shim_resolve("libnccl.so.2") must find it already loaded and return pnccl for all.
#   benchmarks/check_real_nccl.sh [nvidia-nccl-cu12 version spec, e.g. "==2.27.3"]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
SPEC="nvidia-nccl-cu12${1:-}"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

echo "downloading $SPEC ..."
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$TMP/wheel" "$SPEC"
WHEEL=$(ls "$TMP"/wheel/*.whl)
echo "wheel: $(basename "$WHEEL") ($(du -h "$WHEEL" | cut -f1))"
"$PY" -m zipfile -e "$WHEEL" "$TMP/unpacked"
LIB=$(find "$TMP/unpacked" -name 'libnccl.so.2' | head -1)
[ -n "$LIB" ] || { echo "no libnccl.so.2 in the wheel" >&2; exit 1; }
echo "library: ${LIB#$TMP/unpacked/}"

"$PY" - "$LIB" <<'PYEOF'
import ctypes
import os
import subprocess
import sys

from failslow.nccl_hook.native import HOOKED_SYMBOLS, OPTIONAL_SYMBOLS, shim_path

lib = sys.argv[1]
dyn = subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True, text=True,
                     check=True).stdout
exported = {line.split()[-1] for line in dyn.splitlines() if line.strip()}
version = ctypes.c_int()
nccl = ctypes.CDLL(lib, mode=os.RTLD_LOCAL)  # privately, like torch
nccl.ncclGetVersion(ctypes.byref(version))
print(f"NCCL version code {version.value}")
shim = ctypes.CDLL(str(shim_path()), mode=os.RTLD_LOCAL)
buf = ctypes.create_string_buffer(16384)
# By soname only: succeeds through RTLD_NOLOAD because the library above is already loaded.
os.environ.pop("FAILSLOW_NCCL_LIB", None)
n = shim.failslow_shim_resolve(b"libnccl.so.2", buf, len(buf))
resolved = dict(line.split("\t") for line in buf.value.decode().splitlines())
bad = 0
print(f"{'symbol':28} {'pnccl':6} {'nccl':6} shim")
for name in HOOKED_SYMBOLS:
    p, w = "p" + name in exported, name in exported
    how = resolved.get(name, "?")
    ok = (p and w and how == "pnccl") or (name in OPTIONAL_SYMBOLS and not p and not w
                                          and how == "missing")
    bad += not ok
    print(f"{name:28} {'yes' if p else 'NO':6} {'yes' if w else 'NO':6} {how}"
          f"{'' if ok else '   <-- problem'}")
print(f"shim resolved {n}/{len(HOOKED_SYMBOLS)} through RTLD_NOLOAD; problems: {bad}")
sys.exit(1 if bad or n < 0 else 0)
PYEOF
