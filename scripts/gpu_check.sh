#!/usr/bin/env bash
# The GPU evidence kit in one command, no network: scripts/gpu_check.py's parts (pytest -m gpu, the rl quick start
# in bf16 / FP8 / MoE, logprob memory, trainer MFU on Qwen3 shapes, engine decode), JSON lines into
# $OUT/gpu_check.jsonl, a summary at the end.
#   scripts/gpu_check.sh [--cpu] [--out FILE] [--only PART ...]
# On a GPU host, .gpu-wheels/ (made beforehand on a networked machine by scripts/gpu_prepare.py) is installed
# into a venv that sees the host's own torch (--system-site-packages), and arbor runs from src/. With --cpu, or
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
    echo "error: $root/.gpu-wheels is missing: run scripts/gpu_prepare.py on a networked machine first" >&2
    exit 2
  fi
  venv="${TMPDIR:-/tmp}/arbor-gpu-venv"
  python3 -m venv --system-site-packages "$venv"
  "$venv/bin/python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$root"/.gpu-wheels/*.whl
  python="$venv/bin/python"
fi
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# The rl launcher and the benchmarks start child interpreters by sys.executable: they see the same packages.
exec "$python" "$root/scripts/gpu_check.py" "$@"
