#!/usr/bin/env bash
# Builds DeepGEMM (FP8 block-scaled GEMMs: arbor's model.fp8 = "block" on Hopper) and DeepEP (MoE all-to-all:
# trainer.parallel.ep_backend = "deepep") from source into the current venv, against the venv's torch.
#
# Why from source: the package-index uploads of both are source-only and do not build in an isolated
# environment (they import torch at build time and need the CUDA toolkit, CUTLASS submodules and NVSHMEM).
#
# Usage: scripts/install_deep_kernels.sh [--dry-run] [--only deepgemm|deepep] [--deepgemm-ref REF]
#                                        [--deepep-ref REF] [--src DIR] [--arch 9.0] [--no-verify]
# Environment: PYTHON (default: the venv's python, via `uv run python` when no venv is active), CUDA_HOME,
# NVSHMEM_DIR (an NVSHMEM install for DeepEP; default: the nvidia-nvshmem-cu<major> wheel, installed with uv),
# DEEPGEMM_REPO / DEEPEP_REPO (git URLs, e.g. an internal mirror), DEEPGEMM_REF / DEEPEP_REF (commits, as the
# flags), MAX_JOBS (parallel compile jobs).
# --dry-run checks nothing that needs a GPU and changes nothing: it prints the plan.
set -euo pipefail

DEEPGEMM_REPO=${DEEPGEMM_REPO:-https://github.com/deepseek-ai/DeepGEMM.git}
DEEPEP_REPO=${DEEPEP_REPO:-https://github.com/deepseek-ai/DeepEP.git}
# Pinned commits (tested combination: DeepGEMM 2.6.1, DeepEP with SM90 + pip-wheel NVSHMEM support).
DEEPGEMM_REF=${DEEPGEMM_REF:-54e22612409371d6364144b69086735beb54e98b}
DEEPEP_REF=${DEEPEP_REF:-dd758caf451848bd150e1046af3d0a73e5fff38d}
SRC=${TMPDIR:-/tmp}/arbor-deep-kernels
ONLY=""
ARCH=""
DRY_RUN=0
VERIFY=1

usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "install_deep_kernels: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --only) ONLY=${2:?--only needs deepgemm or deepep}; shift ;;
    --deepgemm-ref) DEEPGEMM_REF=${2:?}; shift ;;
    --deepep-ref) DEEPEP_REF=${2:?}; shift ;;
    --src) SRC=${2:?}; shift ;;
    --arch) ARCH=${2:?}; shift ;;
    --no-verify) VERIFY=0 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
  shift
done
case "$ONLY" in ""|deepgemm|deepep) ;; *) die "--only must be deepgemm or deepep, got $ONLY" ;; esac
want() { [ -z "$ONLY" ] || [ "$ONLY" = "$1" ]; }

# Runs a command, or prints it under --dry-run.
run() {
  if [ "$DRY_RUN" = 1 ]; then printf '  would run:'; printf ' %q' "$@"; printf '\n'; else echo "+ $*"; "$@"; fi
}

if [ -n "${PYTHON:-}" ]; then
  PY=("$PYTHON")
elif [ -n "${VIRTUAL_ENV:-}" ]; then
  PY=("$VIRTUAL_ENV/bin/python")
else
  PY=(uv run --no-sync python)
fi

echo "== checks"
TORCH_INFO=$("${PY[@]}" -c 'import sys, torch; print(torch.__version__, torch.version.cuda or "none", sys.executable)' 2>/dev/null) \
  || die "cannot import torch with ${PY[*]}: run from the project (uv sync) or set PYTHON"
read -r TORCH_VERSION TORCH_CUDA PYEXE <<<"$TORCH_INFO"
echo "  torch $TORCH_VERSION, built for CUDA $TORCH_CUDA"
if [ "$TORCH_CUDA" = "none" ]; then
  [ "$DRY_RUN" = 1 ] || die "this torch has no CUDA: DeepGEMM/DeepEP need a CUDA build of torch"
  echo "  (dry run: a CPU-only torch cannot build them; continuing to print the plan)"
  TORCH_CUDA=12.8
fi
CUDA_MAJOR=${TORCH_CUDA%%.*}

NVCC=""
if [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then NVCC="$CUDA_HOME/bin/nvcc"; fi
if [ -z "$NVCC" ] && command -v nvcc >/dev/null 2>&1; then NVCC=$(command -v nvcc); fi
if [ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ]; then NVCC=/usr/local/cuda/bin/nvcc; fi
if [ -n "$NVCC" ]; then
  NVCC_VERSION=$("$NVCC" --version | sed -n 's/.*release \([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p')
  export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$NVCC")")}
  echo "  nvcc $NVCC_VERSION at $NVCC (CUDA_HOME=$CUDA_HOME)"
  # Extensions must be compiled by the CUDA major version torch was built with.
  [ "${NVCC_VERSION%%.*}" = "$CUDA_MAJOR" ] || [ "$DRY_RUN" = 1 ] \
    || die "nvcc is CUDA $NVCC_VERSION but torch was built with CUDA $TORCH_CUDA; load a matching toolkit (module load cuda/$TORCH_CUDA) or set CUDA_HOME"
