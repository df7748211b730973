#!/usr/bin/env bash
# Installs torch into the given interpreter's environment only when it has none, and never a CUDA build on a
# machine without an NVIDIA driver. An existing torch (the user's, or one seen through --system-site-packages)
# is kept as it is.
set -euo pipefail
py="$1"
if "$py" -c "import torch" 2>/dev/null; then
  echo "install_torch: keeping $("$py" -c 'import torch; print(torch.__version__)')"
  exit 0
fi
version="${RANKWATCH_TORCH_VERSION:-2.13.0}"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "$py" -m pip install "torch==$version"
elif [ -n "${RANKWATCH_TORCH_CPU_INDEX:-}" ]; then
  "$py" -m pip install "torch==$version" --index-url "$RANKWATCH_TORCH_CPU_INDEX"
else
  # only a CPU wheel that lies on this machine (pip's find-links): never fall through to the index,
  # whose linux wheels are CUDA builds
  probe=$(mktemp -d)
  if "$py" -m pip download -q --no-deps --no-index -d "$probe" "torch==$version" >/dev/null 2>&1; then
    "$py" -m pip install "$probe"/torch-*.whl
    rm -rf "$probe"
  else
    echo "install_torch: no local CPU wheel of torch==$version; set RANKWATCH_TORCH_CPU_INDEX to a CPU wheel index" >&2
    echo "install_torch: or install torch yourself first (an existing torch is kept)" >&2
    exit 1
  fi
fi
