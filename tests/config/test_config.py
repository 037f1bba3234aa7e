"""Config system: layering precedence, push-down of shared fields, errors with hints, help, dry-run."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import time
import tomllib
import typing
from pathlib import Path

import pytest
from pydantic import Strict
from rl_runs import run_example
from tomli_w import dumps

from arbor.config.base import Config
from arbor.config.env_args import CodeArgs
from arbor.config.environment import EnvironmentConfig
from arbor.config.eval import EvalConfig
from arbor.config.loader import ConfigError, load_config, render_help
from arbor.config.orchestrator import AdvantageConfig, OrchestratorConfig
from arbor.config.rl import RLConfig
from arbor.config.trainer import TrainerConfig
from arbor.environments.sandbox import MAX_SLOTS
from arbor.registry import ADVANTAGES, ENVIRONMENTS


def _write(path, text):
    path.write_text(text)
    return str(path)


def test_precedence_defaults_files_env_cli(tmp_path):
    a = _write(tmp_path / "a.toml", "max_steps = 3\n[orchestrator]\nbatch_size = 16\ngroup_size = 4\n")
    b = _write(tmp_path / "b.toml", "[orchestrator]\nbatch_size = 32\n")
    cfg = load_config(RLConfig, ["@", a, f"@{b}"], env={})
    assert (cfg.max_steps, cfg.orchestrator.batch_size, cfg.orchestrator.group_size) == (3, 32, 4)
    assert cfg.orchestrator.scheduler.mode == "one_step_off"  # default untouched
    env = {"ARBOR_ORCHESTRATOR__BATCH_SIZE": "64", "ARBOR_MAX_STEPS": "5", "UNRELATED": "x"}
    cfg = load_config(RLConfig, ["@", a, "@", b], env=env)
    assert (cfg.max_steps, cfg.orchestrator.batch_size) == (5, 64)
    cfg = load_config(RLConfig, ["@", a, "--orchestrator.batch-size", "8", "--max_steps=7"], env=env)
    assert (cfg.max_steps, cfg.orchestrator.batch_size) == (7, 8)


def test_shared_fields_are_pushed_down_and_conflicts_fail(tmp_path):
    cfg = load_config(
        RLConfig, ["--model.name", "qwen3-test", "--seq-len", "128", "--output-dir", str(tmp_path)], env={}
    )
    for section in (cfg.trainer, cfg.orchestrator, cfg.inference, cfg.sft):
        assert section.model.name == "qwen3-test"
    assert cfg.orchestrator.seq_len == cfg.inference.seq_len == 128
    assert cfg.trainer.output_dir == cfg.orchestrator.output_dir == tmp_path
    same = _write(tmp_path / "same.toml", "seq_len = 128\n[inference]\nseq_len = 128\n")
    assert load_config(RLConfig, ["@", same], env={}).inference.seq_len == 128
    clash = _write(tmp_path / "clash.toml", "seq_len = 128\n[inference]\nseq_len = 256\n")
    with pytest.raises(ConfigError, match=r"inference\.seq_len = 256 differs from seq_len = 128"):
        load_config(RLConfig, ["@", clash], env={})


@pytest.mark.parametrize(
    "argv, env, pattern",
    [
        (["--orchestrator.batch-size", "-3"], {}, r"^orchestrator\.batch_size: .*greater than or equal to 1"),
        (
            ["--orchestrator.batchsize", "8"],
            {},
            r"'--orchestrator\.batchsize'.*did you mean --orchestrator\.batch-size\?",
        ),
        (
            [],
            {"ARBOR_ORCHESTRATOR__GROUPSIZE": "4"},
            r"ARBOR_ORCHESTRATOR__GROUPSIZE.*did you mean orchestrator\.group_size\?",
        ),
        # a key of another table: pointed at the nearest table that has it
        (["--orchestrator.top-p", "1"], {}, r"'--orchestrator\.top-p'.*did you mean --orchestrator\.sampling\.top-p\?"),
        (["--sampling.max-tokens", "8"], {}, r"'--sampling'.*did you mean --orchestrator\.sampling\?"),
        (["--nothing-like-it", "1"], {}, r"unknown option '--nothing-like-it'$"),
        (
            ["--orchestrator.group-size", "1", "--orchestrator.batch-size", "4"],
            {},
            r"^orchestrator: group_size = 1 with advantage\.name = 'grpo' gives every rollout an advantage of 0",
        ),
        (["--orchestrator.batch-size", "12"], {}, r"multiple of group_size"),
        (["--max-steps", "many"], {}, r"^max_steps: "),
        (["--trainer.optim.lr"], {}, r"needs a value"),
        (["stray"], {}, r"unexpected argument 'stray'"),
        (["--output-dir", ""], {}, r"^output_dir: the path is empty"),  # not ".": the run would fill the cwd
        ([], {"ARBOR_MODEL__LORA__PATH": " "}, r"^model\.lora\.path: the path is empty"),
    ],
)
def test_bad_input_gives_one_line_naming_the_field(argv, env, pattern):
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, argv, env=env)
    assert "\n" not in str(e.value)
    assert pytest.importorskip("re").search(pattern, str(e.value)), str(e.value)


@pytest.mark.parametrize(
    "toml, argv, env, pattern",
    [
        ("orchestrator = 3\n", [], {}, r"x\.toml: orchestrator is a table, not a value$"),
        ("[max_steps]\na = 1\n", [], {}, r"x\.toml: 'max_steps\.a': max_steps is a value, not a table$"),
        ("max_steps = = 3\n", [], {}, r"x\.toml: invalid TOML: "),
        (b"\xff\xfe", [], {}, r"x\.toml: invalid TOML: "),
        ("[orchestrator.sampling]\nfoo = 1\n", [], {}, r"x\.toml: unknown option 'orchestrator\.sampling\.foo'$"),
        ('max_steps = "many"\n', [], {}, r"^max_steps: Input should be a valid integer[^;]*'many'\)$"),  # said once
        (None, ["@"], {}, r"'@' must be followed by a TOML file"),
        (None, ["@", ""], {}, r"'@' must be followed by a TOML file"),
        (None, ["--model", "qwen3-test"], {}, r"^--model is a table, not a value$"),
        (None, ["--max-steps.foo", "3"], {}, r"--max-steps is a value, not a table$"),
        (None, ["--resume", "maybe"], {}, r"^resume: Input should be a valid boolean"),
        (None, [], {"ARBOR_ORCHESTRATOR": "3"}, r"^environment variable ARBOR_ORCHESTRATOR: orchestrator is a table"),
        (None, [], {"ARBOR_MAX_STEPS__X": "3"}, r"^environment variable ARBOR_MAX_STEPS__X: .*max_steps is a value"),
    ],
)
def test_malformed_configs_fail_in_one_line_naming_their_source(tmp_path, toml, argv, env, pattern):
    if toml is not None:
        (tmp_path / "x.toml").write_bytes(toml if isinstance(toml, bytes) else toml.encode())
        argv = ["@", str(tmp_path / "x.toml"), *argv]
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, argv, env=env)
    assert "\n" not in str(e.value)
    assert re.search(pattern, str(e.value)), str(e.value)


def test_renamed_and_retired_keys_keep_working(tmp_path):
    old = _write(tmp_path / "old.toml", '[trainer.scheduler]\nname = "cosine"\n[orchestrator]\nasync_lag = 0\n')
    with pytest.warns(DeprecationWarning) as record:
        cfg = load_config(
            RLConfig,
            ["@", old, "--trainer.scheduler.warmup-steps", "3"],
            env={"ARBOR_TRAINER__SCHEDULER__MIN_LR_RATIO": "0.1"},
        )
    messages = {str(w.message) for w in record}
    assert "trainer.scheduler is deprecated; use trainer.lr_schedule" in messages
    assert any(
        m.startswith("orchestrator.async_lag is deprecated; use orchestrator.scheduler.mode = 'sync'") for m in messages
    )
    assert (
        cfg.trainer.lr_schedule.name,
        cfg.trainer.lr_schedule.warmup_steps,
        cfg.trainer.lr_schedule.min_lr_ratio,
    ) == ("cosine", 3, 0.1)
    assert cfg.orchestrator.scheduler.mode == "sync"
    written = cfg.to_toml_dict()  # what `rl` hands its processes: the new names only
    assert "lr_schedule" in written["trainer"] and "scheduler" not in written["trainer"]
    assert "async_lag" not in written["orchestrator"]
    with pytest.warns(DeprecationWarning):
        assert load_config(TrainerConfig, ["--scheduler.name", "linear"], env={}).lr_schedule.name == "linear"
        lagged = load_config(RLConfig, ["--orchestrator.async-lag", "3"], env={}).orchestrator.scheduler
        assert (lagged.mode, lagged.lag) == ("async", 3)  # k > 1 meant async with lag k, and still does
        pinned = load_config(
            RLConfig, ["--orchestrator.scheduler.mode", "greedy"], env={"ARBOR_ORCHESTRATOR__ASYNC_LAG": "0"}
        )
        assert pinned.orchestrator.scheduler.mode == "greedy"  # a flag's mode beats the environment's async_lag
        toml = _write(tmp_path / "mode.toml", '[orchestrator.scheduler]\nmode = "one_step_off"\n')
        flagged = load_config(RLConfig, ["@", toml, "--orchestrator.async-lag", "0"], env={}).orchestrator.scheduler
        assert flagged.mode == "sync"  # and a flag's async_lag beats a file's mode: each keeps its source's rank
    with pytest.warns(DeprecationWarning, match=r"orchestrator\.temperature is deprecated; use orchestrator\.sampling"):
        hot = _write(tmp_path / "hot.toml", "[orchestrator]\ntemperature = 0.5\n")
        assert load_config(RLConfig, ["@", hot], env={}).orchestrator.sampling.temperature == 0.5
        beaten = load_config(RLConfig, ["@", hot, "--orchestrator.sampling.temperature", "0.7"], env={})
        assert beaten.orchestrator.sampling.temperature == 0.7  # a flag's new key beats a file's retired one
        assert OrchestratorConfig(temperature=0.25).sampling.temperature == 0.25  # built in Python, as before
        both = OrchestratorConfig(temperature=0.25, sampling={"temperature": 0.5, "max_tokens": 8})
        assert (both.sampling.temperature, both.sampling.max_tokens) == (0.5, 8)  # the new key wins
    assert "temperature" not in cfg.to_toml_dict()["orchestrator"]
    with pytest.raises(ConfigError, match=r"orchestrator\.scheduler: lag applies to the continuous modes"):
        load_config(RLConfig, ["--orchestrator.scheduler.lag", "2"], env={})
    between = ["--orchestrator.scheduler.weight-updates", "between_steps"]
    assert load_config(RLConfig, between, env={}).orchestrator.scheduler.weight_updates == "between_steps"
    for flags, why in [
        (["--orchestrator.scheduler.mode", "async"], r"needs a per-step mode \(sync, one_step_off\), not 'async'"),
        (["--inference.colocate", "true"], r"weight_updates = 'between_steps' needs inference\.colocate = false"),
        (["--weights.kind", "nccl", "--inference.backend", "vllm"], r"needs weights\.kind = 'filesystem'"),
        (["--trainer.keep-broadcasts", "1"], r"needs trainer\.keep_broadcasts >= 2"),
    ]:
        with pytest.raises(ConfigError, match=why):
            load_config(RLConfig, [*between, *flags], env={})
    text = render_help(TrainerConfig, "trainer")
    assert "[lr_schedule]" in text and "--lr-schedule.warmup-steps" in text


def test_unknown_key_in_file_names_the_file(tmp_path):
    f = _write(tmp_path / "x.toml", "[orchestrator]\nbatchsize = 8\n")
    with pytest.raises(
        ConfigError,
        match=r"x\.toml: unknown option 'orchestrator\.batchsize' \(did you mean orchestrator\.batch_size\?\)",
    ):
        load_config(RLConfig, ["@", f], env={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(RLConfig, ["@", str(tmp_path / "missing.toml")], env={})


def test_boolean_flags_and_free_form_tables(tmp_path):
    cfg = load_config(
        RLConfig, ["--dry-run", "--resume", "false", "--orchestrator.environment.args", "{ max_len = 5 }"], env={}
    )
    assert cfg.dry_run is True and cfg.resume is False
    assert cfg.orchestrator.environment.args == {"max_len": 5}
    f = _write(tmp_path / "e.toml", "[orchestrator.environment.args]\nmax_len = 6\nanything_goes = true\n")
    assert load_config(RLConfig, ["@", f], env={}).orchestrator.environment.args["anything_goes"] is True


def test_deprecated_alias_warns_and_applies():
    class Inner(Config):
        new_name: int = 1
        """The new name."""
        deprecated_aliases = {"old_name": "new_name"}

    class Outer(Config):
        inner: Inner = Inner()
        """A table."""

    with pytest.warns(DeprecationWarning, match="inner.old_name is deprecated; use inner.new_name"):
        cfg = load_config(Outer, ["--inner.old-name", "5"], env={})
    assert cfg.inner.new_name == 5


def test_help_lists_documented_fields(capsys):
    text = render_help(OrchestratorConfig, "orchestrator")
    assert "--batch-size" in text and "Rollouts per training step" in text
    assert "[sampling]" in text and "--sampling.max-tokens" in text


def test_resolved_config_roundtrips_through_toml(tmp_path):
    cfg = load_config(
        RLConfig, ["--model.name", "qwen3-test", "--orchestrator.environment.args", "{ max_len = 5 }"], env={}
    )
    text = dumps(cfg.to_toml_dict())
    again = RLConfig.model_validate(tomllib.loads(text))
    assert again == cfg


@pytest.mark.slow
def test_rl_dry_run_writes_configs_and_starts_nothing(tmp_path):
    out = tmp_path / "out"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "arbor.launch.rl",
            "@",
            "examples/reverse_text/rl.toml",
            "--dry-run",
            "--output-dir",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    for name in ("rl", "trainer", "orchestrator", "inference"):
        data = tomllib.loads((out / "configs" / f"{name}.toml").read_text())
        assert data
    assert not (out / "logs").exists()  # nothing was started


@pytest.mark.slow
@pytest.mark.parametrize(
    "flag, field",
    [
        (["--orchestrator.batch-size", "-3"], "orchestrator.batch_size"),
        (["--orchestrator.batchsize", "8"], "--orchestrator.batch-size"),
    ],
)
def test_rl_bad_config_exits_before_any_process(tmp_path, flag, field):
    out = tmp_path / "out"
    res = run_example("--output-dir", str(out), *flag, timeout=300)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0], res.stderr
    assert not out.exists()


# --- fuzz: bad configurations fail in one line naming the key; every example and good variation loads --------

BAD_CONFIGS = [
    # (flags, a text the one-line error must contain: the key it names)
    *[
        ([f"--{key}", value], key.replace("-", "_"))
        for key in (
            "trainer.optim.lr",
            "orchestrator.sampling.temperature",
            "stall-timeout",
            "trainer.optim.eps",
            "sft.lr",
            "orchestrator.client.timeout",
            "weights.timeout",
            "trainer.rollout-timeout",
            "cost.gpu-hour-usd",
            "orchestrator.environment.timeout",
            "inference.router.health-interval",
            "trainer.loss.kl-coef",
        )
        for value in ("inf", "nan", "-inf")
    ],
    *[
        ([f"--{key}", "true"], key.replace("-", "_"))
        for key in (
            "max-steps",
            "seq-len",
            "seed",
            "orchestrator.batch-size",
            "orchestrator.group-size",
            "trainer.parallel.nproc",
            "trainer.parallel.cp",
            "trainer.ckpt.interval",
            "inference.max-batch-size",
            "orchestrator.sampling.max-tokens",
            "trainer.optim.lr",
            "orchestrator.sampling.temperature",
            "inference.port",
            "orchestrator.max-off-policy-steps",
        )
    ],
    *[
        ([f"--{key}", str(value)], key.replace("-", "_"))
        for key, value in (
            ("seq-len", 2**62),
            ("orchestrator.batch-size", 2**40),
            ("seed", 2**70),
            ("seed", -1),
            ("seed", 2**32),
            ("model.init-seed", 2**64),
            ("max-steps", 2**40),
            ("trainer.parallel.nproc", 10**6),
            ("orchestrator.sampling.max-tokens", 2**30),
            ("inference.max-batch-size", 2**30),
            ("inference.port", 70000),
            ("inference.port", -1),
            ("trainer.optim.lr", 1e308),
            ("orchestrator.sampling.temperature", 1e308),
            ("stall-timeout", 1e300),
            ("orchestrator.group-size", 0),
            ("trainer.ckpt.keep", 0),
            ("orchestrator.batching.micro-batch-tokens", 2**40),
            ("trainer.keep-broadcasts", -2),
            ("inference.replicas", 2**20),
            ("trainer.parallel.dp-shard", -2),
            ("orchestrator.gateway.max-request-bytes", 2**62),
            ("trainer.optim.muon-momentum", 1.0),
            ("orchestrator.max-steps", 3.5),
            ("orchestrator.batch-size", 8.0),
            ("trainer.optim.lr", "'1e-3'"),
        )
    ],
    (["--trainer.parallel.dp-shard", "0"], "trainer.parallel: dp_shard"),
    (["--trainer.optim.betas", "[1.5, -1]"], "trainer.optim.betas.0"),
    (["--trainer.optim.betas", "[0.9, -1]"], "trainer.optim.betas.1"),
    (["--trainer.optim.betas", "[true, 0.9]"], "trainer.optim.betas.0"),
    (["--orchestrator.curriculum.weights", "[1, nan, 1]"], "orchestrator.curriculum.weights.1"),
    (["--orchestrator.environment.reward-weights", "{ a = inf }"], "orchestrator.environment.reward_weights.a"),
    # parallel layouts that cannot exist
    (["--trainer.parallel.nproc", "3", "--trainer.parallel.dp-replicate", "2"], "trainer.parallel"),
    (["--trainer.parallel.nproc", "2", "--trainer.parallel.dp-shard", "4"], "trainer.parallel"),
    (["--trainer.parallel.nproc", "4", "--trainer.parallel.dp-shard", "2"], "trainer.parallel"),
    (
        ["--trainer.parallel.nproc", "4", "--trainer.parallel.dp-replicate", "2", "--trainer.parallel.dp-shard", "3"],
        "trainer.parallel",
    ),
    (["--model.name", "qwen3-test", "--trainer.parallel.nproc", "3", "--trainer.parallel.cp", "3"], "parallel.cp"),
    (
        [
            "--model.name",
            "qwen3-small",
            "--trainer.parallel.nproc",
            "4",
            "--trainer.parallel.cp",
            "4",
            "--trainer.parallel.cp-style",
            "ulysses",
        ],
        "parallel.cp",
    ),
    (["--model.name", "qwen3-test", "--trainer.parallel.nproc", "2", "--trainer.parallel.ep", "2"], "parallel.ep"),
    (["--model.name", "qwen3-tiny", "--trainer.parallel.nproc", "4", "--trainer.parallel.ep", "4"], "parallel.ep"),
    (["--model.name", "qwen3-moe-tiny", "--trainer.parallel.nproc", "3", "--trainer.parallel.ep", "3"], "parallel.ep"),
    (["--model.name", "qwen3-moe-test", "--trainer.parallel.nproc", "8", "--trainer.parallel.ep", "8"], "parallel.ep"),
    (
        ["--model.name", "qwen3-moe-test", "--trainer.parallel.nproc", "2", "--trainer.parallel.ep", "4"],
        "trainer.parallel.ep",
    ),
    (
        [
            "--model.name",
            "dsa-test",
            "--trainer.parallel.nproc",
            "2",
            "--trainer.parallel.cp",
            "2",
            "--trainer.parallel.cp-style",
            "ring",
        ],
        "trainer.parallel.cp_style",
    ),
    (
        [
            "--model.name",
            "qwen3-test",
            "--trainer.parallel.nproc",
            "2",
            "--trainer.parallel.cp",
            "2",
            "--trainer.parallel.cp-style",
            "dsa",
        ],
        "trainer.parallel.cp_style",
    ),
    (["--trainer.parallel.nproc", "2", "--trainer.parallel.cp", "4"], "trainer.parallel"),
    (["--inference.backend", "vllm", "--inference.kv-after-update", "recompute"], "kv_after_update"),
    (["--inference.kv-after-update", "drop"], "inference.kv_after_update"),
    # environment arguments: misspelt, mistyped, out of range, contradictory
    (["--orchestrator.environment.args", "{ min_lenn = 3 }"], "did you mean min_len?"),
    (["--orchestrator.environment.args", "{ max_lne = 3 }"], "did you mean max_len?"),
    (["--orchestrator.environment.args", "{ min_len = 6, max_len = 3 }"], "min_len (6) exceeds max_len (3)"),
    (["--orchestrator.environment.args", "{ min_len = 0 }"], "min_len"),
    (["--orchestrator.environment.args", "{ max_len = true }"], "max_len"),
    (["--orchestrator.environment.args", "{ num_tasks = 2.5 }"], "num_tasks"),
    (["--orchestrator.environment.args", "{ alphabet = '' }"], "alphabet"),
    (["--orchestrator.environment.id", "math", "--orchestrator.environment.args", "{ difficulty = 4 }"], "difficulty"),
    (["--orchestrator.environment.id", "math", "--orchestrator.environment.args", "{ kinds = ['algebra'] }"], "kinds"),
    (
        ["--orchestrator.environment.id", "math", "--orchestrator.environment.args", "{ difficulity = 2 }"],
        "did you mean difficulty?",
    ),
    (["--orchestrator.environment.id", "tool_use", "--orchestrator.environment.args", "{ search_k = 9 }"], "search_k"),
    (
        ["--orchestrator.environment.id", "tool_use", "--orchestrator.environment.args", "{ max_turn = 2 }"],
        "did you mean max_turns?",
    ),
    (
        ["--orchestrator.environment.id", "code", "--orchestrator.environment.args", "{ max_concurrency = 1000 }"],
        "max_concurrency",
    ),
    (
        ["--orchestrator.environment.id", "code", "--orchestrator.environment.args", "{ wall_seconds = inf }"],
        "orchestrator.environment.args",
    ),
    (["--orchestrator.environment.id", "black_box"], "give exactly one of command, function or remote"),
    (
        [
            "--orchestrator.environment.id",
            "black_box",
            "--orchestrator.environment.args",
            "{ function = 'a.py:f', remote = true }",
        ],
        "give exactly one",
    ),
    (
        [
            "--orchestrator.environment.id",
            "black_box",
            "--orchestrator.environment.args",
            "{ function = 'a.py:f', task_args = { min_len = 9 } }",
        ],
        "task_args (environment 'reverse_text'): min_len (9)",
    ),
    (
        [
            "--orchestrator.environment.id",
            "black_box",
            "--orchestrator.environment.args",
            "{ function = 'a.py:f', task_args = { min_lenn = 2 } }",
        ],
        "did you mean task_args.min_len?",
    ),
    (
        [
            "--orchestrator.environment.id",
            "black_box",
            "--orchestrator.environment.args",
            "{ function = 'a.py:f', task_input = 'file' }",
        ],
        "task_input",
    ),
    (["--orchestrator.environment.id", "verifiers", "--orchestrator.environment.args", "{ max_tasks = 3 }"], "env_id"),
    # a name no registry lists, nor a dotted path
    (["--orchestrator.advantage.name", "ppo"], "orchestrator.advantage.name: unknown advantage 'ppo'; use one of grpo"),
    # paths the filesystem cannot hold, malformed sources
    (["--output-dir", "/tmp/" + "x" * 300], "output_dir"),
    (["--output-dir", "/tmp/" + "a/" * 2100], "output_dir"),
    (["--orchestrator", "3"], "--orchestrator is a table"),
    (["--orchestrator.batch-size"], "--orchestrator.batch-size needs a value"),
]


@pytest.mark.parametrize("argv, key", BAD_CONFIGS)
def test_fuzzed_bad_configs_fail_in_one_line_naming_the_key(argv, key):
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, argv, env={})
    assert "\n" not in str(e.value) and key in str(e.value), str(e.value)
    assert time.monotonic() - t0 < 10.0  # no hub lookup or process start: a bad config fails in-process


def test_the_fuzz_covers_at_least_a_hundred_bad_configs():
    assert len(BAD_CONFIGS) >= 100


@pytest.mark.parametrize("path", sorted(str(p) for p in Path("examples").glob("*/rl.toml")))
def test_every_example_config_loads(path):
    cfg = load_config(RLConfig, ["@", path], env={})
    assert cfg.orchestrator.seq_len == cfg.seq_len


GOOD_VARIATIONS = [
    ["--seed", str(2**32 - 1)],
    ["--seed", "0"],
    ["--trainer.optim.lr", "1"],
    ["--orchestrator.sampling.temperature", "0"],
    ["--trainer.optim.betas", "[0, 0.5]"],
    ["--seq-len", str(2**20), "--orchestrator.sampling.max-tokens", "8"],
    ["--trainer.parallel.nproc", "4", "--trainer.parallel.dp-replicate", "2"],
    ["--trainer.parallel.nproc", "4", "--trainer.parallel.dp-replicate", "2", "--trainer.parallel.dp-shard", "2"],
    ["--model.name", "qwen3-test", "--trainer.parallel.nproc", "4", "--trainer.parallel.cp", "4"],
    [
        "--model.name",
        "qwen3-test",
        "--trainer.parallel.nproc",
        "2",
        "--trainer.parallel.cp",
        "2",
        "--trainer.parallel.cp-style",
        "ring",
    ],
    [
        "--model.name",
        "qwen3-small",
        "--trainer.parallel.nproc",
        "4",
        "--trainer.parallel.cp",
        "4",
        "--trainer.parallel.cp-style",
        "ring",
    ],
    ["--model.name", "dsa-test", "--trainer.parallel.nproc", "2", "--trainer.parallel.cp", "2"],
    ["--model.name", "qwen3-moe-tiny", "--trainer.parallel.nproc", "4", "--trainer.parallel.ep", "4"],
    [
        "--model.name",
        "qwen3-moe-test",
        "--trainer.parallel.nproc",
        "4",
        "--trainer.parallel.cp",
        "2",
        "--trainer.parallel.ep",
        "4",
    ],
    ["--orchestrator.environment.args", "{ min_len = 4, max_len = 4 }"],
    [
        "--orchestrator.environment.id",
        "math",
        "--orchestrator.environment.args",
        "{ difficulty = 3, kinds = ['word'] }",
    ],
    ["--orchestrator.environment.id", "tool_use", "--orchestrator.environment.args", "{ search_k = 5 }"],
    [
        "--orchestrator.environment.id",
        "black_box",
        "--orchestrator.environment.args",
        "{ command = 'python agent.py', task_args = { max_len = 4 } }",
    ],
    ["--orchestrator.environment.id", "mypkg.envs:make", "--orchestrator.environment.args", "{ whatever = 1 }"],
    ["--inference.port", "0", "--stall-timeout", "86400", "--orchestrator.environment.reward-weights", "{ a = -2.5 }"],
    ["--output-dir", "2024", "--orchestrator.buffer.path", "7"],  # a path that reads as a number stays a path
]


@pytest.mark.parametrize("argv", GOOD_VARIATIONS)
def test_good_variations_still_load(argv):
    load_config(RLConfig, ["@", "examples/tiny/rl.toml", *argv], env={})


def test_environment_argument_models_match_the_constructors():
    for name in ENVIRONMENTS.names():
        model = ENVIRONMENTS.load_args(name)
        assert model is not None, f"{name} has no arguments model"
        params = inspect.signature(ENVIRONMENTS.load(name)).parameters.values()
        taken = {p.name: p.default for p in params if p.name != "self"}
        fields = {
            k: (f.default if not f.is_required() else inspect.Parameter.empty) for k, f in model.model_fields.items()
        }
        assert taken == fields, name
    CodeArgs(max_concurrency=MAX_SLOTS)
    with pytest.raises(ValueError):
        CodeArgs(max_concurrency=MAX_SLOTS + 1)


def test_every_numeric_field_is_strict_and_bounded():
    """No table declares a bare int or float: each uses a type of arbor.config.base (strict, finite, bounded)."""
    seen: set[type] = set()

    def bare(ann) -> bool:  # a field's own Annotated metadata is moved to FieldInfo.metadata; nested ones stay
        if typing.get_origin(ann) is typing.Annotated:
            return False
        return ann in (int, float) or any(bare(a) for a in typing.get_args(ann))

    def tables(ann) -> list:
        if isinstance(ann, type) and issubclass(ann, Config):
            return [ann]
        return [t for a in typing.get_args(ann) for t in tables(a)]

    def walk(cls: type[Config]) -> list:
        if cls in seen:
            return []
        seen.add(cls)
        out = []
        for name, f in cls.model_fields.items():
            if not any(isinstance(m, Strict) for m in f.metadata) and bare(f.annotation):
                out.append(f"{cls.__name__}.{name}")
            out += [b for t in tables(f.annotation) for b in walk(t)]
        return out

    env_args = [ENVIRONMENTS.load_args(name) for name in ENVIRONMENTS.names()]
    assert walk(RLConfig) + walk(EvalConfig) + [b for m in env_args for b in walk(m)] == []


@pytest.mark.slow
def test_dry_run_of_a_cluster_config_needs_no_file_and_no_torch(tmp_path):
    """--dry-run reads no model file (a checkpoint path that exists only on the cluster passes) and imports no torch,
    also with context parallelism (which checks the model's heads)."""
    code = (
        "import sys; from arbor.launch.rl import main; rc = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules, 'torch was imported'; raise SystemExit(rc)"
    )
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "@",
            "examples/tiny/rl.toml",
            "--dry-run",
            "--output-dir",
            str(tmp_path / "out"),
            "--model.name",
            "/cluster/models/qwen3-8b",
            "--trainer.parallel.nproc",
            "2",
            "--trainer.parallel.cp",
            "2",
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv",
    [
        ["--trainer.parallel.nproc", "2", "--trainer.parallel.cp", "3"],
        ["--model.name", "qwen3-test", "--trainer.parallel.nproc", "3", "--trainer.parallel.cp", "3"],
        ["--orchestrator.environment.args", "{ min_lenn = 3 }"],
        ["--seed", "-1"],
    ],
)
def test_rl_exits_in_one_line_before_any_process(tmp_path, argv):
    out = tmp_path / "out"
    res = subprocess.run(
        [sys.executable, "-m", "arbor.launch.rl", "@", "examples/tiny/rl.toml", "--output-dir", str(out), *argv],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not out.exists()


@pytest.mark.slow
def test_dry_run_into_an_unwritable_output_dir_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "arbor.launch.rl",
            "@",
            "examples/tiny/rl.toml",
            "--dry-run",
            "--output-dir",
            str(tmp_path / "file" / "run"),
        ],
        capture_output=True,
        text=True,
    )
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "output_dir" in lines[0] and "not writable" in lines[0], (
        res.stderr
    )


