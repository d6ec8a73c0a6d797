#!/usr/bin/env bash
# Regenerates sim/gpu/attention.ptx from attention.cu with NVRTC from PyPI
# (nvidia-cuda-nvrtc-cu12, pinned: the PTX names its compiler's version) in a
# virtual environment under target/, and fails if it differs from the
# committed file. Skips with a message (exit 0) where the wheel cannot be
# installed (no network, no Python venv).
#
#   scripts/attention-ptx.sh          check
#   scripts/attention-ptx.sh write    regenerate the committed PTX
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$root/target/nvrtc-venv
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import nvidia.cuda_nvrtc' 2>/dev/null; then
    if ! { python3 -m venv "$venv" && "$venv/bin/pip" install -q 'nvidia-cuda-nvrtc-cu12==12.9.86'; } >&2; then
        echo "attention-ptx: SKIPPED: NVRTC (nvidia-cuda-nvrtc-cu12) could not be installed here"
        exit 0
    fi
fi
if [ "${1:-}" = write ]; then
    "$venv/bin/python" "$root/sim/gpu/build_ptx.py"
else
    "$venv/bin/python" "$root/sim/gpu/build_ptx.py" --check
fi
