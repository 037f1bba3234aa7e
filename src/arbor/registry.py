"""The registries: every family of pluggable things (losses, advantages, environments, inference backends,
scheduling modes, model families) lists its built-ins here by name, each as the dotted path of the object that
implements it.

This module imports nothing of arbor, so every layer reads it: config validation names the choices without
importing the implementations (or torch), and each process loads only what it uses. Adding a member is one new
file (the implementation, typed by its family's Protocol) and one line below. Where a family takes user plugins,
a dotted path `package.module:name` in the config stands for a member that is not listed.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any


def load_object(path: str) -> Any:
    """Imports `package.module:attr` (or `package.module.attr`); a ValueError in one line when it cannot."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    if not module or not attr:
        raise ValueError(f"{path!r} is not a dotted path 'package.module:name'")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import {path!r}: {e}") from None


def is_dotted_path(name: str) -> bool:
    """Whether a configured name is a user plugin's dotted path rather than a registered name."""
    return ":" in name or "." in name


@dataclasses.dataclass(frozen=True)
class Member:
    """One registered implementation: the object's dotted path and, for families whose members take typed
    arguments (environments), the dotted path of their pydantic arguments model."""

    path: str
    args: str | None = None


@dataclasses.dataclass(frozen=True)
class Registry:
    """The built-ins of one family, by name."""

    kind: str
    """What a member is, for messages ("loss", "inference backend")."""
    field: str
    """The config key that names a member, for messages ("trainer.loss.name")."""
    members: Mapping[str, Member]
    plugins: bool = True
    """Whether a dotted path `package.module:name` may name a member that is not listed."""

    def names(self) -> list[str]:
        return list(self.members)

    def check(self, name: str) -> None:
        """A ValueError in one line naming the field unless `name` is registered (or a dotted path, where the
        family takes plugins). Imports nothing."""
        if name in self.members or (self.plugins and is_dotted_path(name)):
            return
        also = " or a dotted path 'package.module:name'" if self.plugins else ""
        raise ValueError(f"{self.field}: unknown {self.kind} {name!r}; use one of {', '.join(self.members)}{also}")

    def path(self, name: str) -> str:
        self.check(name)
        return self.members[name].path if name in self.members else name

    def load(self, name: str) -> Any:
        """The implementing object of `name` (imported now)."""
        return load_object(self.path(name))

    def instance(self, name: str) -> Any:
        """`load(name)`, built with no arguments when it is a class (a family whose members are objects)."""
        obj = self.load(name)
        return obj() if isinstance(obj, type) else obj

    def load_args(self, name: str) -> Any | None:
        """The arguments model of a registered member, or None (unregistered, or a family without one)."""
        member = self.members.get(name)
        return load_object(member.args) if member is not None and member.args else None


def _members(**entries: str | tuple[str, str]) -> dict[str, Member]:
    return {k: Member(*v) if isinstance(v, tuple) else Member(v) for k, v in entries.items()}


LOSSES = Registry(
    "loss",
    "trainer.loss.name",
    _members(
        ppo_clip="arbor.trainer.loss:ppo_clip",
        is_mask="arbor.trainer.loss:is_mask",
        gspo="arbor.trainer.loss:gspo",
        cispo="arbor.trainer.loss:cispo",
        opmd="arbor.trainer.loss:opmd",
        cross_entropy="arbor.trainer.loss:cross_entropy",
        distill="arbor.trainer.loss:distill",
    ),
)
"""Policy losses (arbor.trainer.loss.LossFn)."""

ADVANTAGES = Registry(
    "advantage",
    "orchestrator.advantage.name",
    _members(
        grpo="arbor.orchestrator.advantages:grpo",
        drgrpo="arbor.orchestrator.advantages:drgrpo",
        rloo="arbor.orchestrator.advantages:rloo",
    ),
)
"""Group-relative advantages (arbor.orchestrator.advantages.AdvantageFn): every member is a rollout's reward
against a baseline from its own group, so config refuses each with group_size 1 and no teacher."""

