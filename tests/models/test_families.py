"""Model families (arbor.models.family): a family added the way a user adds one (one module, one registry line)
is built by `build_model` with no other change; every registered family satisfies the interface; a checkpoint
no family serves is refused in one line naming `model.name`, through `rl`'s preflight."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers

from arbor.config.model import ModelConfig
from arbor.models import build_model, model_args
from arbor.models.args import ModelArgs
from arbor.models.family import ModelFamily, UnsupportedArchitecture, args_from_config, family_for, family_of
from arbor.models.hf import save_checkpoint_dir
from arbor.models.presets import PRESETS
from arbor.models.qwen3 import Qwen3ForCausalLM
from arbor.registry import MODEL_FAMILIES, Member

REPO = Path(__file__).resolve().parents[2]

TOY_MODULE = """
import dataclasses

from arbor.models.families.qwen3 import Qwen3Family


@dataclasses.dataclass(frozen=True)
class ToyFamily(Qwen3Family):
    architectures: tuple[str, ...] = ("ToyForCausalLM",)
    model_types: tuple[str, ...] = ("toy",)


TOY = ToyFamily()
"""


@pytest.fixture
def toy_family(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The user's two steps: a module defining the family, and its line in MODEL_FAMILIES."""
    (tmp_path / "toy_family.py").write_text(textwrap.dedent(TOY_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(MODEL_FAMILIES.members, "ToyForCausalLM", Member("toy_family:TOY"))
    return "ToyForCausalLM"


def test_a_family_added_as_one_module_and_one_registry_line_is_built_by_build_model(tmp_path, toy_family):
    source = build_model(ModelConfig(name="qwen3-test", init_seed=3))
    args = dataclasses.replace(source.args, architecture=toy_family)
    ckpt = tmp_path / "toy-ckpt"
    save_checkpoint_dir(source.state_dict(), args, ckpt)
    assert '"ToyForCausalLM"' in (ckpt / "config.json").read_text()

    cfg = ModelConfig(name=str(ckpt))
    assert type(family_of(model_args(cfg))).__name__ == "ToyFamily"
    model = build_model(cfg)
    assert type(model) is Qwen3ForCausalLM and model.args.architecture == toy_family
    ids = torch.tensor([[5, 9, 200, 17, 3]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), source(ids), rtol=0, atol=0)
    assert ModelArgs.from_dir(ckpt).architecture == toy_family


def _sample_args(arch: str, family: ModelFamily):
    """A preset of `family` read back under `arch` (a family serving several names has one preset for all)."""
    preset = next(a for a in PRESETS.values() if family_for(a.architecture) is family)
    return family.from_hf_config({**family.to_hf_config(preset), "architectures": [arch]})


@pytest.mark.parametrize("arch", MODEL_FAMILIES.names())
def test_every_registered_family_satisfies_the_interface(arch):
    family = MODEL_FAMILIES.load(arch)
    assert isinstance(family, ModelFamily)
    assert arch in family.architectures
    assert all(isinstance(flag, bool) for flag in (family.supports_mtp, family.supports_moe, family.dsa))
    args = _sample_args(arch, family)
    assert isinstance(args, family.args_class) and args.architecture == arch
    assert family.from_hf_config(family.to_hf_config(args)) == args  # config.json round trip (read back)
    assert args.num_params() > 0
    model = family.build(args)
    assert model.args is args
    model.init_weights(0)  # what build_model does for a preset (the build leaves weights uninitialised)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    back = family.from_hf_state(family.to_hf_state(state, args), args)  # parameter names round trip
    assert sorted(back) == sorted(state)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    assert getattr(args, "is_moe", False) <= family.supports_moe
    assert getattr(args, "is_dsa", False) == family.dsa


def test_every_preset_and_known_model_type_resolves_to_its_family():
    for name, args in PRESETS.items():
        assert args.architecture in family_for(args.architecture).architectures, name
    # a config.json without `architectures`: its model_type names the family
    moe = PRESETS["qwen3-moe-test"].to_hf_config()
    del moe["architectures"]
    assert args_from_config(moe).architecture == "Qwen3MoeForCausalLM"
    dsa = PRESETS["dsa-test"].to_hf_config()
    del dsa["architectures"]
    assert args_from_config(dsa).architecture == "DeepseekV32ForCausalLM"


def test_an_mtp_depth_on_a_family_without_mtp_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^model\.mtp_depth: 'dsa-test' is a DeepseekV32ForCausalLM model; arbor"):
        model_args(ModelConfig(name="dsa-test", mtp_depth=1))


def test_reading_configs_through_the_families_loads_no_torch():
    code = (
        "import sys\n"
        "from arbor.registry import MODEL_FAMILIES\n"
        "from arbor.models import ModelArgs, model_args\n"
        "from arbor.models.presets import PRESETS\n"
        "for name in MODEL_FAMILIES.names():\n"
        "    f = MODEL_FAMILIES.load(name)\n"
        "for a in PRESETS.values():\n"
        "    f = MODEL_FAMILIES.load(a.architecture)\n"
        "    assert f.from_hf_config(f.to_hf_config(a)).architecture == a.architecture\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


@pytest.fixture
def llama_dir(tmp_path: Path) -> Path:
    """A real transformers-written tiny Llama checkpoint (nothing downloaded) whose config names an architecture
    neither arbor nor transformers builds."""
    config = transformers.LlamaConfig(
        vocab_size=264,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    path = tmp_path / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "architectures": ["NoSuchForCausalLM"]}))
    return path


def test_an_unsupported_architecture_is_one_line_naming_model_name(llama_dir):
    with pytest.raises(UnsupportedArchitecture) as e:
        ModelArgs.from_dir(llama_dir)
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith(
        f"model.name: {llama_dir} is a 'NoSuchForCausalLM' checkpoint; arbor builds Qwen3ForCausalLM"
    )
    assert line.endswith("has no class 'NoSuchForCausalLM')")


@pytest.mark.slow  # starts `rl --check`
def test_rl_check_refuses_an_unsupported_checkpoint_in_one_line_without_a_traceback(tmp_path, llama_dir):
    out = tmp_path / "run"
    res = subprocess.run(
        [sys.executable, "-m", "arbor.launch.rl", "@", str(REPO / "examples/reverse_text/rl.toml")]
        + ["--output-dir", str(out), "--model.name", str(llama_dir), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr + res.stdout
    assert len(lines) == 1, res.stderr
    assert (
        lines[0]
        .partition(" ")[2]
        .startswith(
            f"error: model.name: {llama_dir} is a 'NoSuchForCausalLM' checkpoint; arbor builds Qwen3ForCausalLM, "
        )
    )
    assert not (out / "logs").exists()
