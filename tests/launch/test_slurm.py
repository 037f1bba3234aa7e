"""SLURM: the rendered sbatch scripts, and a real submission to a one-node cluster (`.ci/slurm-up.sh`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest

from arbor.monitor.metrics import read_jsonl

pytestmark = pytest.mark.slow

TINY = [
    "--model.name",
    "qwen3-test",
    "--seq-len",
    "48",
    "--orchestrator.batch-size",
    "8",
    "--orchestrator.group-size",
    "4",
    "--orchestrator.sampling.max-tokens",
    "8",
    "--orchestrator.environment.args",
    "{ min_len = 2, max_len = 5, num_tasks = 50 }",
    "--trainer.num-threads",
    "1",
    "--inference.num-threads",
    "1",
    "--inference.max-batch-size",
    "16",
]


def _rl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "arbor.launch.rl", *args], capture_output=True, text=True, timeout=120)


def test_dry_run_writes_single_node_script_without_submitting(tmp_path):
    out = tmp_path / "run"
    res = _rl(
        "--output-dir",
        str(out),
        *TINY,
        "--slurm.partition",
        "gpu",
        "--slurm.account",
        "proj",
        "--slurm.gpus-per-node",
        "8",
        "--slurm.shared-fs",
        "false",
        "--dry-run",
    )
    assert res.returncode == 0, res.stderr
    script = (out / "rl.sbatch").read_text()
    assert "#SBATCH --partition=gpu" in script and "#SBATCH --account=proj" in script
    assert "#SBATCH --gpus-per-node=8" in script and "--nodes=1" in script
    assert f"{sys.executable} -m arbor.launch.rl @ {out}/configs/slurm_job.toml" in script
    assert "cp -a" in script  # node-local run directory copied back
    assert "[slurm]" not in (out / "configs" / "slurm_job.toml").read_text()
    assert subprocess.run(["bash", "-n", str(out / "rl.sbatch")]).returncode == 0
    assert not (out / "metrics.jsonl").exists()


def test_multi_node_script_places_inference_trainer_and_orchestrator(tmp_path):
    out = tmp_path / "run"
    res = _rl(
        "--output-dir",
        str(out),
        *TINY,
        "--slurm.inference-nodes",
        "2",
        "--slurm.trainer-nodes",
        "2",
        "--slurm.gpus-per-node",
        "4",
        "--trainer.parallel.nproc",
        "4",
        "--slurm.container-image",
        "nvcr.io/nvidia/pytorch:25.01-py3",
        "--dry-run",
    )
    assert res.returncode == 0, res.stderr
    script = (out / "rl.sbatch").read_text()
    assert "#SBATCH --nodes=4" in script
    assert 'inference_nodes=("${nodes[@]:0:2}")' in script and 'trainer_nodes=("${nodes[@]:2:2}")' in script
    assert "--nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d" in script
    assert '--rdzv-endpoint="${trainer_nodes[0]}:29500"' in script
    assert (
        "--batching.trainer-ranks 8" in script and '--overlap --nodes=1 --ntasks=1 -w "${trainer_nodes[0]}"' in script
    )
    assert "--container-image=nvcr.io/nvidia/pytorch:25.01-py3" in script
    assert subprocess.run(["bash", "-n", str(out / "rl.sbatch")]).returncode == 0
    assert (out / "configs" / "trainer.toml").exists() and (out / "configs" / "orchestrator.toml").exists()


def test_multi_node_script_hands_a_job_token_to_the_servers_it_binds_on_0000(tmp_path):
    out = tmp_path / "run"
    res = _rl("--output-dir", str(out), *TINY, "--slurm.inference-nodes", "1", "--dry-run")
    assert res.returncode == 0, res.stderr
    script = (out / "rl.sbatch").read_text()
    lines = script.splitlines()
    token_line = next(line for line in lines if line.startswith("admin_token="))
    server = next(i for i, line in enumerate(lines) if "arbor.inference.server" in line)
    orchestrator = next(i for i, line in enumerate(lines) if "arbor.orchestrator.main" in line)
    assert "--host 0.0.0.0" in lines[server + 1]
    assert lines[server - 1].strip().startswith('ARBOR_ADMIN_TOKEN="$admin_token" srun ')
    assert lines[orchestrator - 1].startswith('ARBOR_CLIENT__ADMIN_TOKEN="$admin_token" srun ')
    assert lines.index(token_line) < server  # generated after the ARBOR_ variables are cleared, before use
    assert lines.index(token_line) > next(i for i, line in enumerate(lines) if "unset" in line)
    token = subprocess.run(["bash", "-c", f'{token_line}; printf %s "$admin_token"'], capture_output=True, text=True)
    assert len(token.stdout) == 64 and token.stdout not in script  # 256 bits, made when the job runs
    assert subprocess.run(["bash", "-n", str(out / "rl.sbatch")]).returncode == 0


def test_bad_slurm_layout_is_one_line():
    res = _rl("--slurm.trainer-nodes", "2", "--dry-run")
    assert res.returncode != 0 and "inference_nodes" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def _slurm_unavailable() -> str | None:
    if not (shutil.which("sbatch") and shutil.which("sinfo")):
        return "sbatch/sinfo not on PATH (run .ci/slurm-up.sh as root to install a one-node cluster)"
    states = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True).stdout.split()
    if not any(s in ("idle", "mixed") for s in states):
        return f"no SLURM node is up (sinfo: {states or 'nothing'}; run .ci/slurm-up.sh)"
    return None


@pytest.mark.slow
def test_rl_run_submitted_through_sbatch_writes_metrics(tmp_path):
    reason = _slurm_unavailable()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "run"
    res = _rl(
        "--output-dir", str(out), *TINY, "--max-steps", "2", "--slurm.job-name", "arbor-test", "--slurm.time", "10:00"
    )
    assert res.returncode == 0, res.stderr
    job = res.stdout.split("submitted SLURM job ")[1].split(":")[0]
    assert job.isdigit(), res.stdout
    deadline = time.monotonic() + 400
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job])
            pytest.fail(f"job {job} did not finish; log: {(out / 'logs' / f'slurm-{job}.out').read_text()}")
        time.sleep(2)
    log = (out / "logs" / f"slurm-{job}.out").read_text()
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [0, 1], log
    assert "arbor: job" in log and "step    2/2" in log
    assert (out / "logs" / "trainer.log").exists() and (out / "logs" / "inference.log").exists()
