"""The persistent experience buffer: late rewards, the three sampling orders, exactly-once claims across a
restart, and a killed-and-resumed `rl` run in which no rollout is lost or trained twice."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess

import pytest

from arbor.orchestrator.buffer import ExperienceBuffer
from arbor.orchestrator.rollout import Rollout


def _group(tag: float, advs=(0.5, -0.5)):
    return [Rollout(0, [1], [2], [-1.0], [0], f"g{tag}", "stop", tag, advantage=a) for a in advs]


def test_late_rewards_orders_and_release(tmp_path):
    buf = ExperienceBuffer(tmp_path / "buffer.sqlite")
    assert buf.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    buf.put_group(_group(1.0, (0.1, -0.1)), "a")
    late = buf.put_group(_group(2.0, (2.0, -2.0)), "b", ready=False)  # rewards still to come
    buf.put_group(_group(3.0, (1.0, -1.0)), "c")
    assert buf.counts() == {"buffer/rollouts": 6, "buffer/not_ready": 2, "buffer/unclaimed": 6}
    assert [g[0].text for g in buf.claim(5, step=0, order="priority")] == ["g3.0", "g1.0"]  # b is not ready
    for i in late:
        buf.set_reward(i, 7.0)
    (b,) = buf.claim(5, step=1, order="fifo")
    assert b[0].text == "g2.0" and b[0].reward == 7.0
    assert buf.claim(5, step=2) == []  # everything claimed
    assert buf.release(1) == 2  # step 1's claim returns; step 0's stays
    assert [g[0].text for g in buf.claim(5, step=1, order="recency")] == ["g2.0"]
    buf.close()
    again = ExperienceBuffer(tmp_path / "buffer.sqlite")  # a restart keeps everything
    assert again.counts()["buffer/rollouts"] == 6 and again.counts()["buffer/unclaimed"] == 0
    with pytest.raises(KeyError):
        again.set_reward(999, 1.0)


@pytest.mark.slow
def test_killed_orchestrator_resumes_with_no_rollout_lost_or_trained_twice(tmp_path):
    from test_rl_e2e import _finish, _rl, _wait_for

    from arbor.monitor.metrics import read_jsonl
    from arbor.run_dir import latest_checkpoint

    out = tmp_path / "run"
    args = ("--max-steps", "12", "--trainer.ckpt.interval", "2", "--orchestrator.buffer.enabled", "true")
    proc = _rl(out, *args)
    _wait_for(
        lambda: latest_checkpoint(out) is not None and len(read_jsonl(out / "metrics.jsonl")) >= 3,
        180,
        "a checkpoint and three steps",
    )
    pids = subprocess.run(
        ["pgrep", "-f", f"arbor.orchestrator.main @ {out}"], capture_output=True, text=True
    ).stdout.split()
    assert pids, "orchestrator process not found"
    for pid in pids:
        os.kill(int(pid), signal.SIGKILL)  # the orchestrator dies mid-run; the launcher stops the rest
    proc.wait(timeout=120)
    db = sqlite3.connect(out / "buffer.sqlite")
    before = {i for (i,) in db.execute("SELECT id FROM rollouts")}
    db.close()
    assert before
    rc, stdout, stderr = _finish(_rl(out, *args, "--resume"))
    assert rc == 0, stderr + stdout
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == list(range(12))
    db = sqlite3.connect(out / "buffer.sqlite")
    after = {i for (i,) in db.execute("SELECT id FROM rollouts")}
    assert before <= after  # nothing written before the kill was lost
    live = db.execute("SELECT rollout_id, COUNT(*) FROM claims WHERE released = 0 GROUP BY rollout_id").fetchall()
    assert all(n == 1 for _, n in live)  # none trained twice
    per_step = dict(db.execute("SELECT step, COUNT(*) FROM claims WHERE released = 0 GROUP BY step").fetchall())
    assert per_step == {s: 16 for s in range(12)}  # every step trained exactly one batch from the buffer
    last = read_jsonl(out / "metrics.jsonl")[-1]
    assert last["buffer/unclaimed"] == len(after) - len(live)  # the rest is still in the buffer, claimable
    db.close()
    # Train-only: a new run trains from that buffer (all of it again, `reuse`) without generating anything.
    out2 = tmp_path / "train_only"
    rc, stdout, stderr = _finish(
        _rl(
            out2,
            "--max-steps",
            "3",
            "--orchestrator.buffer.train-only",
            "true",
            "--orchestrator.buffer.reuse",
            "true",
            "--orchestrator.buffer.path",
            str(out / "buffer.sqlite"),
        )
    )
    assert rc == 0, stderr + stdout
    rows = read_jsonl(out2 / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["policy_version"] == -1 for r in rows)
    assert all(r["buffer/rollouts"] == len(after) for r in rows)  # nothing new was generated
    assert rows[-1]["buffer/unclaimed"] == len(after) - 3 * 16


def test_a_buffer_from_before_runs_and_steps_were_recorded_opens_and_rewinds(tmp_path):
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.executescript("""CREATE TABLE rollouts (id INTEGER PRIMARY KEY AUTOINCREMENT, group_key TEXT NOT NULL,
                        created REAL NOT NULL, ready INTEGER NOT NULL, abs_advantage REAL NOT NULL DEFAULT 0,
                        payload TEXT NOT NULL);
                        CREATE TABLE claims (rollout_id INTEGER NOT NULL, step INTEGER NOT NULL,
                        released INTEGER NOT NULL DEFAULT 0);""")
    db.close()
    buf = ExperienceBuffer(path, "run")
    buf.put_group(_group(1.0), "a")  # no step: a rewind keeps it
    buf.put_group(_group(2.0), "b", step=3)
    buf.claim(2, step=3)
    assert buf.rewind(3) == (4, 2)  # both claims released, b (written by step 3) discarded
    assert [g[0].text for g in buf.claim(5, step=3)] == ["g1.0"]
    buf.close()