ENVIRONMENTS = Registry(
    "environment",
    "orchestrator.environment.id",
    _members(
        reverse_text=("arbor.environments.reverse_text:ReverseTextEnv", "arbor.config.env_args:ReverseTextArgs"),
        math=("arbor.environments.math_problems:MathEnv", "arbor.config.env_args:MathArgs"),
        tool_use=("arbor.environments.tool_use:ToolUseEnv", "arbor.config.env_args:ToolUseArgs"),
        code=("arbor.environments.code:CodeEnv", "arbor.config.env_args:CodeArgs"),
        verifiers=("arbor.environments.verifiers_adapter:load_verifiers_env", "arbor.config.env_args:VerifiersArgs"),
        black_box=("arbor.environments.black_box:BlackBoxEnv", "arbor.config.env_args:BlackBoxArgs"),
        swe_agent=("arbor.environments.swe_agent:SweAgentEnv", "arbor.config.env_args:SweAgentArgs"),
        shapes=("arbor.environments.shapes:ShapesEnv", "arbor.config.env_args:ShapesArgs"),
    ),
)
"""Environments (arbor.environments.protocol.Environment / MultiTurnEnvironment factories), with the pydantic
model of their `[orchestrator.environment.args]`."""

# --- inference backends ---
BACKENDS = Registry(
    "inference backend",
    "inference.backend",
    _members(local="arbor.inference.local_backend:LOCAL", vllm="arbor.inference.vllm.backend:VLLM"),
    plugins=True,
)
"""Engines an `inference` server runs (arbor.config.inference.InferenceBackend objects); `teacher.backend` too."""

# --- scheduling modes ---

MODES = Registry(
    "scheduling mode",
    "orchestrator.scheduler.mode",
    _members(
        sync="arbor.orchestrator.modes.sync:SyncMode",
        one_step_off="arbor.orchestrator.modes.one_step_off:OneStepOffMode",
        **{"async": "arbor.orchestrator.modes.async_fifo:AsyncMode"},  # `async` is a keyword
        greedy="arbor.orchestrator.modes.greedy:GreedyMode",
        windowed_fifo="arbor.orchestrator.modes.windowed_fifo:WindowedFifoMode",
    ),
)
"""How generation overlaps training (arbor.orchestrator.scheduler.SchedulingMode, built from ModeSettings)."""

PER_STEP_MODES = frozenset({"sync", "one_step_off"})
"""The registered modes that launch one step's groups at a time (`continuous = False`), for config validation:
`scheduler.lag` is the continuous modes' knob. The modes' contract test holds the classes to this list."""

# --- model families ---

MODEL_FAMILIES = Registry(
    "model family",
    "model.name",
    _members(
        Qwen3ForCausalLM="arbor.models.families.qwen3:QWEN3",
        Qwen3MoeForCausalLM="arbor.models.families.qwen3_moe:QWEN3_MOE",
        DeepseekV32ForCausalLM="arbor.models.families.deepseek_v32:DSA",
        GlmMoeDsaForCausalLM="arbor.models.families.deepseek_v32:DSA",
        LlamaForCausalLM="arbor.models.families.llama:LLAMA",
        Qwen2ForCausalLM="arbor.models.families.llama:LLAMA",
        MistralForCausalLM="arbor.models.families.llama:LLAMA",
        Glm4MoeForCausalLM="arbor.models.families.glm4_moe:GLM4_MOE",
        MiniMaxM2ForCausalLM="arbor.models.families.minimax_m2:MINIMAX_M2",
    ),
    plugins=False,
)
"""Model families (arbor.models.family.ModelFamily) by the `config.json` architecture name they serve."""

TRANSFORMERS_FAMILY = "arbor.models.families.transformers:TRANSFORMERS"
"""The transformers path: every other `*ForCausalLM` through transformers' own modules (`model.impl`)."""
