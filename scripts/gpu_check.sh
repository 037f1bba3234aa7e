#!/usr/bin/env bash
# The GPU evidence kit in one command, no network: scripts/gpu_check.py's parts (pytest -m gpu, the rl quick start
# in bf16 / FP8 / MoE, logprob memory, trainer MFU on Qwen3 shapes, engine decode), JSON lines into
# $OUT/gpu_check.jsonl, a summary at the end.
#   scripts/gpu_check.sh [--cpu] [--out FILE] [--only PART ...]
# On a GPU host, .gpu-wheels/ (made beforehand on a networked machine by scripts/gpu_prepare.py) is installed
# beside the host's own torch (a folder on PYTHONPATH), and arbor runs from src/. With --cpu, or
# with PYTHON set, that interpreter (e.g. the project's .venv) runs it as it is.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cpu=0
for arg in "$@"; do [[ "$arg" == "--cpu" ]] && cpu=1; done
python="${PYTHON:-}"
if [[ -z "$python" && $cpu == 1 && -x "$root/.venv/bin/python" ]]; then
  python="$root/.venv/bin/python"
fi
if [[ -z "$python" ]]; then
  if [[ ! -d "$root/.gpu-wheels" ]]; then
    echo "error: $root/.gpu-wheels is missing: run uv run python scripts/gpu_prepare.py on a networked machine first" >&2
    exit 2
  fi
  # Installed into a folder put first on PYTHONPATH rather than a venv: the host's python3 may itself be a venv
  # (/opt/torch/.venv), and a venv made from it with --system-site-packages would see the base interpreter's
  # packages, not the host's torch.
  site="${TMPDIR:-/tmp}/arbor-gpu-site"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$root"/.gpu-wheels/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  python="$(command -v python3)"
fi
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# The rl launcher and the benchmarks start child interpreters by sys.executable: they see the same packages.
exec "$python" "$root/scripts/gpu_check.py" "$@"
