"""The GPU evidence kit: every GPU figure arbor reports, in one bounded run (`scripts/gpu_check.sh` calls this).

Each part runs as a child process under its own time limit; a part that fails or times out is recorded and the
next one still runs. Every part's outcome is one JSON line in `--out` (default `$OUT/gpu_check.jsonl`, else
`outputs/gpu_check/gpu_check.jsonl`): `{"part", "ok", "rc", "seconds", "result" | "error"}`, where `result` is the
benchmark's last-line JSON or a run's figures (mismatch KL). A summary table closes the output. `--cpu` runs the
same parts at tiny sizes on the CPU (CI runs it so that the kit cannot rot between GPU windows); on a GPU host
the parts together fit in about 8 minutes of one H100 or H200. docs/gpu.md records what it measured.

    python scripts/gpu_check.py [--cpu] [--out FILE] [--only PART ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
RL_QUICK_START = ["-m", "arbor.launch.rl", "@", "examples/reverse_text/rl.toml", "--sft.steps", "0"]
RL_MOE = ["-m", "arbor.launch.rl", "@", "examples/moe_reverse_text/rl.toml", "--sft.steps", "0"]
# One GPU: one trainer rank, so the MoE example's experts are not split across ranks (ep = 1, grouped_mm experts).
MOE_ONE_RANK = ["--trainer.parallel.nproc", "1", "--trainer.parallel.ep", "1", "--trainer.parallel.backend", "auto"]


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    argv: list[str]
    """Arguments to the Python interpreter."""
    timeout: int
    """Seconds before the part is killed and recorded as timed out."""
    run_dir: bool = False
    """An `rl` run: `--output-dir` is added and its trainer's mismatch KL read back."""


