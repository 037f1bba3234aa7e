"""SLURM submission: renders `slurm/*.sbatch` from the `[slurm]` table into `<output_dir>/rl.sbatch`, then `sbatch`.

Single node: the job runs `rl` again on the allocated node with the job config (`configs/slurm_job.toml`: what
the user set, minus the `[slurm]` table, so the inner `rl` runs the processes instead of submitting again) and
that `rl` supervises every process as on a workstation, preflight checks and watchdog included.
Multi-node: the job starts each process itself with `srun` (inference nodes first, then a torchrun rendezvous
across the trainer nodes, the orchestrator beside trainer rank 0) from the resolved per-process configs.
Departure from the design: there is no separate router process; the orchestrator's client rotates requests over
every inference node's URL, which is what a router in front of them would do.
The job uses the launcher's own interpreter (`sys.executable`, the project's virtual environment) from the
project directory, so nothing is downloaded on the node; with a container image, the container's `python`.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from string import Template

from tomli_w import dumps

from arbor.config.loader import ConfigError
from arbor.config.rl import SECTIONS, SHARED, RLConfig
from arbor.run_dir import configs_dir, logs_dir, metrics_path

PROJECT = Path(__file__).resolve().parents[3]


class _Template(Template):
    delimiter = "@@"  # `$` is bash's and `%` is sbatch's


def template_dir() -> Path:
    for d in (PROJECT / "slurm", Path(__file__).resolve().parents[1] / "slurm_templates"):
        if (d / "single_node.sbatch").exists():
            return d
    raise FileNotFoundError("arbor's slurm/ templates are missing from this installation")


def job_config(cfg: RLConfig) -> dict:
    """What the user set (not what the launcher derived: ports are picked again on the node), minus [slurm]."""
    data = cfg.model_dump(mode="json", exclude_unset=True)
    for key in ("slurm", "dry_run"):
        data.pop(key, None)
    data["output_dir"] = str(cfg.output_dir.resolve())
    for section in SECTIONS:  # shared fields are pushed down again on the node (where output_dir may differ)
        for key in SHARED:
            (data.get(section) or {}).pop(key, None)
    return _drop_none({k: v for k, v in data.items() if v != {}})


def _drop_none(v):
    if isinstance(v, dict):
        return {k: _drop_none(x) for k, x in v.items() if x is not None}
    return v


def render(cfg: RLConfig, project: Path = PROJECT, python: str = sys.executable) -> str:
    s = cfg.slurm
    assert s is not None
    out = cfg.output_dir.resolve()
    lines = [
        f"#SBATCH --partition={s.partition}" if s.partition else "",
        f"#SBATCH --account={s.account}" if s.account else "",
        f"#SBATCH --gpus-per-node={s.gpus_per_node}" if s.gpus_per_node else "",
        f"#SBATCH --cpus-per-task={s.cpus_per_node}" if s.cpus_per_node else "",
        f"#SBATCH --mem={s.mem}" if s.mem else "",
        *(f"#SBATCH {x}" for x in s.extra_sbatch),
    ]
    srun_opts = ""
    if s.container_image:
        srun_opts = (
            f"--container-image={shlex.quote(s.container_image)} --container-workdir={shlex.quote(str(project))}"
        )
        if s.container_mounts:
            srun_opts += f" --container-mounts={shlex.quote(s.container_mounts)}"
        python = "python"
    q = shlex.quote
    values = dict(
        job_name=q(s.job_name),
        time=s.time,
        log_file=str(logs_dir(out) / "slurm-%j.out"),
        sbatch_lines="\n".join(x for x in lines if x),
        script=q(str(out / "rl.sbatch")),
        setup="\n".join(s.setup),
        project=q(str(project)),
        output_dir=q(str(out)),
        python=q(python) if python != "python" else python,
        srun_opts=srun_opts,
    )
    if s.inference_nodes == 0:
        local = (
            ""
            if s.shared_fs
            else (
                'run_dir="${TMPDIR:-/tmp}/arbor-$SLURM_JOB_ID"\n'
                f"trap 'mkdir -p {q(str(out))} && cp -a \"$run_dir/.\" {q(str(out))}/' EXIT  # node-local run, "
                f"copied back"
            )
        )
        values.update(
            local_dir=local,
            job_config=q(str(configs_dir(out) / "slurm_job.toml")),
            launch=f"srun --ntasks=1 {srun_opts}" if s.container_image else "exec",
        )
        return _Template((template_dir() / "single_node.sbatch").read_text()).substitute(values)
    nproc = cfg.trainer.parallel.nproc
    if s.gpus_per_node and nproc != s.gpus_per_node:
        raise ConfigError(
            f"trainer.parallel.nproc ({nproc}) must equal slurm.gpus_per_node ({s.gpus_per_node}) in the "
            f"multi-node layout"
        )
    values.update(
        nodes=s.nodes,
        inference_nodes=s.inference_nodes,
        trainer_nodes=s.trainer_nodes,
        nproc=nproc,
        # the orchestrator splits each batch over the data-parallel ranks: context-parallel ranks share rows
        world=nproc * s.trainer_nodes // cfg.trainer.parallel.cp,
        inference_port=s.inference_port,
        rdzv_port=s.rdzv_port,
        sft_steps=cfg.sft.steps,
        startup_timeout=int(cfg.inference_startup_timeout),
    )
    return _Template((template_dir() / "multi_node.sbatch").read_text()).substitute(values)


def submit(cfg: RLConfig, dry_run: bool) -> int:
    """Writes `<output_dir>/rl.sbatch` (and the job config); unless `dry_run`, submits it and prints the job id."""
    out = cfg.output_dir.resolve()
    logs_dir(out).mkdir(parents=True, exist_ok=True)  # sbatch cannot create the --output directory
    configs_dir(out).mkdir(parents=True, exist_ok=True)
    (configs_dir(out) / "slurm_job.toml").write_text(dumps(job_config(cfg)))
    script = out / "rl.sbatch"
    script.write_text(render(cfg))
    script.chmod(0o755)
    if dry_run:
        print(f"wrote {script} (not submitted: --dry-run)")
        return 0
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise ConfigError(
            "slurm: sbatch is not on PATH; run on a SLURM login node, or pass --dry-run to only write the script"
        )
    res = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True)
    if res.returncode != 0:
        raise ConfigError(f"sbatch failed: {res.stderr.strip() or res.stdout.strip()}")
    job_id = res.stdout.strip().split(";")[0]
    print(f"submitted SLURM job {job_id}: {script}")
    print(
        f"logs: {logs_dir(out) / f'slurm-{job_id}.out'} (scheduler), {logs_dir(out)}/*.log (processes); metrics: "
        f"{metrics_path(out)}"
    )
    return 0
