"""Checkpoint manifests: damage of every kind is named in one line, a resume falls back to the newest intact step
and keeps the damaged one aside; a full disk at each light writer is one line naming the path and the size."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch

from arbor import checkpoint_manifest as cm
from arbor import run_dir
from arbor.launch.process import stopped_child
from arbor.models.family import UnsupportedArchitecture
from arbor.monitor.metrics import append_jsonl, read_jsonl, truncate_jsonl
from arbor.orchestrator.state import OrchestratorState, load_state, save_state
from arbor.transport.batch import StepBatch
from arbor.transport.files import write_step
from arbor.weights.shards import write_shard


def _checkpoint(out: Path, step: int, size: int = 64 * 1024) -> Path:
    """A complete checkpoint as the trainer writes it: shards, `.metadata`, the manifest, `DONE`; and the
    orchestrator state beside it."""
    d = run_dir.checkpoint_dir(out, step)
    d.mkdir(parents=True)
    for rank in (0, 1):
        (d / f"__{rank}_0.distcp").write_bytes(bytes((step + rank + i) % 251 for i in range(size)))
    (d / ".metadata").write_bytes(b"metadata" * 10)
    cm.write_manifest(d)
    run_dir.write_text_atomic(d / run_dir.DONE, str(step))
    save_state(out, OrchestratorState(step=step, position=step * 3))
    return d


def _flip(path: Path, at: int, n: int = 4096) -> None:
    data = bytearray(path.read_bytes())
    data[at : at + n] = bytes(b ^ 0xFF for b in data[at : at + n])
    path.write_bytes(data)


def test_an_intact_checkpoint_verifies(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 4)
    assert cm.verify_step(tmp_path, 4, orchestrator=True) is None
    manifest = json.loads((run_dir.checkpoint_dir(tmp_path, 4) / cm.MANIFEST).read_text())
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # DONE is not in it


@pytest.mark.parametrize("damage", ["flipped", "truncated", "missing", "manifest", "state", "state_missing"])
def test_each_kind_of_damage_is_one_line_naming_the_file(tmp_path: Path, damage: str) -> None:
    d = _checkpoint(tmp_path, 8)
    shard = d / "__0_0.distcp"
    state = run_dir.orchestrator_state_path(tmp_path, 8)
    if damage == "flipped":
        _flip(shard, 30_000)  # same size, other bytes
    elif damage == "truncated":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif damage == "missing":
        shard.unlink()
    elif damage == "manifest":
        (d / cm.MANIFEST).write_text("{not json")
    elif damage == "state":
        state.write_text(state.read_text().replace('"position": 24', '"position": 25'))
    else:
        state.unlink()
    problem = cm.verify_step(tmp_path, 8, orchestrator=True)
    assert problem is not None and "\n" not in problem
    named = {"manifest": cm.MANIFEST, "state": "orchestrator.json", "state_missing": "orchestrator.json"}
    assert named.get(damage, "__0_0.distcp") in problem
    if damage == "truncated":
        assert "truncated" in problem
    if damage in ("state", "state_missing"):
        with pytest.raises(cm.CheckpointDamaged, match="orchestrator.json"):
            load_state(tmp_path, 8)


def test_resume_falls_back_to_the_newest_intact_step_and_keeps_the_damaged_one_aside(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 4)
    _flip(_checkpoint(tmp_path, 8) / "__1_0.distcp", 1000)
    said: list[str] = []
    assert cm.resume_step(tmp_path, "previous", orchestrator=True, say=said.append) == 4
    assert len(said) == 1 and "step 8" in said[0] and "__1_0.distcp" in said[0] and "step_8.damaged" in said[0]
    aside = run_dir.checkpoints_root(tmp_path) / "step_8.damaged"
    assert (aside / "trainer" / "__1_0.distcp").exists()  # kept, not deleted
    assert run_dir.latest_checkpoint(tmp_path) == 4 and run_dir.damaged_checkpoints(tmp_path) == 1
    assert load_state(tmp_path, 4).position == 12

    _flip(_checkpoint(tmp_path, 8) / "__0_0.distcp", 0)  # damaged again on a later attempt: a second place aside
    assert cm.resume_step(tmp_path, "previous", orchestrator=True, say=said.append) == 4
    assert run_dir.damaged_checkpoints(tmp_path) == 2


def test_on_damage_fail_refuses_in_one_line_and_moves_nothing(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 4)
    _flip(_checkpoint(tmp_path, 8) / "__0_0.distcp", 10)
    with pytest.raises(cm.CheckpointDamaged, match=r"checkpoint step 8 is damaged: .*__0_0.distcp.*'fail'"):
        cm.resume_step(tmp_path, "fail", orchestrator=True, say=print)
    assert run_dir.latest_checkpoint(tmp_path) == 8


def test_no_intact_step_resumes_from_scratch(tmp_path: Path) -> None:
    (_checkpoint(tmp_path, 4) / "__0_0.distcp").unlink()
    assert cm.resume_step(tmp_path, "previous", orchestrator=False, say=lambda _: None) is None


def test_checkpoints_and_states_written_before_manifests_are_taken_as_they_are(tmp_path: Path) -> None:
    d = _checkpoint(tmp_path, 4)
    (d / cm.MANIFEST).unlink()
    run_dir.orchestrator_state_path(tmp_path, 4).write_text(json.dumps({"step": 4, "position": 7}))
    assert cm.verify_step(tmp_path, 4, orchestrator=True) is None
    assert load_state(tmp_path, 4).position == 7


def test_the_checksum_is_the_published_weights_one(tmp_path: Path) -> None:
    """One CRC-32 for checkpoints and broadcasts: a shard's manifest checksum equals write_shard's."""
    path = tmp_path / "model.safetensors"
    digest = write_shard(path, {"w": torch.arange(1000, dtype=torch.float32)})
    assert cm.file_digest(path) == (path.stat().st_size, digest)


def test_format_bytes_picks_the_unit_that_fits() -> None:
    assert run_dir.format_bytes(512) == "512 B"
    assert run_dir.format_bytes(3 * 2**20) == "3.0 MiB"
    assert run_dir.format_bytes(int(1.5 * 2**30)) == "1.5 GiB"
    assert run_dir.format_bytes(40_000) == "39.1 KiB"  # never "0.0 GB"


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _one_disk_full_line(error: BaseException, path: Path, size: str) -> None:
    message = str(error)
    assert isinstance(error, run_dir.DiskFullError) and "\n" not in message
    assert message.startswith("disk full: writing ") and str(path) in message and size in message


def test_enospc_at_the_rollout_writer_is_one_line_and_leaves_no_file(tmp_path: Path, monkeypatch) -> None:
    batch = StepBatch(step=3, micro_batches=[], loss_tokens_total=0, num_samples_total=0, temperature=1.0)
    monkeypatch.setattr("arbor.transport.files.save_file", _no_space)
    with pytest.raises(run_dir.DiskFullError) as e:
        write_step(tmp_path, 3, [batch])
    _one_disk_full_line(e.value, run_dir.rollout_rank_file(tmp_path, 3, 0), "0 B")
    assert list(run_dir.rollout_step_dir(tmp_path, 3).iterdir()) == []  # no half-written file, no temporary


def test_enospc_at_the_metrics_writer_is_one_line_and_a_torn_line_is_dropped(tmp_path: Path, monkeypatch) -> None:
    path = run_dir.metrics_path(tmp_path)
    append_jsonl(path, {"step": 0, "loss": 1.0})
    with open(path, "a") as f:
        f.write('{"step": 1, "lo')  # what a disk that filled mid-line leaves
    assert [r["step"] for r in read_jsonl(path)] == [0]
    truncate_jsonl(path, 1)
    assert path.read_text().endswith("}\n")
    monkeypatch.setattr("builtins.open", _no_space)
    with pytest.raises(run_dir.DiskFullError) as e:
        append_jsonl(path, {"step": 1, "loss": 0.5})
    _one_disk_full_line(e.value, path, "B")


def test_enospc_at_the_broadcast_writer_is_one_line(tmp_path: Path, monkeypatch) -> None:
    path = run_dir.broadcast_staging_dir(tmp_path, 2) / "model.safetensors"
    path.parent.mkdir(parents=True)
    monkeypatch.setattr("builtins.open", _no_space)
    with pytest.raises(run_dir.DiskFullError) as e:
        write_shard(path, {"w": torch.zeros(256, 1024)})
    _one_disk_full_line(e.value, path, "1.0 MiB")


def test_enospc_at_the_state_writer_is_one_line_and_stop_cleanly_prints_it(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setattr("os.replace", _no_space)

    def work() -> int:
        save_state(tmp_path, OrchestratorState(step=5))
        return 0

    assert cm.stop_cleanly(work) == run_dir.DISK_FULL_EXIT
    line = capsys.readouterr().err.strip()
    assert line.startswith(run_dir.STOP_PREFIX + "disk full: writing ") and "orchestrator.json" in line
    assert "\n" not in line and not run_dir.orchestrator_state_path(tmp_path, 5).exists()


def test_a_model_a_process_cannot_build_stops_it_on_one_line_that_rl_shows(tmp_path: Path, capsys) -> None:
    """`UnsupportedArchitecture` raised where a process builds its model (the transformers path's two-token
    forward) ends it with exit status 2 and one stop line; the launcher's error is that line, its status 2."""

    def work() -> int:
        raise UnsupportedArchitecture("model.name: XForCausalLM failed a two-token forward (TypeError: no\nmask)")

    assert cm.stop_cleanly(work) == 2
    line = capsys.readouterr().err.strip()
    assert line == run_dir.STOP_PREFIX + "model.name: XForCausalLM failed a two-token forward (TypeError: no mask)"
    log = tmp_path / "inference.log"
    log.write_text("loading\n" + line + "\n")
    failed = stopped_child("inference", 2, log)
    assert str(failed) == "inference stopped: " + line[len(run_dir.STOP_PREFIX) :] and failed.exit_code == 2
    assert stopped_child("trainer", 1, log).exit_code == 1  # torchrun's status is 1 whatever its rank's was
    log.write_text("Traceback (most recent call last):\n  ...\nValueError: x\n")
    assert stopped_child("inference", 1, log) is None  # no stop line: the launcher shows the log's tail
