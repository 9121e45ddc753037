#!/usr/bin/env bash
# Install the peer systems used by benchmarks/peers: Open MPI + mpi4py, and
# PyTorch (CPU, gloo backend). Idempotent: re-running skips what is present.
#
#   bash benchmarks/peers/install.sh
#
# Needs root (apt-get). Other processes may be using apt at the same time, so
# apt waits up to 10 minutes for the dpkg lock instead of failing.
set -euo pipefail

APT_OPTS=(-o DPkg::Lock::Timeout=600)
if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then
    SUDO=sudo
else
    SUDO=
fi

# --- Open MPI ---------------------------------------------------------------
if command -v mpirun >/dev/null 2>&1 && dpkg -s libopenmpi-dev >/dev/null 2>&1; then
    echo "[install] openmpi already installed: $(mpirun --version 2>/dev/null | head -n1)"
else
    # (capture first: 'cmd | grep -q' under pipefail can fail on SIGPIPE)
    policy="$(apt-cache policy openmpi-bin 2>/dev/null || true)"
    if ! grep -q 'Candidate: [0-9]' <<<"$policy"; then
        echo "[install] no apt candidate for openmpi-bin; running apt-get update"
        $SUDO apt-get "${APT_OPTS[@]}" update
    fi
    echo "[install] installing openmpi-bin libopenmpi-dev"
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get "${APT_OPTS[@]}" install -y openmpi-bin libopenmpi-dev
fi

PY="${PYTHON:-python}"

# --- mpi4py -----------------------------------------------------------------
if "$PY" -c 'import mpi4py' >/dev/null 2>&1; then
    echo "[install] mpi4py already installed: $("$PY" -c 'import mpi4py; print(mpi4py.__version__)')"
else
    echo "[install] pip install mpi4py"
    "$PY" -m pip install mpi4py
fi

# --- torch (CPU build, exact pin) -------------------------------------------
# torch==2.13.0 exactly: a CPU wheel of that version lies on this machine's
# disk and pip takes it. Any other version (or an unpinned 'torch') pulls a
# multi-GB CUDA build from the network -- do not change this pin casually.
TORCH_VERSION=2.13.0
have_torch="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)"
if [ "${have_torch%%+*}" = "$TORCH_VERSION" ]; then
    echo "[install] torch already installed: $have_torch"
else
    echo "[install] pip install torch==$TORCH_VERSION (found: ${have_torch:-none})"
    "$PY" -m pip install "torch==$TORCH_VERSION"
fi

echo "[install] done"