@pytest.mark.parametrize("name", ADVANTAGES.names())
def test_every_builtin_advantage_is_refused_with_groups_of_one(name) -> None:
    """Every registered advantage is group-relative: with groups of one (and no teacher) nothing is learned."""
    with pytest.raises(ValueError, match=f"group_size = 1 with advantage.name = '{name}'"):
        OrchestratorConfig(batch_size=4, group_size=1, advantage={"name": name})
    OrchestratorConfig(batch_size=4, group_size=1, advantage={"name": "mypkg.adv:baseline_free"})


def test_the_docs_of_registry_fields_name_every_member() -> None:
    """The `--help` text of a field that names a registry member lists every registered one."""
    for field, registry in (
        (EnvironmentConfig.model_fields["id"], ENVIRONMENTS),
        (AdvantageConfig.model_fields["name"], ADVANTAGES),
    ):
        assert "arbor.registry" in field.description
        missing = [n for n in registry.names() if n not in field.description]
        assert missing == [], f"the doc of {registry.field} does not name {missing}"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model.dtype", "float32"], r"ep_backend = 'deepep' needs model.dtype = 'bfloat16'.*got 'float32'"),
        (
            ["--trainer.parallel.ep-max-tokens-per-rank", "256"],
            r"micro_batch_tokens \(512\) / trainer.parallel.cp \(1\) exceeds .*ep_max_tokens_per_rank \(256\)",
        ),
    ],
)
def test_deepep_is_refused_in_one_line_where_it_cannot_work(flags, message):
    """DeepEP dispatches bf16 tokens only, into a buffer of `ep_max_tokens_per_rank` tokens: a config outside
    either is one line naming the fields, before anything starts (it used to fail in the kernels)."""
    base = ["@", "examples/moe_reverse_text/rl.toml", "--trainer.parallel.ep-backend", "deepep"]
    base += ["--model.dtype", "bfloat16"]
    with pytest.raises(ConfigError, match=message):
        load_config(RLConfig, base + flags, env={})
    load_config(RLConfig, base, env={})  # bf16 and a buffer that holds a row: accepted


def test_model_router_replay_makes_the_fleet_return_routes():
    """The recipes set `model.router_replay` only; vLLM returns routes only when told, so the trainer would have
    routed by itself, silently. The flag now reaches the fleet, and a contradiction is one line."""
    base = ["@", "examples/moe_reverse_text/rl.toml", "--inference.backend", "vllm"]
    cfg = load_config(RLConfig, base, env={})
    assert cfg.model.router_replay and cfg.inference.router_replay
    off = load_config(RLConfig, base + ["--model.router-replay", "false"], env={})
    assert not off.inference.router_replay
    with pytest.raises(ConfigError, match="inference.router_replay = false with model.router_replay = true"):
        load_config(RLConfig, base + ["--inference.router-replay", "false"], env={})
