#!/usr/bin/env bash
# The GPU check (issue 50) on a machine with CUDA, torch and the frameworks already installed
# (the GPU image: no network). Installs failslow from this working tree without its
# dependencies, builds the NCCL shim and the C++ hook against the machine's torch, carries
# megatron-core from .whl/ when it is there, then runs check.py with the arguments given:
#   benchmarks/gpu/run.sh --quick            # ~5 min; the table is printed last
# Output: $OUT (or runs/gpu-check): table.txt, results.json, check.log, install.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT=${OUT:-runs/gpu-check}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
{
  echo "# $(date -u +%FT%TZ) $(uname -m) $(nproc) cores"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm \
    --format=csv,noheader 2>&1
  "$PY" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)'
} > "$OUT/install.log" 2>&1
cat "$OUT/install.log"
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/fs-site .whl/*.whl >> "$OUT/install.log" 2>&1 \
    && export PYTHONPATH=/tmp/fs-site${PYTHONPATH:+:$PYTHONPATH}
fi
# failslow itself, with the shim (setup.py compiles it with gcc); its dependencies are there
if ! "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . >> "$OUT/install.log" 2>&1; then
  echo "run.sh: pip could not install the tree (see install.log); building the shim by hand" \
    "and running from src/" | tee -a "$OUT/install.log"
  N=src/failslow/nccl_hook/native
  gcc -O2 -fPIC -shared -pthread -fvisibility=hidden -Wall -Wextra -Wl,--no-undefined -Wl,-z,now \
    -o $N/libfailslow_nccl.so $N/shim.c $N/writer.c $N/comms.c $N/device.c -ldl \
    >> "$OUT/install.log" 2>&1 || echo "run.sh: the shim did not build" | tee -a "$OUT/install.log"
  gcc -O2 -fPIC -shared -o src/failslow/core/tracking/native/libfailslow_bocd.so \
    src/failslow/core/tracking/native/bocd.c -lm >> "$OUT/install.log" 2>&1
  export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
fi
# the C++ hook, against this torch (torch's cpp_extension + ninja), built beside rows 1-2;
# the rows that time it wait for it
export FAILSLOW_GPU_HOOK_DONE=/tmp/fs-gpu-hook.done
rm -f "$FAILSLOW_GPU_HOOK_DONE"
("$PY" -m failslow.cli build-hook >> "$OUT/install.log" 2>&1 \
  || echo "run.sh: build-hook failed (see install.log)" >> "$OUT/install.log"
  touch "$FAILSLOW_GPU_HOOK_DONE") &
tail -n 2 "$OUT/install.log"
"$PY" benchmarks/gpu/check.py --out "$OUT" "$@"
status=$?
wait
exit $status