def gpu_test_files() -> list[str]:
    """The test modules holding tests marked `gpu` (only those are collected: other modules may need dev
    dependencies a GPU host lacks)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if "mark.gpu" in p.read_text())


def parts(cpu: bool) -> list[Part]:
    """The kit's parts, in order; `cpu` shrinks each to a tiny shape on the CPU."""
    # --cpu: one step of 16 samples (2 prompts x 8) rather than the examples' 128, the rest of the path the same
    steps = ["--max-steps", "1", "--orchestrator.batch-size", "16"] if cpu else ["--max-steps", "4"]
    bench = ["--smoke"] if cpu else ["--device", "cuda"]
    files = gpu_test_files()[:1] if cpu else gpu_test_files()
    dtype = "float32" if cpu else "bfloat16"
    slow = 3 if cpu else 1  # a shared CI core takes minutes over what a GPU host does in seconds
    return [
        Part("pytest_gpu", ["-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *files], 150 * slow),
        Part("rl_bf16", [*RL_QUICK_START, *steps, "--model.dtype", dtype], 120 * slow, run_dir=True),
        Part(
            "rl_fp8",
            [*RL_QUICK_START, *steps, "--model.dtype", dtype, "--model.fp8", "block"],
            120 * slow,
            run_dir=True,
        ),
        Part("rl_moe", [*RL_MOE, *steps, "--model.dtype", dtype, *MOE_ONE_RANK], 120 * slow, run_dir=True),
        Part("logprobs_memory", [str(BENCH / "logprobs_memory.py"), *bench], 90 * slow),
        Part("mfu_0.6b", [str(BENCH / "mfu.py"), *bench, "--shape", "tiny" if cpu else "qwen3-0.6b"], 120 * slow),
        Part("mfu_4b", [str(BENCH / "mfu.py"), *bench, "--shape", "tiny" if cpu else "qwen3-4b"], 120 * slow),
        Part(
            "mfu_30b_a3b",
            [str(BENCH / "mfu.py"), *bench, "--shape", "tiny-moe" if cpu else "qwen3-30b-a3b"],
            150 * slow,
        ),
        Part("decode_0.6b", [str(BENCH / "decode.py"), *bench, *([] if cpu else ["--shape", "qwen3-0.6b"])], 90 * slow),
    ]


def last_json(text: str) -> dict | None:
    """The last line of `text` that is a JSON object (a benchmark's result), else None."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def run_figures(run: Path) -> dict:
    """An `rl` run's trainer figures: steps trained and mismatch KL per step (metrics/trainer.jsonl)."""
    path = run / "metrics" / "trainer.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return {"steps": len(rows), "mismatch_kl": [r.get("mismatch_kl") for r in rows]}


def run_part(part: Part, work: Path, log: Path, seconds_left: float) -> dict:
    """Runs one part to completion or its time limit (its own, or what is left of the kit's budget); its output
    is appended to `log`, its run directory (an `rl` part's) made under `work`."""
    limit = min(part.timeout, int(seconds_left))
    if limit < 10:
        return {"part": part.name, "ok": False, "rc": "skipped", "seconds": 0.0, "error": "no time left in --budget"}
    argv = [sys.executable, *part.argv]
    run = work / part.name
    if part.run_dir:
        argv += ["--output-dir", str(run)]
    t = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = "timeout", _text(e.stdout), _text(e.stderr) + f"\n[killed after {limit} s]"
    with log.open("a") as f:
        f.write(f"=== {part.name}: $ {' '.join(argv)}\n{out}\n--- stderr ---\n{err}\n")
    record = {"part": part.name, "ok": rc == 0, "rc": rc, "seconds": round(time.perf_counter() - t, 1)}
    if part.run_dir:
        record["result"] = run_figures(run)
        record["ok"] = rc == 0 and record["result"]["steps"] > 0
    elif part.argv[0] == "-m":  # pytest: its summary line
        record["result"] = {"summary": (out.strip().splitlines() or [""])[-1]}
    else:
        record["result"] = last_json(out)
        record["ok"] = rc == 0 and record["result"] is not None
    if not record["ok"]:
        record["error"] = (err.strip() or out.strip())[-1500:]
    return record


def _text(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def host() -> dict:
    """What the figures ran on (a child process: this one never imports torch)."""
    code = (
        "import json, torch; c = torch.cuda.is_available(); print(json.dumps({'torch': torch.__version__, "
        "'gpu': torch.cuda.get_device_name(0) if c else None, 'gpus': torch.cuda.device_count()}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    return {**(last_json(out) or {}), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def summary(records: list[dict]) -> str:
    lines = [f"{'part':<18} {'ok':<5} {'seconds':>8}  figure"]
    for r in records:
        res = r.get("result") or {}
        fig = {k: res[k] for k in ("tokens_per_s", "mfu", "value", "mismatch_kl", "summary", "steps") if k in res}
        lines.append(f"{r['part']:<18} {str(r['ok']):<5} {r['seconds']:>8}  {json.dumps(fig)[:100]}")
    failed = [r["part"] for r in records if not r["ok"]]
    lines.append(f"{len(records) - len(failed)}/{len(records)} parts ok" + (f"; failed: {failed}" if failed else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU (what CI runs)")
    default_out = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "outputs" / "gpu_check"
    p.add_argument("--out", type=Path, default=default_out / "gpu_check.jsonl", help="the JSON-lines file")
    p.add_argument("--only", nargs="+", default=None, help="run these parts alone (names as in the summary)")
    p.add_argument(
        "--budget", type=float, default=None, help="seconds for all parts together (default 480; --cpu: 1800)"
    )
    a = p.parse_args(argv)
    chosen = [x for x in parts(a.cpu) if a.only is None or x.name in a.only]
    unknown = set(a.only or ()) - {x.name for x in parts(a.cpu)}
    if unknown:
        p.error(f"--only names unknown parts: {sorted(unknown)}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    log = a.out.with_suffix(".log")  # every part's output, beside the figures
    records: list[dict] = []
    end = time.monotonic() + (a.budget or (1800.0 if a.cpu else 480.0))  # a shared CPU box is slow
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp, a.out.open("a") as out:
        head = {"part": "host", "ok": True, "cpu_mode": a.cpu, "result": host(), "seconds": 0.0}
        results = (run_part(x, Path(tmp), log, end - time.monotonic()) for x in chosen)  # lazily: one at a time
        for record in itertools.chain([head], results):
            line = json.dumps(record)
            print(line, flush=True)
            out.write(line + "\n")
            out.flush()
            records.append(record)
    print(summary(records), flush=True)
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
