"""The checkpoint copies vLLM is started from (arbor.models.checkpoint_copies): a user's checkpoint served with
`model.fp8 = "block"` is quantised one safetensors file at a time, never by building the model (which put a whole
GLM-5 or Qwen3-235B in one process's host memory before vLLM started), into exactly what arbor's own FP8 writer
makes of the model; a published FP8 checkpoint (DeepSeek's layout, experts quantised, an MTP layer) is brought
to arbor's form; and the servers of a machine write a copy once between them."""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
import transformers
from hub_fixtures import hub_cache, tiny_checkpoint, use_cache
from safetensors.torch import load_file, save_file

from arbor.config.inference import InferenceConfig
from arbor.config.model import ModelConfig
from arbor.config.rl import RLConfig
from arbor.inference.vllm import model_dir as vllm_model_dir
from arbor.inference.vllm.launch import dry_run_command
from arbor.launch.preflight import PreflightError, check_served_copies
from arbor.models import build_model
from arbor.models.checkpoint_copies import write_once
from arbor.models.fp8 import FP8
from arbor.models.hf import hf_state_dict, save_checkpoint_dir
from arbor.models.quantization import block_fp8_bytes, high_precision_modules
from arbor.models.tokenizer import ByteTokenizer


def _fp8_copy(source: Path, tmp_path: Path, monkeypatch, dtype: str = "bfloat16") -> Path:
    """`model_dir`'s FP8 directory for `source`, with the model builder unavailable (it must not be needed)."""
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))

    def no_build(*args, **kwargs):
        raise AssertionError("the FP8 copy of a checkpoint must not build the model")

    monkeypatch.setattr(vllm_model_dir, "build_model", no_build)
    cfg = InferenceConfig(backend="vllm", model={"name": str(source), "fp8": "block", "dtype": dtype})
    path, _ = vllm_model_dir.model_dir(cfg)
    monkeypatch.undo()
    return Path(path)


