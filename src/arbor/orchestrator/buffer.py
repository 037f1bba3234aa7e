"""The persistent experience buffer: SQLite in WAL mode at `<output_dir>/buffer.sqlite` (Trinity-RFT's design).

Rollouts are written as their group finishes, one transaction per group, so a crash loses nothing written. A
rollout may arrive without its reward (`ready=False`, e.g. a judge or a human that answers later); `set_reward`
fills it in, and a group becomes ready when all its rollouts are. The trainer-facing sampler `claim` takes
ready, unclaimed groups in FIFO order (oldest first), by priority (largest mean |advantage| first) or by recency
(newest first), and records the claim (rollout, step) in the same transaction as the rows it marks.

Exactly-once across restarts: a claim for step N counts as trained once the trainer has checkpointed past N.
A resumed orchestrator starts at the trainer's checkpoint step S and calls `release(S)`: claims for steps >= S
(their training was lost with the crash) are marked released and their groups become claimable again. So every
rollout ever written is either trained (one live claim below S) or still in the buffer, and no rollout holds
two live claims; `claims` keeps the released rows too, so tests can check exactly that.

Advantages are computed before a group is written (they are group-relative), so a group read back trains as
it was scored. The rollout itself is stored as JSON (its dataclass fields).
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import time
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
    payload TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS rollouts_group ON rollouts(group_key);
CREATE TABLE IF NOT EXISTS claims (
    rollout_id INTEGER NOT NULL,
    step INTEGER NOT NULL,
    released INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS claims_rollout ON claims(rollout_id, released);
"""

Order = Literal["fifo", "priority", "recency"]


class ExperienceBuffer:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, isolation_level=None, timeout=60)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")  # a committed group survives a power cut, not just a crash
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    # --- writing -------------------------------------------------------------------------------------------------

    def put_group(self, group: list[Rollout], group_key: str, ready: bool = True) -> list[int]:
        """Stores a finished group in one transaction; returns the rollouts' ids."""
        now = time.time()
        ids = []
        with self._tx():
            for r in group:
                cur = self.db.execute(
                    "INSERT INTO rollouts (group_key, created, ready, abs_advantage, payload) VALUES (?, ?, ?, ?, ?)",
                    (group_key, now, int(ready), abs(r.advantage), json.dumps(dataclasses.asdict(r))),
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

    def claim(self, n_groups: int, step: int, order: Order = "fifo") -> list[list[Rollout]]:
        """Up to `n_groups` ready, unclaimed groups, recorded as claimed for `step` (atomically)."""
        sort = {"fifo": "MIN(r.id) ASC", "priority": "AVG(r.abs_advantage) DESC, MIN(r.id) ASC",
                "recency": "MIN(r.id) DESC"}[order]
        with self._tx():
            keys = [k for (k,) in self.db.execute(
                f"""SELECT r.group_key FROM rollouts r
                    WHERE NOT EXISTS (SELECT 1 FROM claims c WHERE c.rollout_id = r.id AND c.released = 0)
                    GROUP BY r.group_key HAVING MIN(r.ready) = 1 ORDER BY {sort} LIMIT ?""",
                (n_groups,),
            )]
            groups = []
            for key in keys:
                rows = self.db.execute(
                    "SELECT id, payload FROM rollouts WHERE group_key = ? ORDER BY id", (key,)
                ).fetchall()
                self.db.executemany("INSERT INTO claims (rollout_id, step) VALUES (?, ?)", [(i, step) for i, _ in rows])
                groups.append([Rollout(**json.loads(p)) for _, p in rows])
        return groups

    def release(self, from_step: int) -> int:
        """Returns the groups claimed for steps >= from_step to the buffer; returns how many rollouts."""
        with self._tx():
            cur = self.db.execute("UPDATE claims SET released = 1 WHERE step >= ? AND released = 0", (from_step,))
        return cur.rowcount

    def counts(self) -> dict[str, int]:
        total, ready = self.db.execute("SELECT COUNT(*), COALESCE(SUM(ready), 0) FROM rollouts").fetchone()
        claimed = self.db.execute("SELECT COUNT(DISTINCT rollout_id) FROM claims WHERE released = 0").fetchone()[0]
        return {"buffer/rollouts": int(total), "buffer/not_ready": int(total - ready),
                "buffer/unclaimed": int(total - claimed)}

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
