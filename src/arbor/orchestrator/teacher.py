"""The distillation teacher's side of the orchestrator: each sample's completion scored by a teacher model.

On-policy distillation (`[orchestrator.teacher]`): the policy (the student) samples as usual, then the teacher
gives its logprob of every completion token given the tokens before it, and the trainer's reverse-KL term
(the trainer's `loss.reverse_kl_to_teacher`) pulls the student towards it. The request is vLLM's: POST
/v1/completions with the prompt + completion as token ids, `prompt_logprobs = 0` and `max_tokens = 1` (vLLM
generates at least one token; it is ignored), answered by a `prompt_logprobs` list with, per token after the
first, a map from token id to `{"logprob", "rank", ...}` that holds the token itself. arbor's local engine
(the `inference` server) answers the same; both report the raw model's logprobs (temperature 1).

With `top_k = k > 0` the request asks for `prompt_logprobs = k`: each position's map then holds the teacher's k
most likely tokens as well as the actual one (k or k + 1 entries), and the k best of each completion position
(by rank, as the server numbers them) ship too, as `[C, k]` arrays of token ids and logprobs, for the trainer's
exact top-k term. A reply with fewer than k ranked alternatives at a position is an error naming the sample;
a server that allows fewer than k (vLLM's `--max-logprobs`, the local engine's 20) rejects the request (400),
which is raised as one line naming `orchestrator.teacher.top_k`.

Retries and errors are the inference client's (arbor.orchestrator.client): a connection error, timeout or 5xx is
retried with backoff, a 4xx (a token id outside the teacher's vocabulary, a sample longer than its context) is
raised at once with the teacher's message, and a reply that does not cover the sample is an error naming it.
Multi-turn samples are scored whole; tokens the environment inserted carry no loss, so their scores go unused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

import aiohttp
import numpy as np

from arbor.config.admin import bearer_headers
from arbor.config.orchestrator import TeacherConfig
from arbor.orchestrator.client import InferenceClient, InferenceError
from arbor.orchestrator.rollout import Rollout

log = logging.getLogger("arbor.orchestrator.teacher")


class TeacherError(RuntimeError):
    """The teacher could not score a sample (after retries, or it rejected the request)."""


@dataclasses.dataclass
class TeacherScores:
    """The teacher's view of one sample's completion tokens."""

    logprobs: list[float]
    """The logprob of each completion token given the tokens before it."""
    topk_ids: np.ndarray | None = None
    """`[C, k]` int32: the teacher's k most likely tokens at each completion position, best first (top_k > 0)."""
    topk_logprobs: np.ndarray | None = None
    """`[C, k]` float32: their logprobs."""


def completion_logprobs(prompt_logprobs: Any, token_ids: list[int], start: int) -> list[float]:
    """The logprobs of `token_ids[start:]` from a vLLM `prompt_logprobs` list over `token_ids` (entries keyed by
    the token id as a string, as JSON carries vLLM's int keys)."""
    if not isinstance(prompt_logprobs, list) or len(prompt_logprobs) != len(token_ids):
        got = len(prompt_logprobs) if isinstance(prompt_logprobs, list) else type(prompt_logprobs).__name__
        raise TeacherError(
            f"the teacher's prompt_logprobs cover {got} tokens, expected {len(token_ids)} (does the "
            "server support prompt_logprobs?)"
        )
    out = []
    for i in range(start, len(token_ids)):
        entry = prompt_logprobs[i]
        item = entry.get(str(token_ids[i])) if isinstance(entry, dict) else None
        if not isinstance(item, dict) or not isinstance(item.get("logprob"), (int, float)):
            raise TeacherError(f"the teacher's prompt_logprobs lack token {token_ids[i]} at position {i}")
        out.append(float(item["logprob"]))
    return out