else
  [ "$DRY_RUN" = 1 ] || die "nvcc not found: install the CUDA $TORCH_CUDA toolkit or set CUDA_HOME"
  echo "  nvcc: not found (needed for a real install)"
fi

if [ -z "$ARCH" ]; then
  ARCH=$("$PYEXE" -c 'import torch
if torch.cuda.is_available():
    print("%d.%d" % torch.cuda.get_device_capability(0))' 2>/dev/null || true)
fi
if [ -z "$ARCH" ]; then
  [ "$DRY_RUN" = 1 ] || die "no visible GPU to read the architecture from: pass --arch 9.0 (Hopper) or 10.0 (Blackwell)"
  ARCH=9.0
  echo "  GPU: none visible (dry run assumes --arch $ARCH)"
else
  echo "  GPU architecture sm_${ARCH/./}"
fi
case "$ARCH" in
  9.0|10.0) ;;
  *) [ "$DRY_RUN" = 1 ] || die "DeepGEMM and DeepEP's kernels need Hopper (9.0) or Blackwell (10.0); this GPU is $ARCH" ;;
esac
export TORCH_CUDA_ARCH_LIST=$ARCH
export MAX_JOBS=${MAX_JOBS:-8}

fetch() {  # fetch NAME URL REF: a clean checkout of REF with its submodules (CUTLASS, fmt)
  local dir="$SRC/$1"
  if [ -d "$dir/.git" ]; then
    run git -C "$dir" fetch --quiet origin
  else
    run git clone --quiet "$2" "$dir"
  fi
  run git -C "$dir" checkout --quiet "$3"
  run git -C "$dir" submodule update --init --recursive --quiet
}

echo "== plan (sources under $SRC)"
run mkdir -p "$SRC"

if want deepgemm; then
  echo "-- DeepGEMM @ $DEEPGEMM_REF"
  fetch DeepGEMM "$DEEPGEMM_REPO" "$DEEPGEMM_REF"
  # No build isolation: the extension must link against this venv's torch, not a fresh one.
  run uv pip install --python "$PYEXE" --no-build-isolation "$SRC/DeepGEMM"
fi

if want deepep; then
  echo "-- DeepEP @ $DEEPEP_REF"
  if [ -n "${NVSHMEM_DIR:-}" ]; then
    echo "  NVSHMEM from NVSHMEM_DIR=$NVSHMEM_DIR"
    [ "$DRY_RUN" = 1 ] || [ -d "$NVSHMEM_DIR/include" ] || die "NVSHMEM_DIR=$NVSHMEM_DIR has no include/ directory"
  else
    # DeepEP's setup finds the pip wheel's nvidia/nvshmem directory through package metadata.
    echo "  NVSHMEM from the nvidia-nvshmem-cu$CUDA_MAJOR wheel (set NVSHMEM_DIR to use a system install)"
    run uv pip install --python "$PYEXE" "nvidia-nvshmem-cu$CUDA_MAJOR"
  fi
  fetch DeepEP "$DEEPEP_REPO" "$DEEPEP_REF"
  run uv pip install --python "$PYEXE" --no-build-isolation "$SRC/DeepEP"
  echo "  multi-node DeepEP also needs GPUDirect RDMA (nvidia-peermem / dma-buf) and IBGDA on the NICs: see DeepEP's README"
fi

if [ "$VERIFY" = 1 ]; then
  echo "== verify"
  if want deepgemm; then
    # An FP8 block-scaled GEMM through arbor's DeepGEMM path against its torch reference.
    run "$PYEXE" -c '
import torch
from arbor.models.fp8 import block_gemm, block_gemm_reference, quantize_blocks, quantize_tiles, select_backend
assert select_backend(torch.device("cuda")) == "deep_gemm", "arbor does not pick DeepGEMM"
x, w = torch.randn(256, 512, device="cuda"), torch.randn(384, 512, device="cuda")
(xq, xs), (wq, ws) = quantize_tiles(x), quantize_blocks(w)
y, ref = block_gemm(xq, xs, wq, ws, "deep_gemm").float(), block_gemm_reference(xq, xs, wq, ws)
err = ((y - ref).norm() / ref.norm()).item()
assert err < 1e-2, err
print("DeepGEMM ok: relative error vs reference %.2e" % err)'
  fi
  if want deepep; then
    # The extension loads (its NVSHMEM and NCCL libraries resolve) and answers a config query; dispatch itself
    # needs 2+ ranks: tests/trainer/test_parallel.py's GPU tests exercise it through trainer.parallel.ep_backend.
    run "$PYEXE" -c '
import deep_ep
config = deep_ep.Buffer.get_dispatch_config(8)
print("DeepEP ok:", type(config).__name__)'
  fi
fi
[ "$DRY_RUN" = 1 ] && echo "dry run: nothing was changed"
exit 0
