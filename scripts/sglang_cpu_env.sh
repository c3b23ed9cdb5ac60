#!/usr/bin/env bash
# Build, from nothing, the environment in which the live SGLang tests run on a CPU (tests marked live_sglang):
#   bash scripts/sglang_cpu_env.sh VENV && VENV/bin/python -m pytest -m live_sglang
# Lean route: torch 2.14.1 + torchvision 0.29.1 (sglang imports torchvision at start-up, and PyPI's torchvision does
# not load beside torch 2.13.0+cpu), sglang without its dependencies, then its requirements minus the CUDA-only ones.
# The two test-only stand-ins in tests/live_sglang/stubs/ go on this venv's path alone (a .pth file), never into
# the installed package.
set -euo pipefail
VENV=${1:?usage: bash scripts/sglang_cpu_env.sh VENV}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
SGLANG=0.5.23

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" "torch==2.14.1" "torchvision==0.29.1" packaging
"${PIP[@]}" --no-deps "sglang==$SGLANG"

# sglang's own requirements (no extras), without torch's pins (kept above) and the CUDA-only kernels.
"$VENV/bin/python" - "$VENV/sglang-cpu-reqs.txt" <<'PYEOF'
import re
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

CUDA_ONLY = re.compile(r"^(sgl-kernel|sglang-kernel|flashinfer.*|flash-attn.*|nvidia-(?!ml-py).*|cuda-.*|nvshmem.*|"
                       r"sgl-deep-.*|sgl-flash-mla|humming-kernels|quack-kernels|tilelang|apache-tvm-ffi|"
                       r"torch-memory-saver|torch|torchvision|torchaudio|triton|xformers|decord.*)$")
keep = []
for line in requires("sglang") or []:
    req = Requirement(line)
    if req.marker is not None and "extra" in str(req.marker):
        continue
    if req.marker is not None and not req.marker.evaluate():
        continue
    if CUDA_ONLY.match(req.name.lower().replace("_", "-")):
        print("left out (CUDA-only or pinned above):", line)
        continue
    keep.append(line)
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
PYEOF
"${PIP[@]}" -r "$VENV/sglang-cpu-reqs.txt"
"${PIP[@]}" -e "$ROOT[test]"

# The stand-ins: first on the path, in this venv only.
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$ROOT/tests/live_sglang/stubs" > "$SITE/00-lit-rlvr-sglang-cpu-stubs.pth"
"$VENV/bin/python" -c "import sglang, sgl_kernel; print('sglang', sglang.__version__, 'imports; stand-in:', sgl_kernel.__file__)"
