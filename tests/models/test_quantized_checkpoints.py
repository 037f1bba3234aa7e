"""Quantised checkpoints as their publishers store them (arbor.models.quantization, arbor.models.mxfp4).

gpt-oss as OpenAI publishes it (MXFP4 experts) loads into the transformers path exactly as transformers
dequantises it, trains through `rl`, and is served to vLLM as a dequantised copy (the trainer publishes
unquantised weights); quantisation methods arbor cannot read are refused in one line when the config is read.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import transformers
from hf_tiny import write_mxfp4_gpt_oss
from safetensors.torch import load_file, save_file

from arbor.config.inference import InferenceConfig
from arbor.config.model import ModelConfig
from arbor.config.rl import RLConfig
from arbor.inference.vllm import launch
from arbor.inference.vllm import model_dir as vllm_model_dir
from arbor.inference.vllm.launch import dry_run_command
from arbor.inference.vllm.model_dir import model_dir
from arbor.launch import preflight
from arbor.launch.preflight import PreflightError, check_served_copies, model_args, model_path_line
from arbor.models import build_model
from arbor.models.checkpoint_copies import write_dequantized
from arbor.models.hf import save_checkpoint_dir
from arbor.models.mxfp4 import dequantize_mxfp4, dequantize_mxfp4_state
from arbor.models.tokenizer import ByteTokenizer
from arbor.monitor.metrics import read_jsonl
from arbor.trainer.parallel_state import ParallelState
from arbor.trainer.step import packed_logprobs

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def oss(tmp_path_factory) -> Path:
    return write_mxfp4_gpt_oss(tmp_path_factory.mktemp("mxfp4") / "gpt-oss")


def _transformers_dequantised(path: Path) -> torch.nn.Module:
    """transformers' own reading of the MXFP4 checkpoint: its `Mxfp4Config(dequantize=True)` path (bf16 experts),
    in fp32 for the comparison."""
    model = transformers.GptOssForCausalLM.from_pretrained(
        path, quantization_config=transformers.Mxfp4Config(dequantize=True), attn_implementation="eager"
    )
    return model.float().eval()


def test_mxfp4_decodes_as_the_microscaling_spec_says():
    """One expert, one output row, one block of 32: byte 0x21 holds E2M1 codes 1 (0.5, the earlier element) and
    2 (1.0); 0xF8 holds -0.0 and -6.0; scale 128 is 2^1. The stored row is the tensor's column (gpt-oss stores
    its `[in, out]` experts transposed)."""
    row = [0x21, 0xF8] + [0x00] * 14
    blocks = torch.tensor(row, dtype=torch.uint8).reshape(1, 1, 1, 16)
    w = dequantize_mxfp4(blocks, torch.tensor([[[128]]], dtype=torch.uint8), torch.float32)
    assert w.shape == (1, 32, 1)
    assert w[0, :4, 0].tolist() == [1.0, 2.0, -0.0, -12.0] and not w[0, 4:].any()
    e8m0 = torch.tensor([[[128]]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert torch.equal(dequantize_mxfp4(blocks, e8m0, torch.float32), w)
    meta = dequantize_mxfp4(blocks.to("meta"), e8m0.to("meta"))
    assert meta.is_meta and meta.shape == (1, 32, 1)
    with pytest.raises(ValueError, match="has no x_scales"):
        dequantize_mxfp4_state({"x_blocks": blocks})


def test_an_mxfp4_gpt_oss_loads_as_transformers_dequantises_it(oss):
    """Every parameter of arbor's model equals transformers' dequantised one, and so do the logprobs."""
    model, ref = build_model(ModelConfig(name=str(oss), tokenizer="byte")), _transformers_dequantised(oss)
    theirs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, theirs[name.removeprefix("hf.")]), name
    ids = torch.randint(3, 250, (12,), generator=torch.Generator().manual_seed(0))
    got, _ = packed_logprobs(model, ids, torch.arange(12), [12], 1.0, CPU, state=ParallelState(logprob_chunk=16))
    with torch.no_grad():
        want = torch.log_softmax(ref(ids[None]).logits[0, :-1].float(), -1).gather(1, ids[1:, None])[:, 0]
    assert (got[1:] - want).abs().max() <= 1e-5
    assert "quantization_config" not in model.args.config  # published unquantised


def test_quantised_checkpoints_are_read_or_refused_when_the_config_is(oss, tmp_path):
    line = model_path_line(ModelConfig(name=str(oss)))
    assert line.endswith("its MXFP4 weights are dequantised to float32 on load"), line
    for quant, why in [
        ({"quant_method": "gptq", "bits": 4}, "quantised with 'gptq' (quantization_config.quant_method)"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, "quantised with fp8 without 128x128 weight blocks"),
    ]:
        other = tmp_path / quant["quant_method"]
        shutil.copytree(oss, other)
        config = json.loads((other / "config.json").read_text())
        (other / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
        with pytest.raises(PreflightError, match=re.escape(f"model.name: {other} is {why}")) as e:
            model_args(ModelConfig(name=str(other)))
        assert "\n" not in str(e.value)
    res = subprocess.run(
        [sys.executable, "-m", "arbor.launch.rl", "@", "examples/reverse_text/rl.toml", "--check"]
        + ["--model.name", str(tmp_path / "gptq"), "--output-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert res.returncode == 2 and "quantised with 'gptq'" in res.stderr and "Traceback" not in res.stderr


def test_a_dequantised_copy_is_what_vllm_serves(oss, tmp_path, monkeypatch):
    """The copy holds transformers' dequantised experts under the unquantised names, no quantization_config, the
    tokenizer; a plain `from_pretrained` reads it. `model_dir` writes it once and serves it (also in a dry run)."""
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    cfg = InferenceConfig(backend="vllm", model={"name": str(oss), "dtype": "bfloat16"})
    path, skip_tok = model_dir(cfg)
    assert path.endswith("-bfloat16-dequantized") and not skip_tok
    assert path in dry_run_command(cfg)
    config = json.loads((Path(path) / "config.json").read_text())
    assert "quantization_config" not in config and (Path(path) / "tokenizer_config.json").exists()
    tensors = load_file(f"{path}/model.safetensors")
    assert not any(k.endswith(("_blocks", "_scales")) for k in tensors)
    plain = transformers.GptOssForCausalLM.from_pretrained(path, dtype=torch.float32)
    want = dict(_transformers_dequantised(oss).named_parameters())
    for name, p in plain.named_parameters():
        assert torch.equal(p, want[name]), name
    mtime = (Path(path) / "model.safetensors").stat().st_mtime
    assert model_dir(cfg)[0] == path and (Path(path) / "model.safetensors").stat().st_mtime == mtime


def test_a_sharded_fp8_checkpoint_is_dequantised_file_by_file(tmp_path, monkeypatch):
    """A block-FP8 checkpoint (the format DeepSeek and Qwen3-*-FP8 publish) served without `model.fp8`: vLLM gets
    the dequantised weights, each in the file its weight was in, and an index naming them; arbor reads the copy
    back as it reads the original."""
    model = build_model(ModelConfig(name="qwen3-test"))
    src = tmp_path / "fp8"
    save_checkpoint_dir(model.state_dict(), model.args, src, ByteTokenizer(), fp8=True)
    state = load_file(str(src / "model.safetensors"))
    first = {k: v for k, v in state.items() if k.startswith("model.layers.0.")}
    for name, part in [("a.safetensors", first), ("b.safetensors", {k: state[k] for k in state if k not in first})]:
        save_file(part, str(src / name), metadata={"format": "pt"})
    (src / "model.safetensors").unlink()
    index = {"weight_map": {k: "a.safetensors" if k in first else "b.safetensors" for k in state}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    dst = tmp_path / "plain"
    write_dequantized(src, dst, torch.float32)
    weight_map = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    assert weight_map["model.layers.0.mlp.down_proj.weight"] == "a.safetensors"
    assert not any(k.endswith("_scale_inv") for k in weight_map)
    assert "quantization_config" not in json.loads((dst / "config.json").read_text())
    original, copy = build_model(ModelConfig(name=str(src))), build_model(ModelConfig(name=str(dst)))
    for (name, p), q in zip(original.named_parameters(), copy.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.slow  # the quick start's processes, 3 RL steps (~25 s)
def test_rl_trains_an_mxfp4_gpt_oss_and_publishes_it_unquantised(oss, tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "arbor.launch.rl", "@", "examples/reverse_text/rl.toml", "--model.name", str(oss)]
        + ["--max-steps", "3", "--sft.steps", "2", "--output-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "its MXFP4 weights are dequantised to float32 on load" in res.stdout
    assert len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == 3
    published = tmp_path / "run" / "broadcasts" / "step_3"
    assert "quantization_config" not in json.loads((published / "config.json").read_text())
    tensors = load_file(str(next(published.glob("*.safetensors"))))
    assert tensors["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.float32


def test_preflight_wants_room_for_the_dequantised_copy(oss, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    cfg = RLConfig.model_validate({"model": {"name": str(oss)}, "inference": {"backend": "vllm"}})
    check_served_copies(cfg)  # room enough
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(1 << 30, 1 << 30, 1024))
    with pytest.raises(PreflightError, match=f"served by vLLM as a dequantised copy .* under {tmp_path}, which has"):
        check_served_copies(cfg)
    model_dir(cfg.inference)  # written: nothing more to find room for
    check_served_copies(cfg)


def test_a_teacher_is_served_its_quantised_checkpoint_as_published_on_cuda(oss, tmp_path, monkeypatch):
    """A launched distillation teacher never takes updates (`rl` freezes it), so vLLM's CUDA build serves its
    quantised checkpoint as published, with vLLM's MXFP4 kernels (gpt-oss-120b in ~65 GB, not a ~230 GB bf16
    copy), and preflight finds no copy to make room for; the CPU build, whose MXFP4 kernels need AMX tiles, still
    serves the copy, and preflight checks the teacher's room for it by name."""
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    cfg = RLConfig.model_validate(
        {
            "output_dir": str(tmp_path / "run"),
            "trainer": {"loss": {"name": "distill"}},
            "teacher": {"backend": "vllm", "model": {"name": str(oss), "dtype": "bfloat16"}},
        }
    )
    assert cfg.teacher.frozen and not cfg.inference.frozen
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(1 << 30, 1 << 30, 1024))
    for module in (launch, vllm_model_dir, preflight):
        monkeypatch.setattr(module, "vllm_build", lambda: "gpu")
    assert model_dir(cfg.teacher) == (str(oss), False)
    assert f"--model {oss} " in dry_run_command(cfg.teacher)
    check_served_copies(cfg)  # nothing to write
    assert not (tmp_path / "arbor-vllm").exists()
    for module in (launch, vllm_model_dir, preflight):
        monkeypatch.setattr(module, "vllm_build", lambda: "cpu")
    with pytest.raises(PreflightError, match=r"^teacher\.model\.name .* is served by vLLM as a dequantised copy"):
        check_served_copies(cfg)
    assert model_dir(cfg.teacher)[0].endswith("-bfloat16-dequantized")
