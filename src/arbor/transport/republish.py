"""The republish request: how the orchestrator asks the trainer to publish again a version the fleet refused.

When every server refuses published version N (a shard whose checksum does not match its manifest: a disk or a
network filesystem damaged the copy), the orchestrator withdraws `broadcasts/step_N/` and writes
`broadcasts/republish.json` (`{"version": N, "reason": ...}`, atomically; arbor.run_dir.republish_request_path).
The trainer reads it while it waits for a step's rollouts (arbor.trainer.republish) and, when no version >= N is
published by then, publishes its in-memory weights again, as a full (not delta) update; the orchestrator loads
whatever version >= N appears. A request is answered once: versions only grow, so the trainer remembers the
newest it answered and the orchestrator never asks twice for one version. Standard library only: the
orchestrator imports it, and the trainer reads it between steps.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from arbor.run_dir import PathLike, republish_request_path, write_text_atomic


@dataclass(frozen=True)
class RepublishRequest:
    version: int
    """The published version the fleet refused."""
    reason: str
    """The refusal, one line (the file and its checksums, typically)."""


def request_republish(output_dir: PathLike, version: int, reason: str) -> None:
    """Asks the trainer to publish `version` again (replacing any earlier request)."""
    payload = {"version": int(version), "reason": " ".join(reason.split())}
    write_text_atomic(republish_request_path(output_dir), json.dumps(payload))


def read_republish_request(output_dir: PathLike) -> RepublishRequest | None:
    """The pending request, or None (none written, or one that cannot be read: written atomically, so only a
    foreign file is unreadable, and it is ignored rather than trusted)."""
    try:
        payload = json.loads(republish_request_path(output_dir).read_text())
        return RepublishRequest(int(payload["version"]), str(payload["reason"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def clear_republish_request(output_dir: PathLike) -> None:
    """Removes a request an earlier attempt left (the orchestrator, when it starts)."""
    republish_request_path(output_dir).unlink(missing_ok=True)