def _files(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {f.name: load_file(str(f)) for f in sorted(path.glob("*.safetensors"))}


def test_a_users_checkpoint_is_quantised_file_by_file_into_what_arbors_writer_makes(tmp_path, monkeypatch):
    """A Qwen3-MoE checkpoint written by transformers in bfloat16 and sharded over several files: the FP8 copy keeps
    the shards (each tensor in the file it was in, the index naming them), holds exactly the tensors arbor's own
    FP8 writer makes of the loaded model (attention and dense projections e4m3 with their scales, routers and
    routed experts in bfloat16), and its config.json is the checkpoint's own plus the block-FP8
    `quantization_config` listing the high-precision modules. Asked again, it is not written again."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=264, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=2, mlp_only_layers=[], tie_word_embeddings=False,
    )  # fmt: skip
    config.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(0)
    source = tmp_path / "qwen3-moe"
    transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(source, max_shard_size="100KB")
    ByteTokenizer().save(source)
    shards = _files(source)
    assert len(shards) > 2 and (source / "model.safetensors.index.json").exists()

    copy = _fp8_copy(source, tmp_path, monkeypatch)
    assert copy != source and copy.name.endswith("-fp8")
    written = _files(copy)
    assert written.keys() == shards.keys() and (copy / "tokenizer_config.json").exists()
    for f, tensors in written.items():  # every weight where it was, its scale beside it
        assert {k.removesuffix("_scale_inv") for k in tensors} == set(shards[f]), f
    index = json.loads((copy / "model.safetensors.index.json").read_text())["weight_map"]
    assert index == {k: f for f, tensors in written.items() for k in tensors}

    model = build_model(ModelConfig(name=str(source), dtype="bfloat16"))
    want = hf_state_dict(model.state_dict(), model.args, fp8=True)
    got = {k: v for tensors in written.values() for k, v in tensors.items()}
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert got["model.layers.0.self_attn.q_proj.weight"].dtype == FP8
    assert got["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == torch.bfloat16

    served = json.loads((copy / "config.json").read_text())
    assert {k: v for k, v in served.items() if k != "quantization_config"} == json.loads(
        (source / "config.json").read_text()
    )  # the checkpoint's own fields, every one
    assert served["quantization_config"]["weight_block_size"] == [128, 128]
    assert served["quantization_config"]["modules_to_not_convert"] == high_precision_modules(model.args)
    mtime = (copy / "config.json").stat().st_mtime_ns
    assert _fp8_copy(source, tmp_path, monkeypatch) == copy and (copy / "config.json").stat().st_mtime_ns == mtime


def test_a_published_deepseek_fp8_checkpoint_is_brought_to_arbors_form(tmp_path, monkeypatch):
    """DeepSeek-V3.2 as published: every linear FP8 (the routed experts too) and an MTP layer after the decoder.
    Served with `model.fp8 = "block"` (mtp_depth 0), the copy leaves the MTP layer out (config and weights),
    dequantises the experts and MLA's kv_b_proj to the model's dtype, and re-quantises the rest: exactly arbor's
    own FP8 writing of the model the checkpoint loads as."""
    model = build_model(ModelConfig(name="dsa-moe-test"))
    model.init_weights(5, std=0.2)
    source = tmp_path / "deepseek"
    save_checkpoint_dir(model.state_dict(), model.args, source, ByteTokenizer())
    state = load_file(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    L = config["num_hidden_layers"]
    from arbor.models.fp8 import quantize_blocks

    published = {}
    for k, v in state.items():  # DeepSeek quantises every 2-D linear weight but the router and the head
        if v.dim() == 2 and k.endswith("proj.weight"):
            q, s = quantize_blocks(v)
            published[k] = q[: v.shape[0], : v.shape[1]].contiguous()
            published[k[: -len("weight")] + "weight_scale_inv"] = s
        else:
            published[k] = v
    mtp = {
        f"model.layers.{L}.{k.split('.', 3)[3]}": v.clone()
        for k, v in published.items()
        if k.startswith("model.layers.0.")
    }
    save_file({**published, **mtp}, str(source / "model.safetensors"))
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    config |= {"num_nextn_predict_layers": 1, "quantization_config": quant}
    (source / "config.json").write_text(json.dumps(config))
    assert any(k.startswith("model.layers.1.mlp.experts.") and published[k].dtype == FP8 for k in published)

    copy = _fp8_copy(source, tmp_path, monkeypatch, dtype="float32")
    served = json.loads((copy / "config.json").read_text())
    assert served["num_nextn_predict_layers"] == 0
    got = load_file(str(copy / "model.safetensors"))
    assert not any(k.startswith(f"model.layers.{L}.") for k in got)
    loaded = build_model(ModelConfig(name=str(source)))
    want = hf_state_dict(loaded.state_dict(), loaded.args, fp8=True)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert got["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == torch.float32
    assert f"--model {copy} " in dry_run_command(
        InferenceConfig(backend="vllm", model={"name": str(copy), "fp8": "block"})
    )


def test_the_servers_of_a_machine_write_a_copy_once(tmp_path):
    """Replicas started together on one node ask for the same copy at once: one writes it (into a partial
    directory, renamed into place), the others wait for it and use it; a copy cut short is written again."""
    calls = []

    def write(partial: Path) -> None:
        calls.append(partial)
        partial.mkdir()
        time.sleep(0.2)
        (partial / "config.json").write_text("{}")

    out = tmp_path / "copy"
    threads = [threading.Thread(target=write_once, args=(out, write)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and (out / "config.json").exists() and not calls[0].exists()
    (out / "config.json").unlink()  # cut short: no config.json
    write_once(out, write)
    assert len(calls) == 2 and (out / "config.json").exists()


@pytest.mark.parametrize("fp8", [True, False])
def test_a_preset_is_still_built_and_written(fp8, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    cfg = InferenceConfig(backend="vllm", model={"name": "qwen3-test", "fp8": "block" if fp8 else "none"})
    path = Path(vllm_model_dir.model_dir(cfg)[0])
    assert (path / "config.json").exists() and (path / "tokenizer_config.json").exists()
    assert ("quantization_config" in json.loads((path / "config.json").read_text())) == fp8


def test_preflight_wants_room_for_the_block_fp8_copy(tmp_path, monkeypatch):
    """`model.fp8 = "block"` on vLLM with an unquantised checkpoint: preflight finds room for its FP8 copy under
    $TMPDIR (about a byte a parameter, the high-precision experts, routers and embeddings at the model's width)
    or says in one line where to point TMPDIR; a checkpoint already in that form needs none."""
    model = build_model(ModelConfig(name="qwen3-moe-test"))
    source = tmp_path / "ckpt"
    save_checkpoint_dir(model.state_dict(), model.args, source, ByteTokenizer())
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    cfg = RLConfig.model_validate(
        {
            "model": {"name": str(source), "fp8": "block"},
            "inference": {"backend": "vllm"},
            "weights": {"kind": "filesystem"},
        }
    )
    check_served_copies(cfg)  # room enough
    need = block_fp8_bytes(model.args, 4)
    assert model.args.num_params() < need < 4 * model.args.num_params()
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(1 << 30, 1 << 30, need - 1))
    with pytest.raises(
        PreflightError, match=r'^model\.name .* is served by vLLM as its block-FP8 copy \(model\.fp8 = "block"\)'
    ):
        check_served_copies(cfg)
    copy = Path(vllm_model_dir.model_dir(cfg.inference)[0])  # written: nothing more to find room for
    check_served_copies(cfg)
    size = sum(f.stat().st_size for f in copy.glob("*.safetensors"))
    assert abs(size - need) < 0.05 * need  # the estimate is the size, within its scales and headers
    already = {"model": {"name": str(copy), "fp8": "block"}, "inference": {"backend": "vllm"}}
    check_served_copies(RLConfig.model_validate(already))  # already block FP8: served as it is, no copy


def test_a_hub_checkpoint_is_served_from_its_fp8_copy(tmp_path, monkeypatch):
    """`model.name` a hub id in the local cache, as the GLM-5 and Qwen3-235B recipes name theirs: the FP8 copy is
    made from the cached snapshot (this used to build the whole model, the name not being a directory), under
    `arbor-vllm/<org>/`, and preflight measures the room on the disk that will hold it (no such directory yet)."""
    use_cache(monkeypatch, tmp_path / "hf")
    hub_cache(tmp_path / "hf", "org/moe-model", tiny_checkpoint(tmp_path / "ckpt", "qwen3-moe-test"))
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    cfg = RLConfig.model_validate(
        {"model": {"name": "org/moe-model", "fp8": "block"}, "inference": {"backend": "vllm"}}
    )
    check_served_copies(cfg)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(1 << 30, 1 << 30, 1024))
    with pytest.raises(PreflightError, match=rf"model\.name org/moe-model .* under {tmp_path / 'tmp'}, which has"):
        check_served_copies(cfg)
    monkeypatch.undo()
    use_cache(monkeypatch, tmp_path / "hf")
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    copy = _fp8_copy_of_hub("org/moe-model", monkeypatch)
    assert copy.is_relative_to(tmp_path / "tmp" / "arbor-vllm" / "org")
    assert load_file(str(copy / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"].dtype == FP8


def _fp8_copy_of_hub(name: str, monkeypatch) -> Path:
    def no_build(*args, **kwargs):
        raise AssertionError("the FP8 copy of a checkpoint must not build the model")

    monkeypatch.setattr(vllm_model_dir, "build_model", no_build)
    return Path(vllm_model_dir.model_dir(InferenceConfig(backend="vllm", model={"name": name, "fp8": "block"}))[0])
