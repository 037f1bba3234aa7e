"""Adding an environment is one module (tests/toy_env.py: the factory and its arguments model) and one entry in
arbor.registry.ENVIRONMENTS: config validation then checks its arguments like a built-in's, preflight finds it,
and load_environment builds it."""

from __future__ import annotations

import asyncio

import pytest

from arbor.config.env_args import check_env_args
from arbor.config.environment import EnvironmentConfig
from arbor.config.loader import ConfigError, load_config
from arbor.config.rl import RLConfig
from arbor.environments import Environment, load_environment
from arbor.launch.preflight import check_environment
from arbor.registry import ENVIRONMENTS, Member

TINY = ["@", "examples/tiny/rl.toml"]


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> str:
    """The one registry line a new environment adds."""
    monkeypatch.setitem(ENVIRONMENTS.members, "repeat", Member("toy_env:RepeatEnv", "toy_env:RepeatArgs"))
    return "repeat"


def _load(*args: str) -> RLConfig:
    return load_config(RLConfig, [*TINY, "--orchestrator.environment.id", "repeat", *args], env={})


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ("{ wrod = 'x' }", "unknown argument 'wrod' of environment 'repeat' (did you mean word?)"),
        ("{ times = 10 }", "times of environment 'repeat'"),
        ("{ word = '' }", "word of environment 'repeat'"),
        ("{ times = 'two' }", "times of environment 'repeat'"),
    ],
)
def test_a_registered_environment_has_its_arguments_checked_by_config(toy, args, message):
    with pytest.raises(ConfigError) as e:
        _load("--orchestrator.environment.args", args)
    line = str(e.value)
    assert "\n" not in line and "orchestrator.environment.args" in line and message in line, line


def test_a_registered_environment_is_built_and_checked_like_a_builtin(toy):
    cfg = _load("--orchestrator.environment.args", "{ word = 'xy', times = 3 }").orchestrator.environment
    env = load_environment(cfg)
    assert isinstance(env, Environment) and (env.word, env.times) == ("xy", 3)
    (task,) = env.dataset(0)
    assert asyncio.run(env.score(task, "xyxyxy")) == {"exact": 1.0} and env.reference(task) == "xyxyxy"
    check_environment("repeat")  # preflight: registered, its module importable
    with pytest.raises(ValueError, match=r"unknown argument 'colour' of environment 'repeat' \(it takes word, times\)"):
        check_env_args("repeat", {"colour": "red"}, strict=True)  # preflight refuses what config lets through
    # As a black-box agent's inner environment, its arguments are checked under task_args.
    with pytest.raises(ValueError, match=r"did you mean task_args\.times\?"):
        EnvironmentConfig(id="black_box", args={"function": "a.py:f", "tasks": "repeat", "task_args": {"tmes": 2}})


def test_an_unregistered_name_is_refused_naming_the_registered_ones():
    with pytest.raises(ValueError, match=r"unknown environment 'repeat'; use one of reverse_text, math, .*swe_agent"):
        load_environment(EnvironmentConfig(id="repeat"))
