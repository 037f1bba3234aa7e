#!/usr/bin/env bash
# Writes the example's tiny random Qwen2.5-VL and its processor (no download) once, at outputs/tiny-vl.
set -euo pipefail
cd "$(dirname "$0")/../.."
uv run python -m arbor.models.vision_tiny outputs/tiny-vl
