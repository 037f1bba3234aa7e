#!/usr/bin/env bash
# Makes the teacher of examples/distill, from the repository root: SFT of qwen3-tiny on reverse_text (a minute or two
# on a laptop CPU), then its reward at temperature 1 (eval.jsonl). Extra arguments go to the SFT run (`--steps 100`).
set -euo pipefail
uv run sft @ examples/distill/teacher.toml "$@"
uv run eval @ examples/distill/eval_teacher.toml
