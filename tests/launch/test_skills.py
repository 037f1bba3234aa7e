"""skills/: every SKILL.md is well-formed, and every command block tagged `bash runnable` runs on CPU and exits 0.

Blocks of one skill run in order, from the repository root, under `bash -euo pipefail`, with `$OUT` a fresh
temporary directory shared by that skill's blocks.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKILLS = sorted((ROOT / "skills").glob("*/SKILL.md"))
FENCE = re.compile(r"^```bash runnable\n(.*?)^```$", re.S | re.M)
TOPICS = {
    "install",
    "configure-run",
    "run-and-monitor",
    "add-environment",
    "add-loss-or-advantage",
    "debug-hang-or-reward-collapse",
    "submit-to-slurm",
}


def runnable_blocks(path: Path) -> list[str]:
    return FENCE.findall(path.read_text())


def test_every_topic_has_a_skill_with_front_matter_and_a_runnable_block():
    assert {p.parent.name for p in SKILLS} >= TOPICS
    for path in SKILLS:
        text = path.read_text()
        front = re.match(r"^---\nname: (\S+)\ndescription: (.+?)\n---\n", text)
        assert front, f"{path}: front matter with name and description"
        assert runnable_blocks(path), f"{path}: no runnable block"


def test_fence_parser_finds_only_runnable_blocks():
    text = "```bash\nnot run\n```\n```bash runnable\necho a\necho b\n```\n"
    path = ROOT / "skills" / "README.md"
    assert FENCE.findall(text) == ["echo a\necho b\n"]
    assert not FENCE.findall(path.read_text())  # the README describes the tag without using it


@pytest.mark.slow
@pytest.mark.parametrize("skill", SKILLS, ids=lambda p: p.parent.name)
def test_runnable_commands(skill, tmp_path):
    assert shutil.which("uv"), "uv must be on PATH: the skills' commands use `uv run`"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARBOR_")}
    env["OUT"] = str(tmp_path)
    for i, block in enumerate(runnable_blocks(skill)):
        res = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
        )
        assert res.returncode == 0, (
            f"{skill.parent.name} block {i}:\n{block}\n--- stdout\n{res.stdout[-3000:]}\n--- "
            f"stderr\n{res.stderr[-3000:]}"
        )
