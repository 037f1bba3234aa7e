"""`configs/` layers: every layered command the README or a skill shows resolves with `--dry-run`, every example
is layered on `configs/` and resolves, every layer composes with the others, and a file's own `layers` list is
read relative to it (cycles and missing layers are one-line errors)."""

from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path

import pytest

from arbor.config.loader import ConfigError, load_config
from arbor.config.rl import RLConfig
from arbor.launch.rl import main as rl_main

ROOT = Path(__file__).resolve().parents[2]
LAYERS = {
    kind: sorted((ROOT / "configs" / kind).glob("*.toml")) for kind in ("models", "hardware", "algorithms", "envs")
}
EXAMPLES = sorted((ROOT / "examples").glob("*/rl.toml"))


def shown_commands() -> list[list[str]]:
    """The `uv run rl` command lines of README.md and skills/ that stack `configs/` layers, as argument lists
    (backslash-continued lines joined; a command shown failing, `! uv run rl ...`, left out)."""
    out = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "skills").rglob("*.md"))]:
        for line in doc.read_text().replace("\\\n", " ").splitlines():
            if "@ configs/" not in line or "uv run rl" not in line or line.lstrip().startswith("!"):
                continue
            argv = shlex.split(line.split("uv run rl", 1)[1], comments=True)
            keep, i = [], 0
            while i < len(argv):  # the run's own output directory and mode are the test's
                if argv[i] == "--output-dir":
                    i += 2
                    continue
                if argv[i] not in ("--dry-run", "--check"):
                    keep.append(argv[i])
                i += 1
            out.append(keep)
    return out


COMMANDS = shown_commands()


def test_the_readme_and_skills_show_layered_commands():
    shown = " ".join(sum(COMMANDS, []))
    assert len(COMMANDS) >= 3
    assert all(
        kind in shown for kind in ("configs/models/", "configs/hardware/", "configs/algorithms/", "configs/envs/")
    )


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(c) for c in COMMANDS])
def test_every_shown_layered_command_resolves_with_dry_run(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert rl_main([*argv, "--dry-run", "--output-dir", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "configs" / "rl.toml").is_file()


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.parent.name for p in EXAMPLES])
def test_every_example_is_layered_on_configs_and_resolves(example, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert re.search(r'^layers = \["\.\./\.\./configs/models/', example.read_text(), re.M), example
    assert rl_main(["@", str(example.relative_to(ROOT)), "--dry-run", "--output-dir", str(tmp_path / "run")]) == 0


@pytest.mark.slow
def test_every_layer_is_a_few_commented_lines_and_composes_with_the_others(monkeypatch):
    monkeypatch.chdir(ROOT)
    for path in itertools.chain(*LAYERS.values()):
        lines = path.read_text().splitlines()
        assert lines[0].startswith("# ") and len(lines) <= 40, path
    assert {p.stem for p in LAYERS["hardware"]} >= {"cpu-laptop", "1xgpu", "8xgpu-node", "multi-node"}
    assert {p.stem for p in LAYERS["algorithms"]} >= {"grpo", "dapo", "gspo", "cispo", "opmd"}
    for i, (model, hardware) in enumerate(itertools.product(LAYERS["models"], LAYERS["hardware"])):
        algorithm = LAYERS["algorithms"][i % len(LAYERS["algorithms"])]
        env = LAYERS["envs"][i % len(LAYERS["envs"])]
        argv = ["@", str(model), "@", str(hardware), "@", str(algorithm), "@", str(env)]
        alone = {k: load_config(RLConfig, ["@", str(k)], env={}) for k in (hardware, algorithm)}
        if alone[hardware].inference.colocate and alone[algorithm].orchestrator.scheduler.mode == "async":
            # Taking turns on one GPU needs a per-step schedule: the pair is refused in one line saying so.
            with pytest.raises(ConfigError, match=r"inference\.colocate = true needs orchestrator\.scheduler") as e:
                load_config(RLConfig, argv, env={})
            assert "\n" not in str(e.value)
            continue
        cfg = load_config(RLConfig, argv, env={})
        assert cfg.model.name == load_config(RLConfig, ["@", str(model)], env={}).model.name


def test_a_files_layers_are_relative_to_it_and_later_files_win(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "model.toml").write_text('[model]\nname = "qwen3-test"\ninit_seed = 3\n')
    (tmp_path / "run.toml").write_text('layers = ["base/model.toml"]\nmax_steps = 4\n[model]\ninit_seed = 5\n')
    (tmp_path / "later.toml").write_text("max_steps = 9\n")
    cfg = load_config(RLConfig, ["@", str(tmp_path / "run.toml")], env={})
    assert (cfg.model.name, cfg.model.init_seed, cfg.max_steps) == ("qwen3-test", 5, 4)
    cfg = load_config(RLConfig, ["@", str(tmp_path / "run.toml"), "@", str(tmp_path / "later.toml")], env={})
    assert cfg.max_steps == 9


def test_missing_or_cyclic_layers_are_one_line(tmp_path):
    (tmp_path / "a.toml").write_text('layers = ["b.toml"]\n')
    (tmp_path / "b.toml").write_text('layers = ["a.toml"]\n')
    (tmp_path / "c.toml").write_text('layers = ["absent.toml"]\n')
    (tmp_path / "d.toml").write_text('layers = "b.toml"\n')
    for name, words in (
        ("a", "layers include the file itself"),
        ("c", "names absent.toml, which does not exist"),
        ("d", "must be a list of TOML file paths"),
    ):
        with pytest.raises(ConfigError, match=words) as e:
            load_config(RLConfig, ["@", str(tmp_path / f"{name}.toml")], env={})
        assert "\n" not in str(e.value)