def completion_topk(
    prompt_logprobs: list[Any], start: int, k: int, vocab: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """`[C, k]` ids and logprobs of the entries ranked 1..k at each position from `start` on (a list that
    `completion_logprobs` has checked); a position without all k, or (with `vocab`, the student's number of
    token ids) a ranked id outside the student's vocabulary, is a TeacherError."""
    ids = np.zeros((len(prompt_logprobs) - start, k), np.int32)
    lps = np.zeros(ids.shape, np.float32)
    for i in range(start, len(prompt_logprobs)):
        ranked = {}
        for key, item in prompt_logprobs[i].items():
            rank = item.get("rank") if isinstance(item, dict) else None
            if isinstance(rank, int) and 1 <= rank <= k and isinstance(item.get("logprob"), (int, float)):
                token = int(key) if str(key).isdigit() else -1
                if token < 0 or (vocab is not None and token >= vocab):
                    raise TeacherError(
                        f"the teacher's top-k token {key!r} at position {i} is not one of the "
                        f"student's {vocab} token ids: teacher and student must share a tokenizer"
                    )
                ranked[rank] = (token, float(item["logprob"]))
        if len(ranked) < k:
            raise TeacherError(
                f"the teacher's prompt_logprobs hold {len(ranked)} of the top_k = {k} ranked tokens at position {i}"
            )
        ids[i - start], lps[i - start] = zip(*(ranked[r] for r in range(1, k + 1)))
    return ids, lps


class Teacher(InferenceClient):
    """Scores rollouts with the teacher at `cfg.url` (use as an async context manager, like its base)."""

    def __init__(self, cfg: TeacherConfig, vocab: int | None = None) -> None:
        if cfg.url is None:
            raise ValueError(
                "orchestrator.teacher.url is not set: give the teacher server's URL (or, under rl, a "
                "[teacher] section to launch one)"
            )
        super().__init__([cfg.url], cfg.timeout, cfg.max_retries, model=cfg.model or "")
        self.cfg = cfg
        self.vocab = vocab
        """The student's number of token ids: teacher top-k ids must fall below it."""
        self._headers = bearer_headers(cfg.api_key)
        self._slots = asyncio.Semaphore(cfg.max_concurrent)
        self.seconds = 0.0
        """Wall-clock seconds the last `score` call took."""

    async def wait_ready(self) -> None:
        """Waits until the teacher's /health answers 200 (vLLM's has no body), at most `cfg.timeout` seconds."""
        assert self._session is not None, "use Teacher as an async context manager"
        deadline = time.monotonic() + self.cfg.timeout
        while True:
            try:
                async with self._session.get(self.base_urls[0] + "/health", headers=self._headers) as resp:
                    if resp.status == 200:
                        return
            except (TimeoutError, aiohttp.ClientError):
                pass
            if time.monotonic() > deadline:
                raise TeacherError(f"teacher {self.cfg.url} is not healthy after {self.cfg.timeout:.0f}s")
            await asyncio.sleep(0.5)

    async def logprobs(self, prompt_ids: list[int], completion_ids: list[int]) -> TeacherScores:
        """The teacher's logprob of each completion token given the prompt and the completion before it (and,
        with `top_k`, its k most likely tokens at each completion position)."""
        ids, k = list(prompt_ids) + list(completion_ids), self.cfg.top_k
        body: dict[str, Any] = {"prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": k}
        if self.cfg.model:
            body["model"] = self.cfg.model
        async with self._slots:
            try:
                data = await self._post("/v1/completions", body, headers=self._headers)
            except InferenceError as e:
                hint = f" (orchestrator.teacher.top_k = {k})" if k and e.status is not None else ""
                raise TeacherError(f"teacher {self.cfg.url}: {e}{hint}") from None
        choices = data.get("choices") if isinstance(data, dict) else None
        if not choices:
            raise TeacherError(f"teacher {self.cfg.url} answered without choices: {str(data)[:200]}")
        plp = choices[0].get("prompt_logprobs")
        scores = TeacherScores(completion_logprobs(plp, ids, len(prompt_ids)))
        if k:
            scores.topk_ids, scores.topk_logprobs = completion_topk(plp, len(prompt_ids), k, self.vocab)
        return scores

    async def _score(self, r: Rollout) -> None:
        """Scores one rollout in place; a failure names its task and group."""
        if not r.completion_ids:
            k = self.cfg.top_k
            r.teacher_logprobs = []
            if k:
                r.teacher_topk_ids, r.teacher_topk_logprobs = np.zeros((0, k), np.int32), np.zeros((0, k), np.float32)
            return
        try:
            scores = await self.logprobs(r.prompt_ids, r.completion_ids)
        except TeacherError as e:
            raise TeacherError(f"sample of task {r.task_id!r} (group {r.group_id}): {e}") from None
        r.teacher_logprobs = scores.logprobs
        r.teacher_topk_ids, r.teacher_topk_logprobs = scores.topk_ids, scores.topk_logprobs

    async def score(self, rollouts: list[Rollout]) -> None:
        """Sets `teacher_logprobs` (and with `top_k` the top-k arrays) of every rollout (all requests at once,
        `max_concurrent` in flight)."""
        t0 = time.perf_counter()
        await asyncio.gather(*(self._score(r) for r in rollouts))
        self.seconds = time.perf_counter() - t0
