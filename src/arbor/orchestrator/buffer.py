"""The persistent experience buffer: SQLite in WAL mode at `<output_dir>/buffer.sqlite` (Trinity-RFT's design).

Rollouts are written as their group finishes, one transaction per group, so a crash loses nothing written. A
rollout may arrive without its reward (`ready=False`, e.g. a judge or a human that answers later); `set_reward`
fills it in, and a group becomes ready when all its rollouts are. The trainer-facing sampler `claim` takes
ready, unclaimed groups in FIFO order (oldest first), by priority (largest mean |advantage| first) or by recency
(newest first), and records the claim (rollout, step) in the same transaction as the rows it marks.

Exactly-once across restarts: a claim for step N counts as trained once the trainer has checkpointed past N.
A resumed orchestrator starts at the trainer's checkpoint step S and calls `rewind(S)`, which puts the buffer
back as it was when step S-1 ended: claims for steps >= S (their training was lost with the crash) are released,
so their groups become claimable again, and groups written by steps >= S are discarded, because the resumed run
regenerates exactly those tasks from the dataset position saved for step S (arbor.orchestrator.state); keeping
them would train those tasks twice. So every task is trained once, as in an uninterrupted run, and no rollout
holds two live claims; `claims` keeps the released rows and discarded rollouts stay in `rollouts`, so tests can
check exactly that. Each rollout records the step whose collection wrote it (`step`; NULL for rows of a buffer
written before the column existed, which a rewind keeps).

`claim` may be given an `accept` test (the staleness bound): a candidate group that fails it is discarded in the
same transaction instead of claimed, and the next one is tried.

Advantages are computed before a group is written (they are group-relative), so a group read back trains as
it was scored. The rollout itself is stored as JSON (its dataclass fields).
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from arbor.orchestrator.rollout import Rollout

SCHEMA = """
CREATE TABLE IF NOT EXISTS rollouts (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    group_key TEXT NOT NULL,
    created REAL NOT NULL,
    ready INTEGER NOT NULL,
    abs_advantage REAL NOT NULL DEFAULT 0,
    payload TEXT NOT NULL,
    step INTEGER,
    discarded INTEGER NOT NULL DEFAULT 0,
    run TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS rollouts_group ON rollouts(group_key);
CREATE TABLE IF NOT EXISTS claims (
    rollout_id INTEGER NOT NULL,
    step INTEGER NOT NULL,
    released INTEGER NOT NULL DEFAULT 0,
    run TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS claims_rollout ON claims(rollout_id, released);
"""

Order = Literal["fifo", "priority", "recency"]

_ADDED_COLUMNS = {
    "rollouts": {"step": "INTEGER", "discarded": "INTEGER NOT NULL DEFAULT 0", "run": "TEXT NOT NULL DEFAULT ''"},
    "claims": {"run": "TEXT NOT NULL DEFAULT ''"},
}
"""Columns a buffer written by an earlier arbor lacks; added on open."""


class ExperienceBuffer:
    """One buffer file, opened by the run `run` (its output directory): the rows it writes and the claims it
    makes carry that name, and `release` and `rewind` touch only that run's (and unnamed rows, from a buffer
    written before runs were named), so a run sharing another's file (train-only, reuse) never rewinds it."""

    def __init__(self, path: str | Path, run: str = "") -> None:
        self.path, self.run = Path(path), run
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, isolation_level=None, timeout=60)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")  # a committed group survives a power cut, not just a crash
        self.db.executescript(SCHEMA)
        for table, columns in _ADDED_COLUMNS.items():
            have = {row[1] for row in self.db.execute(f"PRAGMA table_info({table})")}
            for name, decl in columns.items():
                if name not in have:
                    self.db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")

    def close(self) -> None:
        self.db.close()

    # --- writing -------------------------------------------------------------------------------------------------

    def put_group(self, group: list[Rollout], group_key: str, ready: bool = True, step: int | None = None) -> list[int]:
        """Stores a finished group in one transaction (written by the collection of `step`, which a `rewind`
        below it discards); returns the rollouts' ids."""
        now = time.time()
        ids = []
        with self._tx():
            for r in group:
                cur = self.db.execute(
                    "INSERT INTO rollouts (group_key, created, ready, abs_advantage, payload, step, run) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (group_key, now, int(ready), abs(r.advantage), json.dumps(dataclasses.asdict(r)), step, self.run),
                )
                ids.append(int(cur.lastrowid))
        return ids

    def set_reward(self, rollout_id: int, reward: float, advantage: float | None = None) -> None:
        """A late reward: fills it in and marks the rollout ready."""
        with self._tx():
            row = self.db.execute("SELECT payload FROM rollouts WHERE id = ?", (rollout_id,)).fetchone()
            if row is None:
                raise KeyError(f"no rollout {rollout_id} in {self.path}")
            data = json.loads(row[0])
            data["reward"] = reward
            if advantage is not None:
                data["advantage"] = advantage
            self.db.execute(
                "UPDATE rollouts SET ready = 1, payload = ?, abs_advantage = ? WHERE id = ?",
                (json.dumps(data), abs(data["advantage"]), rollout_id),
            )

    # --- reading -------------------------------------------------------------------------------------------------

    def claim(
        self, n_groups: int, step: int, order: Order = "fifo", accept: Callable[[list[Rollout]], bool] | None = None
    ) -> list[list[Rollout]]:
        """Up to `n_groups` ready, unclaimed groups, recorded as claimed for `step` (atomically). A candidate that
        `accept` rejects is discarded instead (never claimable again) and the next one in `order` is tried."""
        sort = {
            "fifo": "MIN(r.id) ASC",
            "priority": "AVG(r.abs_advantage) DESC, MIN(r.id) ASC",
            "recency": "MIN(r.id) DESC",
        }[order]
        groups: list[list[Rollout]] = []
        with self._tx():
            while len(groups) < n_groups:
                # Each pass claims or discards every key it reads, so the next pass reads new ones.
                keys = [
                    k
                    for (k,) in self.db.execute(
                        f"""SELECT r.group_key FROM rollouts r
                        WHERE r.discarded = 0 AND NOT EXISTS
                            (SELECT 1 FROM claims c WHERE c.rollout_id = r.id AND c.released = 0)
                        GROUP BY r.group_key HAVING MIN(r.ready) = 1 ORDER BY {sort} LIMIT ?""",
                        (n_groups - len(groups),),
                    )
                ]
                if not keys:
                    break
                for key in keys:
                    rows = self.db.execute(
                        "SELECT id, payload FROM rollouts WHERE group_key = ? AND discarded = 0 ORDER BY id", (key,)
                    ).fetchall()
                    group = [Rollout(**json.loads(p)) for _, p in rows]
                    if accept is not None and not accept(group):
                        self.db.execute("UPDATE rollouts SET discarded = 1 WHERE group_key = ?", (key,))
                        continue
                    self.db.executemany(
                        "INSERT INTO claims (rollout_id, step, run) VALUES (?, ?, ?)",
                        [(i, step, self.run) for i, _ in rows],
                    )
                    groups.append(group)
        return groups

    def release(self, from_step: int, every_run: bool = False) -> int:
        """Returns the groups this run claimed for steps >= from_step to the buffer (`every_run`: whichever run
        claimed them); returns how many rollouts."""
        where = "" if every_run else " AND run IN (?, '')"
        with self._tx():
            cur = self.db.execute(
                f"UPDATE claims SET released = 1 WHERE step >= ? AND released = 0{where}",
                (from_step,) if every_run else (from_step, self.run),
            )
        return cur.rowcount

    def rewind(self, to_step: int) -> tuple[int, int]:
        """Puts this run's part of the buffer back as it was when step `to_step - 1` ended (a resume at
        `to_step`): releases its claims for steps >= to_step and discards the rollouts those steps wrote.
        Returns (released, discarded) rollout counts."""
        with self._tx():
            released = self.db.execute(
                "UPDATE claims SET released = 1 WHERE step >= ? AND released = 0 AND run IN (?, '')",
                (to_step, self.run),
            ).rowcount
            discarded = self.db.execute(
                "UPDATE rollouts SET discarded = 1 WHERE step >= ? AND discarded = 0 AND run IN (?, '')",
                (to_step, self.run),
            ).rowcount
        return released, discarded

    def counts(self) -> dict[str, int]:
        total, ready = self.db.execute("SELECT COUNT(*), COALESCE(SUM(ready), 0) FROM rollouts").fetchone()
        claimed = self.db.execute("SELECT COUNT(DISTINCT rollout_id) FROM claims WHERE released = 0").fetchone()[0]
        # unclaimed: every rollout without a live claim, discarded ones included (a rewind logs how many).
        return {
            "buffer/rollouts": int(total),
            "buffer/not_ready": int(total - ready),
            "buffer/unclaimed": int(total - claimed),
        }

    def _tx(self):
        return _Transaction(self.db)


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, rolled back on error (the connection is in autocommit mode)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, exc_type, exc, tb) -> None:
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")
