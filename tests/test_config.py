"""Config system: layering precedence, push-down of shared fields, errors with hints, help, dry-run."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import tomllib

import pytest

from arbor.config.base import Config
from arbor.config.loader import ConfigError, load_config, render_help
from arbor.config.orchestrator import OrchestratorConfig
from arbor.config.rl import RLConfig
from arbor.config.trainer import TrainerConfig
from tomli_w import dumps


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
    cfg = load_config(RLConfig, ["--model.name", "qwen3-test", "--seq-len", "128", "--output-dir", str(tmp_path)], env={})
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
        (["--orchestrator.batchsize", "8"], {}, r"'--orchestrator\.batchsize'.*did you mean --orchestrator\.batch-size\?"),
        ([], {"ARBOR_ORCHESTRATOR__GROUPSIZE": "4"}, r"ARBOR_ORCHESTRATOR__GROUPSIZE.*did you mean orchestrator\.group_size\?"),
        (["--orchestrator.batch-size", "12"], {}, r"multiple of group_size"),
        (["--max-steps", "many"], {}, r"^max_steps: "),
        (["--trainer.optim.lr"], {}, r"needs a value"),
        (["stray"], {}, r"unexpected argument 'stray'"),
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
        cfg = load_config(RLConfig, ["@", old, "--trainer.scheduler.warmup-steps", "3"],
                          env={"ARBOR_TRAINER__SCHEDULER__MIN_LR_RATIO": "0.1"})
    messages = {str(w.message) for w in record}
    assert "trainer.scheduler is deprecated; use trainer.lr_schedule" in messages
    assert any(m.startswith("orchestrator.async_lag is deprecated; use orchestrator.scheduler.mode = 'sync'") for m in messages)
    assert (cfg.trainer.lr_schedule.name, cfg.trainer.lr_schedule.warmup_steps, cfg.trainer.lr_schedule.min_lr_ratio) == ("cosine", 3, 0.1)
    assert cfg.orchestrator.scheduler.mode == "sync"
    written = cfg.to_toml_dict()  # what `rl` hands its processes: the new names only
    assert "lr_schedule" in written["trainer"] and "scheduler" not in written["trainer"]
    assert "async_lag" not in written["orchestrator"]
    with pytest.warns(DeprecationWarning):
        assert load_config(TrainerConfig, ["--scheduler.name", "linear"], env={}).lr_schedule.name == "linear"
        lagged = load_config(RLConfig, ["--orchestrator.async-lag", "3"], env={}).orchestrator.scheduler
        assert (lagged.mode, lagged.lag) == ("async", 3)  # k > 1 meant async with lag k, and still does
        pinned = load_config(RLConfig, ["--orchestrator.scheduler.mode", "greedy"], env={"ARBOR_ORCHESTRATOR__ASYNC_LAG": "0"})
        assert pinned.orchestrator.scheduler.mode == "greedy"  # a flag's mode beats the environment's async_lag
        toml = _write(tmp_path / "mode.toml", '[orchestrator.scheduler]\nmode = "one_step_off"\n')
        flagged = load_config(RLConfig, ["@", toml, "--orchestrator.async-lag", "0"], env={}).orchestrator.scheduler
        assert flagged.mode == "sync"  # and a flag's async_lag beats a file's mode: each keeps its source's rank
    with pytest.raises(ConfigError, match=r"orchestrator\.scheduler: lag applies to the continuous modes"):
        load_config(RLConfig, ["--orchestrator.scheduler.lag", "2"], env={})
    text = render_help(TrainerConfig, "trainer")
    assert "[lr_schedule]" in text and "--lr-schedule.warmup-steps" in text


def test_unknown_key_in_file_names_the_file(tmp_path):
    f = _write(tmp_path / "x.toml", "[orchestrator]\nbatchsize = 8\n")
    with pytest.raises(ConfigError, match=r"x\.toml: unknown option 'orchestrator\.batchsize' \(did you mean orchestrator\.batch_size\?\)"):
        load_config(RLConfig, ["@", f], env={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(RLConfig, ["@", str(tmp_path / "missing.toml")], env={})


def test_boolean_flags_and_free_form_tables(tmp_path):
    cfg = load_config(RLConfig, ["--dry-run", "--resume", "false", "--orchestrator.environment.args", "{ max_len = 5 }"], env={})
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
    cfg = load_config(RLConfig, ["--model.name", "qwen3-test", "--orchestrator.environment.args", "{ max_len = 5 }"], env={})
    text = dumps(cfg.to_toml_dict())
    again = RLConfig.model_validate(tomllib.loads(text))
    assert again == cfg


def test_rl_dry_run_is_fast_and_writes_configs(tmp_path):
    out = tmp_path / "out"
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "arbor.launch.rl", "@", "examples/reverse_text/rl.toml", "--dry-run", "--output-dir", str(out)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert time.monotonic() - t0 < 3.0
    for name in ("rl", "trainer", "orchestrator", "inference"):
        data = tomllib.loads((out / "configs" / f"{name}.toml").read_text())
        assert data
    assert not (out / "logs").exists()  # nothing was started


@pytest.mark.parametrize("flag, field", [(["--orchestrator.batch-size", "-3"], "orchestrator.batch_size"), (["--orchestrator.batchsize", "8"], "--orchestrator.batch-size")])
def test_rl_bad_config_exits_before_any_process(tmp_path, flag, field):
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-m", "arbor.launch.rl", "@", "examples/reverse_text/rl.toml", "--output-dir", str(out), *flag], capture_output=True, text=True)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0], res.stderr
    assert not out.exists()
