"""The task source: which task each newly launched group of rollouts generates for.

A launch takes, in this order: a task queued for another try (a straggler cancelled under
`straggler_action = "retry"`), a task a resumed run must relaunch (the saved state's `pending`: launched but in
no batch when the state was saved, so a crash skips no task), then a fresh task from the curriculum or the
seeded `TaskSampler` (the dataset position is saved as launched). A task whose prompt plus `max_tokens` cannot
fit in `seq_len` is skipped and counted, and so is one whose prompt cannot be built (the environment's `prompt`
raised or returned what the chat template cannot render: a warning names the task and the error, for the first
few); a dataset of which no task fits, or whose prompts keep failing, makes the source raise `NoTaskFits`
(preflight's message) when it is built, so that the orchestrator fails at once instead of skipping forever (the
check stops at the first task that fits). Each launch gets a group id (launch order) and a sampling seed derived
from (seed, step, k), k counting the step's launches.

The source remembers the task of every group until the group is taken into a batch, cancelled or retried;
`pending` lists those tasks (then the queued retries, then the relaunches not made yet) as dataset indices for
the saved state.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import zlib
from typing import Any

from arbor.config.orchestrator import CurriculumConfig
from arbor.environments import NoTaskFits, Task, check_some_task_fits, env_prompt
from arbor.models.tokenizer import Tokenizer
from arbor.orchestrator.filters import CurriculumSampler
from arbor.orchestrator.group import GroupSpec
from arbor.orchestrator.state import OrchestratorState, TaskSampler

log = logging.getLogger(__name__)
WARNED_PROMPTS = 10
"""Failed prompts warned about one by one; later ones are only counted (`skipped/bad_prompt`)."""


@dataclasses.dataclass(frozen=True)
class TaskSettings:
    """What the task source reads of the orchestrator config (arbor.orchestrator.main hands it out)."""

    seed: int
    """`orchestrator.seed`: the dataset, the sampler's order and the per-launch sampling seeds."""
    seq_len: int
    max_tokens: int
    """`sampling.max_tokens`: a prompt must leave this much of seq_len."""
    prompt_format: str
    """`environment.prompt_format`."""
    curriculum: CurriculumConfig
    max_retries: int
    """`partial.max_resumes`: a straggler's task is retried at most this many times."""


class TaskSource:
    """Tasks for new groups (see the module docstring), resumed from `state`."""

    def __init__(self, settings: TaskSettings, env: Any, tokenizer: Tokenizer, state: OrchestratorState) -> None:
        self.settings, self.env, self.tokenizer = settings, env, tokenizer
        self.tasks: list[Task] = env.dataset(settings.seed)
        # Before any fleet is waited for: if no task fits, the skip loop of next_spec would never end.
        check_some_task_fits(env, self.tasks, tokenizer, settings.seq_len, settings.max_tokens, settings.prompt_format)
        self.sampler = TaskSampler(self.tasks, settings.seed, state.epoch, state.position)
        self.curriculum: CurriculumSampler | None = (
            CurriculumSampler(self.tasks, settings.seed, settings.curriculum, state.curriculum)
            if settings.curriculum.enabled
            else None
        )
        self.relaunch: collections.deque[Task] = collections.deque(self.tasks[i] for i in state.pending)
        self.retry: collections.deque[tuple[Task, int]] = collections.deque()  # (task, retries so far)
        self.groups_launched = 0
        self.skipped_long = 0
        """Tasks skipped because their prompt plus max_tokens exceeds seq_len."""
        self.skipped_bad = 0
        """Tasks skipped because their prompt could not be built."""
        self._task_of_group: dict[int, Task] = {}
        self._retries: dict[int, int] = {}  # group id -> how many times its task was retried before it

    def next_spec(self, step: int, k: int) -> GroupSpec:
        """The next group to launch: the step's k-th launch."""
        cfg = self.settings
        failed_in_a_row = 0
        while True:
            retries = 0
            if self.retry:
                task, retries = self.retry.popleft()
            elif self.relaunch:
                task = self.relaunch.popleft()
            else:
                task = self.curriculum.next() if self.curriculum is not None else self.sampler.next()
            try:
                prompt_ids, images = env_prompt(self.env, task, self.tokenizer, cfg.prompt_format)
            except Exception as e:  # noqa: BLE001 - the environment's code for one task: skipped and counted
                failed_in_a_row += 1
                self._bad_prompt(task, e, failed_in_a_row)
                continue
            if len(prompt_ids) + cfg.max_tokens <= cfg.seq_len:
                break
            self.skipped_long += 1
        seed = zlib.crc32(f"{cfg.seed}/{step}/{k}".encode()) & 0x7FFFFFFF
        group_id = self.groups_launched
        self.groups_launched += 1
        self._task_of_group[group_id] = task
        if retries:
            self._retries[group_id] = retries
        return GroupSpec(task, prompt_ids, seed, group_id, images)

    def _bad_prompt(self, task: Task, error: Exception, in_a_row: int) -> None:
        self.skipped_bad += 1
        if self.skipped_bad <= WARNED_PROMPTS:
            more = "; later ones are only counted (skipped/bad_prompt)" if self.skipped_bad == WARNED_PROMPTS else ""
            log.warning("task %s skipped: its prompt could not be built: %r%s", task.get("id", "?"), error, more)
        if in_a_row > 2 * len(self.tasks) + 10:  # more than every task twice over: nothing left to train on
            raise NoTaskFits(
                f"the last {in_a_row} tasks' prompts could not be built (last: task {task.get('id', '?')}: {error!r})"
            )

    def taken(self, group_id: int) -> Task | None:
        """A group of this task left the queue for a batch (kept or dropped): it is no longer pending."""
        return self._task_of_group.pop(group_id, None)

    def closed(self, group_id: int, cancelled: bool) -> None:
        """A group's generation ended; a cancelled one's task is no longer pending (unless queued to retry)."""
        self._retries.pop(group_id, None)
        if cancelled:
            self._task_of_group.pop(group_id, None)

    def retry_group(self, group_id: int) -> bool:
        """Queues the task of a cancelled straggler to be launched again, first; False when it has been retried
        max_resumes times already (or is unknown): it is given up."""
        task, retries = self._task_of_group.pop(group_id, None), self._retries.get(group_id, 0)
        if task is None or retries >= self.settings.max_retries:
            return False
        self.retry.append((task, retries + 1))
        return True

    def record(self, task: Task | None, rate: float) -> None:
        """A group's solve rate, for the curriculum."""
        if self.curriculum is not None and task is not None:
            self.curriculum.record(task, rate)

    def pending(self) -> list[int]:
        """Dataset indices of the tasks launched and not yet taken (for the saved state; see state.pending)."""
        index = {id(t): i for i, t in enumerate(self.tasks)}
        out = [index[id(t)] for t in self._task_of_group.values() if id(t) in index]
        out += [index[id(t)] for t, _ in self.retry if id(t) in index]
        return out + [index[id(t)] for t in self.relaunch if id(t) in index]

    def state(self, step: int) -> OrchestratorState:
        """What a run resuming at `step` starts from."""
        curriculum = self.curriculum.state() if self.curriculum is not None else None
        return OrchestratorState(step, self.sampler.epoch, self.sampler.position, curriculum, self.pending())
