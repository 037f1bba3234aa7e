"""arbor.trainer.republish.RolloutWait: between steps the trainer answers the orchestrator's request to publish a
refused version again, once, with the weights it holds, and finds a request moot when a version at least as new is
published; on 2 gloo ranks whose rollout files and view of the request differ, both ranks publish together."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_transport import _batch

from arbor.launch.process import free_port as _free_port
from arbor.run_dir import STABLE, broadcast_dir
from arbor.trainer.republish import RolloutWait
from arbor.transport.files import write_step
from arbor.transport.republish import request_republish


def _publish(out: Path, version: int) -> None:
    d = broadcast_dir(out, version)
    d.mkdir(parents=True, exist_ok=True)
    (d / STABLE).write_text(str(version))


def _waiter(out: Path, published: list[int], then_write: int | None = None, start: int = 0) -> RolloutWait:
    """A world of one whose republish records the version and publishes it; `then_write`: the orchestrator,
    served again, then writes that step's rollouts."""

    def republish(version: int) -> None:
        published.append(version)
        _publish(out, version)
        if then_write is not None:
            write_step(out, then_write, [_batch(then_write, 8, 1)])

    return RolloutWait(out, 0, 30.0, republish, start, torch.device("cpu"))


def test_a_request_is_answered_once_with_the_weights_held(tmp_path, capsys):
    published: list[int] = []
    wait = _waiter(tmp_path, published, then_write=2)
    request_republish(tmp_path, 2, "model.safetensors: crc32 1a2b3c4d does not match the manifest's 9f8e7d6c")
    assert wait.batch(2).step == 2  # no rollouts until version 2 is served again: the request is answered first
    assert published == [2] and wait.republished == 1
    assert "refused weights version 2 (model.safetensors: crc32 1a2b3c4d" in capsys.readouterr().err
    write_step(tmp_path, 3, [_batch(3, 8, 1)])
    assert wait.batch(3).step == 3 and published == [2]  # answered: the request left behind is not answered again


def test_a_request_a_newer_publish_answers_already_is_moot(tmp_path, capsys):
    published: list[int] = []
    wait = _waiter(tmp_path, published)
    request_republish(tmp_path, 2, "refused")
    _publish(tmp_path, 3)  # the trainer moved on and published version 3 meanwhile
    write_step(tmp_path, 3, [_batch(3, 8, 1)])
    assert wait.batch(3).step == 3 and published == [] and wait.republished == 0
    assert "republish request for version 2 is moot: version 3 is published" in capsys.readouterr().err


def test_a_request_older_than_a_resume_is_not_answered(tmp_path):
    published: list[int] = []
    request_republish(tmp_path, 4, "an earlier attempt's")
    write_step(tmp_path, 5, [_batch(5, 8, 1)])
    assert _waiter(tmp_path, published, start=5).batch(5).step == 5 and published == []


def test_the_wait_still_times_out_naming_the_file(tmp_path):
    wait = RolloutWait(tmp_path, 1, 0.2, lambda v: None, 0, torch.device("cpu"))
    with pytest.raises(TimeoutError, match="rank_1.safetensors never appeared"):
        wait.batch(4)


def _rank(rank: int, world: int, port: int, out: str) -> None:
    """Rank 0 has its rollouts of step 2 already, rank 1 not: only the request gets rank 1 to the agreement, and
    both take part in one publish (rank 1's, as the orchestrator served again, then writes its file)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    calls: list[int] = []

    def republish(version: int) -> None:
        calls.append(version)
        dist.barrier()  # collective, as the real publish is
        if rank == 0:
            _publish(Path(out), version)
            write_step(out, 2, [_batch(2, 8, 1), _batch(2, 8, 2)])

    wait = RolloutWait(out, rank, 60.0, republish, 0, torch.device("cpu"))
    batch = wait.batch(2)
    assert batch.step == 2 and calls == [2] and wait.republished == 1, (rank, calls)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads may abort the interpreter's teardown after a successful run


@pytest.mark.slow  # spawns 2 ranks
def test_two_ranks_agree_and_publish_together_though_only_one_has_its_file(tmp_path):
    write_step(tmp_path, 2, [_batch(2, 8, 1)])  # rank 0's file only (write_step writes rank 0's first)
    request_republish(tmp_path, 2, "refused")
    mp.start_processes(_rank, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
