"""Models and tokenizers by Hugging Face hub id, resolved offline from a pre-populated cache (never a download);
base-model tokenizers without a chat template and `prompt_format = "raw"`; and the real shapes of the models
the `configs/models/` layers name, built on the meta device with their published parameter counts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_tiny import SMALL_LLAMA, write_llama, write_llama_of_preset
from hub_fixtures import hub_cache, tiny_checkpoint, use_cache
from rl_runs import check_ran, run_example

from arbor.config.environment import EnvironmentConfig
from arbor.config.loader import ConfigError, load_config
from arbor.config.model import ModelConfig
from arbor.config.rl import RLConfig
from arbor.environments import env_prompt_ids, load_environment
from arbor.launch import preflight
from arbor.launch.preflight import PreflightError
from arbor.models import build_model, build_tokenizer, model_args, resolve_dir
from arbor.models.args import DSAArgs
from arbor.models.deepseek_v32 import DeepseekV32ForCausalLM
from arbor.models.hub import HubError, is_hub_id
from arbor.models.published import PUBLISHED_SHAPES
from arbor.models.qwen3 import Qwen3ForCausalLM
from arbor.models.qwen3_moe import Qwen3MoeForCausalLM
from arbor.monitor.metrics import read_jsonl

TINY = [
    "--seq-len",
    "48",
    "--orchestrator.batch-size",
    "8",
    "--orchestrator.group-size",
    "4",
    "--orchestrator.sampling.max-tokens",
    "8",
    "--max-steps",
    "2",
]


def test_a_hub_id_resolves_from_the_cache_and_builds_the_same_model(tmp_path, monkeypatch):
    use_cache(monkeypatch, tmp_path / "hf")
    snapshot = hub_cache(tmp_path / "hf", "arbor-test/qwen3-test", tiny_checkpoint(tmp_path / "ckpt"))
    assert is_hub_id("arbor-test/qwen3-test") and not is_hub_id(str(tmp_path / "ckpt"))
    assert resolve_dir("arbor-test/qwen3-test") == snapshot
    cfg = ModelConfig(name="arbor-test/qwen3-test")
    assert model_args(cfg).to_hf_config() == model_args(ModelConfig(name="qwen3-test")).to_hf_config()
    hub, preset = build_model(cfg), build_model(ModelConfig(name="qwen3-test"))
    assert all(torch.equal(a, b) for a, b in zip(hub.state_dict().values(), preset.state_dict().values()))
    tokenizer = build_tokenizer(cfg)
    assert tokenizer.encode("abc") == [97, 98, 99] and tokenizer.has_chat_template
    rl = load_config(RLConfig, ["--model.name", "arbor-test/qwen3-test", "--output-dir", str(tmp_path / "run"), *TINY])
    preflight.run_checks(rl)  # the hub id passes the model checks and builds the orchestrator's tokenizer


def test_a_local_path_not_written_yet_is_named_as_one(tmp_path, monkeypatch):
    """`outputs/tiny-vl` before examples/vision/setup.sh wrote it reads as a hub id (org/name): the error says that
    as a local path it does not exist, since its first part is a directory here; a real org name gets no hint."""
    use_cache(monkeypatch, tmp_path / "hf")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    hint = r"read as a local path, 'outputs/tiny-vl' does not exist \(its parent 'outputs/' does\)"
    with pytest.raises(HubError, match=hint):
        resolve_dir("outputs/tiny-vl")
    with pytest.raises(HubError) as err:
        resolve_dir("arbor-test/absent")
    assert "local path" not in str(err.value)


@pytest.mark.slow
def test_a_missing_hub_id_offline_fails_in_one_line(tmp_path, monkeypatch):
    use_cache(monkeypatch, tmp_path / "hf")
    with pytest.raises(HubError, match="not in the Hugging Face cache .* HF_HUB_OFFLINE is set"):
        resolve_dir("arbor-test/absent")
    out = tmp_path / "run"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "arbor.launch.rl",
            "--model.name",
            "arbor-test/absent",
            "--output-dir",
            str(out),
            *TINY,
            "--check",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert "model.name 'arbor-test/absent' is not in the Hugging Face cache" in lines[0]
    assert "hf download arbor-test/absent" in lines[0]


def test_preflight_refuses_a_chat_environment_with_a_template_less_tokenizer(tmp_path):
    base = tiny_checkpoint(tmp_path / "base", chat_template=False)
    args = ["--model.name", str(base), "--output-dir", str(tmp_path / "run"), *TINY]
    with pytest.raises(PreflightError) as e:
        preflight.run_checks(load_config(RLConfig, args))
    assert "orchestrator.environment.prompt_format = 'chat' but the tokenizer" in str(e.value)
    assert "no chat template" in str(e.value) and "\n" not in str(e.value)
    preflight.run_checks(load_config(RLConfig, [*args, "--orchestrator.environment.prompt-format", "raw"]))
    with pytest.raises(PreflightError, match="is multi-turn"):
        preflight.run_checks(
            load_config(
                RLConfig,
                [
                    *args,
                    "--orchestrator.environment.prompt-format",
                    "raw",
                    "--orchestrator.environment.id",
                    "tool_use",
                    "--seq-len",
                    "512",
                ],
            )
        )


def test_a_raw_prompt_is_the_task_text_and_ends_at_the_base_models_eos(tmp_path):
    tokenizer = build_tokenizer(ModelConfig(name=str(tiny_checkpoint(tmp_path / "base", chat_template=False))))
    assert not tokenizer.has_chat_template and tokenizer.eos_token_id == tokenizer.tok.eos_token_id
    env = load_environment(EnvironmentConfig(args={"system_prompt": "Be brief."}))
    task = env.dataset(0)[0]
    ids = env_prompt_ids(env, task, tokenizer, "raw")
    assert tokenizer.decode(ids, skip_special_tokens=False) == "Be brief.\n\nReverse: " + task["text"] + "\n\n"
    with pytest.raises(Exception, match="chat_template"):
        env_prompt_ids(env, task, tokenizer)


def test_a_raw_prompt_starts_with_the_bos_the_tokenizer_adds_itself(tmp_path):
    """A Llama-style base tokenizer puts BOS before every text (its post-processor): the raw prompt starts with
    it, as the model saw every text in pre-training; the byte tokenizer adds none."""
    path = tiny_checkpoint(tmp_path / "base", chat_template=False)
    spec = json.loads((path / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [257], "tokens": ["<|im_start|>"]}},
    }
    (path / "tokenizer.json").write_text(json.dumps(spec))
    env = load_environment(EnvironmentConfig())
    task = env.dataset(0)[0]
    ids = env_prompt_ids(env, task, build_tokenizer(ModelConfig(name=str(path))), "raw")
    assert ids[0] == 257 and ids[1:] == list(("Reverse: " + task["text"] + "\n\n").encode())
    plain = build_tokenizer(ModelConfig(name=str(tiny_checkpoint(tmp_path / "plain", chat_template=False))))
    assert plain.prompt_prefix == [] and build_tokenizer(ModelConfig(name="qwen3-test")).prompt_prefix == []


# The real shapes, from each model's config.json on the Hugging Face hub (Qwen/Qwen3-0.6B, Qwen/Qwen3-4B,
# Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B, deepseek-ai/DeepSeek-V3.2, zai-org/GLM-5), and their published
# parameter counts: the Qwen figures are the hub's exact safetensors counts (0.6B: 596,049,920; 4B:
# 4,022,468,096; 30B-A3B: 30,532,122,624; 235B-A22B: 235,093,634,560); DeepSeek-V3.2's model card gives 685B
# including its multi-token-prediction module (counted here from the built model's last MoE layer, see below);
# GLM-5's gives 744B.
# The shapes themselves live in arbor.models.published (rl plan sizes these models without a download).
SHAPES = {
    name: (PUBLISHED_SHAPES[name], count)
    for name, count in {
        "Qwen/Qwen3-0.6B": 596_049_920,
        "Qwen/Qwen3-4B": 4_022_468_096,
        "Qwen/Qwen3-30B-A3B": 30_532_122_624,
        "Qwen/Qwen3-235B-A22B": 235_093_634_560,
        "deepseek-ai/DeepSeek-V3.2": 685_000_000_000,
        "zai-org/GLM-5": 744_000_000_000,
    }.items()
}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n == "zai-org/GLM-5" else n for n in SHAPES],  # 744B: seconds
)
def test_real_shapes_build_on_meta_with_the_published_parameter_counts(name):
    args, published = SHAPES[name]
    cls = (
        DeepseekV32ForCausalLM
        if isinstance(args, DSAArgs)
        else (Qwen3MoeForCausalLM if args.is_moe else Qwen3ForCausalLM)
    )
    with torch.device("meta"):
        model = cls(args)
    count = sum(p.numel() for p in model.parameters())
    assert count == args.num_params()
    if isinstance(args, DSAArgs) and args.num_nextn_predict_layers:
        # The checkpoint's MTP module (arbor skips it on load): one more MoE decoder layer, its own embedding and
        # head copies, two input norms, the head's norm and the [2h -> h] projection.
        h = args.hidden_size
        mtp = sum(p.numel() for p in model.model.layers[-1].parameters()) + 2 * args.vocab_size * h + 3 * h + 2 * h * h
        count += args.num_nextn_predict_layers * mtp
    assert abs(count - published) <= 1e-3 * published, f"{name}: {count:,} parameters, published {published:,}"


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the quick start: about a minute on 2 idle cores
def test_a_raw_prompt_run_of_a_users_template_less_llama_learns(tmp_path):
    """issue 34's acceptance run: the quick start with a model a user brings, a transformers `LlamaForCausalLM` of
    qwen3-tiny's shape (untied head, no q/k norm, transformers' initialisation) whose tokenizer has no chat
    template, and `prompt_format = "raw"`: SFT warm-up and 60 RL steps on the raw task text. RL adds to what the
    warm-up reached: the mean reward of the last 30 steps against the first five's, measured on eight runs of
    seed 0 (alone, beside two busy cores, two runs at once) +0.081..+0.100 (0.698 -> 0.780..0.799) and +0.082 on
    the `sync` schedule (2026-12-02). The last five steps alone are too noisy to judge by: RL at lr 1e-3 dips for
    a few steps and recovers (the sync run's steps 48-55: 0.66..0.80), and one CI run, under a loaded suite,
    ended its last five at 0.709. The rise stays under issue 34's +0.1 because RL only sharpens the warm-up's
    answer here: the warm-up scores 0.81 greedy and 0.68 sampled, and RL's sampled reward plateaus at 0.75..0.80
    from step ~20 at lr 1e-3 and 3e-4 alike (benchmarks/reverse_text_ceiling.py, docs/models.md), and TRL's
    GRPOTrainer from the same warm-up with the same settings rises less, +0.025..+0.070 on seeds 0-2
    (benchmarks/warm_start_vs_trl.py; arbor +0.075..+0.114 there). Asserted with
    half the smallest rise as margin: +0.04, and a level of at least 0.74 (the lowest seen 0.780). Seeds 1 and 2
    rose alike (+0.077 / +0.116, session 31). A smaller Llama, whose warm-up leaves more, rises by +0.1 (the next
    test)."""
    base = write_llama_of_preset(tmp_path / "base", "qwen3-tiny", chat_template=False)
    rewards = _raw_llama_run(base, tmp_path / "run", seed=0)
    first, late = sum(rewards[:5]) / 5, sum(rewards[30:]) / 30
    assert late >= first + 0.04 and late >= 0.74, (round(first, 3), round(late, 3))


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the quick start: about 25 s on 2 idle cores
def test_a_raw_prompt_run_of_a_small_users_llama_rises_by_a_tenth(tmp_path):
    """issue 34's acceptance run with a smaller tiny Llama (`SMALL_LLAMA`: 132k parameters, transformers'
    initialisation, a base model's template-less tokenizer), whose warm-up leaves RL room: SFT reaches 0.51..0.58
    over the first five RL steps, and RL adds +0.136..+0.204 over the last 30 (+0.155..+0.233 over the last five)
    on eleven runs (2026-12-03: run seeds 0-3 of checkpoint 0, seed 0 twice at once, checkpoints 1 and 2;
    2026-12-04: seeds 4-6), to 0.67..0.77. The qwen3-tiny-shaped Llama above ends at the same level from a warm-up
    that took most of the gain (docs/models.md, "A base model of your own"). Asserted on seed 0: +0.1 and a level
    of 0.62."""
    base = write_llama(tmp_path / "base", chat_template=False, **SMALL_LLAMA)
    rewards = _raw_llama_run(base, tmp_path / "run", seed=0)
    first, late = sum(rewards[:5]) / 5, sum(rewards[30:]) / 30
    assert late >= first + 0.1 and late >= 0.62, (round(first, 3), round(late, 3))


def _raw_llama_run(base: Path, out: Path, seed: int) -> list[float]:
    """The quick start with the Llama and raw prompts; its rewards."""
    res = run_example(
        "--model.name",
        str(base),
        "--orchestrator.environment.prompt-format",
        "raw",
        "--seed",
        str(seed),
        "--output-dir",
        str(out),
    )
    check_ran(res)
    assert "model: LlamaForCausalLM: arbor's native implementation" in res.stdout, res.stdout[-2000:]
    rewards = [r["reward/mean"] for r in read_jsonl(out / "metrics.jsonl")]
    assert len(rewards) == 60
    return rewards


def test_the_config_check_reads_a_cached_hub_models_shape(tmp_path, monkeypatch):
    """Expert parallelism over a dense model is refused by the config check itself when the hub id's config.json
    is in the cache; an id that is not cached passes the check untouched (the trainer checks it)."""
    use_cache(monkeypatch, tmp_path / "hf")
    hub_cache(tmp_path / "hf", "arbor-test/qwen3-test", tiny_checkpoint(tmp_path / "ckpt"))
    flags = ["--trainer.parallel.nproc", "2", "--trainer.parallel.ep", "2"]
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
        load_config(RLConfig, ["--model.name", "arbor-test/qwen3-test", *flags], env={})
    load_config(RLConfig, ["--model.name", "arbor-test/absent", *flags], env={})
