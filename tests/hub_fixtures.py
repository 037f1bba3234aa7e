"""Test helpers for Hugging Face checkpoints without a download: a tiny checkpoint directory (a preset saved with
the byte tokenizer's Hugging Face export, optionally without its chat template, as a base model ships), and a
fake Hugging Face cache holding it under a hub id, laid out as `hf download` leaves it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from huggingface_hub import constants

from arbor.config.model import ModelConfig
from arbor.models import build_model, build_tokenizer
from arbor.models.hf import save_checkpoint_dir

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def tiny_checkpoint(path: Path, preset: str = "qwen3-test", chat_template: bool = True) -> Path:
    """`preset` saved as a Hugging Face checkpoint whose tokenizer arbor loads as a Hugging Face tokenizer (the
    byte tokenizer's export without arbor's marker); `chat_template=False` drops the template."""
    cfg = ModelConfig(name=preset)
    model = build_model(cfg)
    save_checkpoint_dir(model.state_dict(), model.args, path, build_tokenizer(cfg))
    (path / "arbor_tokenizer.json").unlink()
    if not chat_template:
        config = json.loads((path / "tokenizer_config.json").read_text())
        del config["chat_template"]
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def hub_cache(hf_home: Path, repo_id: str, files: Path) -> Path:
    """Puts the directory `files` into the cache under `hf_home` as the main revision of `repo_id`; returns the
    snapshot directory."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(files, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def use_cache(monkeypatch, hf_home: Path) -> None:
    """Points this process (and its children) at the cache under `hf_home`, offline: nothing is downloaded."""
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))  # read at import time by the library
