"""examples/distill end to end: the teacher (qwen3-tiny) is fine-tuned on reverse_text and scored as the example
does, then `rl` serves it beside the student (qwen3-test, from its random initialisation) and distils it with the
pure reverse-KL loss for the example's 40 steps. The student's reverse KL to the teacher (the step's mean k1
estimate; mean of the last 5 steps against the first 3) falls by at least 30%, and its reward (same windows) closes
at least a tenth of its gap to the teacher's without overshooting it.

Each machine's run is deterministic, but float results differ between CPU kernels, so a processor change acts like
a seed change, and the seed matters most through the teacher: its 100 SFT steps sometimes leave the loss plateau
at ~1.65 (seed 0: loss 0.82, reward 0.64) and mostly do not (seeds 1-4: ~1.65, reward 0.26-0.29). A strong
teacher is the hard case: the student (~0.1M parameters) cannot learn the reversal, and its KL levels off near 4.
Measured on a 2-core AMD EPYC without AVX-512, `--seed s --model.init-seed s` on SFT, eval (seed only) and `rl`;
drop = 1 - mean(kl[-5:]) / mean(kl[:3]), reward = mean of the first 3 -> the last 5 steps:

    seed  teacher  kl[0]  first 3  last 5  drop  reward         | at 32 steps, last 3 vs kl[0] (the old test)
    0     0.644    7.61   7.71     3.99    48%   0.017 -> 0.204 | 47%
    1     0.282    6.54   6.53     1.99    69%   0.016 -> 0.212 | 66%
    2     0.258    8.54   8.42     1.73    79%   0.020 -> 0.215 | 77%
    3     0.258   10.02  10.05     1.52    85%   0.014 -> 0.209 | 83%
    4     0.288    8.04   8.09     1.88    77%   0.023 -> 0.216 | 71%

and with seed 0's strong teacher, student seeds 1-4: drop 49%, 51%, 48%, 45%; reward 0.015-0.021 -> 0.168-0.201,
a quarter of the gap to 0.644 (at 32 steps, last 3 vs kl[0]: 39%, 43%, 46%, 43%). An AMD EPYC with AVX-512 fell
6.63 -> 4.52 (32%) at 32 steps, still falling. Hence the full 40 steps (some strong-teacher runs are still
falling at step 32; all level off by 40) and a 30% bound: the worst run here clears it by 15 points, and the
reward's worst (24% of the gap) clears its 10% by 14. A 30% fall (7.6 -> 5.3 nats/token) is far outside the
step-to-step noise of the barely trained student (its first 5 steps stay within 6% of kl[0] on every run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from arbor.monitor.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "distill"
STUDENT_STEPS = 40  # rl.toml's max_steps


def _run(module: str, *args: str) -> None:
    res = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=ROOT, timeout=1500)
    assert res.returncode == 0, f"{module} failed:\n{res.stderr[-3000:]}\n{res.stdout[-2000:]}"


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_distillation_example_cuts_the_reverse_kl_and_moves_the_reward_towards_the_teachers(tmp_path):
    teacher_dir, student_dir = tmp_path / "teacher", tmp_path / "student"
    _run("arbor.trainer.sft", "@", str(EXAMPLE / "teacher.toml"), "--output-dir", str(teacher_dir))
    teacher_model = str(teacher_dir / "sft")
    _run(
        "arbor.eval",
        "@",
        str(EXAMPLE / "eval_teacher.toml"),
        "--output-dir",
        str(teacher_dir),
        "--model.name",
        teacher_model,
    )
    teacher_reward = json.loads((teacher_dir / "eval.jsonl").read_text().splitlines()[-1])["eval/reverse_text/avg@4"]
    _run(
        "arbor.launch.rl",
        "@",
        str(EXAMPLE / "rl.toml"),
        "--output-dir",
        str(student_dir),
        "--teacher.model.name",
        teacher_model,
    )

    rows = read_jsonl(student_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(STUDENT_STEPS))
    kl = [r["distill/reverse_kl"] for r in rows]
    reward = [r["reward/mean"] for r in rows]
    figures = f"reverse KL {kl}, reward {reward}, teacher's reward {teacher_reward}"
    assert kl[0] > 0 and sum(kl[-5:]) / 5 <= 0.7 * sum(kl[:3]) / 3, figures
    start, end = sum(reward[:3]) / 3, sum(reward[-5:]) / 5
    assert end - start >= 0.1 * (teacher_reward - start) > 0, figures
    assert abs(teacher_reward - end) < abs(teacher_reward - start), figures
    assert all(r["time/teacher"] > 0 for r in rows)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_distillation_example_runs_with_the_teachers_top_k(tmp_path):
    """The example's config with `orchestrator.teacher.top_k = 8`, shortened to 3 steps with an untrained
    qwen3-tiny teacher (the wiring, not the learning): every step reports the top-k reverse KL, finite and
    positive, and the student's and the teacher's mass on the teacher's top-8."""
    out = tmp_path / "student"
    _run(
        "arbor.launch.rl",
        "@",
        str(EXAMPLE / "rl.toml"),
        "--output-dir",
        str(out),
        "--teacher.model.name",
        "qwen3-tiny",
        "--orchestrator.teacher.top-k",
        "8",
        "--max-steps",
        "3",
    )
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert 0 < r["distill/reverse_kl"] < 50, r
        assert 0 < r["distill/student_topk_mass"] < 1 and 0 < r["distill/teacher_topk_mass"] <= 1, r
