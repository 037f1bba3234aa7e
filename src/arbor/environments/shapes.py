"""shapes: a synthetic visual task for vision-language models: an image drawn locally with PIL (no download) and
a question about it, answered in one word.

Three kinds of question: `colour` (the colour of the one square), `count` (how many white squares, 1 to 4) and
`position` (whether the square is on the left or the right). The colour task's square is large (3/4 of the image's
side, so it shows in every quarter of the image: in each of a small vision tower's image tokens, not in one of
them only); the others' squares are 1/4 of the side. Tasks are generated from a seed; each task's image
is drawn from its own fields, so a prompt is the same every time it is asked. The reward is 1 when the
completion's first word is the answer, else 0; `reference` is the answer, for the SFT warm-up.
"""

from __future__ import annotations

import random
from typing import Any

from PIL import Image, ImageDraw

from arbor.environments.protocol import Task

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40)}
KINDS = ("colour", "count", "position")
QUESTIONS = {
    "colour": "What colour is the square?",
    "count": "How many squares are there?",
    "position": "Is the square on the left or the right?",
}


def square_side(kind: str, size: int) -> int:
    """A `kind` task's square side in pixels, in a `size`-pixel image."""
    return max(2, 3 * size // 4) if kind == "colour" else max(2, size // 4)


def draw(task: Task, size: int) -> Image.Image:
    """The task's image: `size` x `size` pixels, black background."""
    image = Image.new("RGB", (size, size), (0, 0, 0))
    pen = ImageDraw.Draw(image)
    side = square_side(task["kind"], size)
    for x, y, colour in task["squares"]:
        pen.rectangle([x, y, x + side - 1, y + side - 1], fill=tuple(colour))
    return image


class ShapesEnv:
    name = "shapes"

    def __init__(self, num_tasks: int = 10000, kinds: tuple[str, ...] = ("colour",), image_size: int = 32) -> None:
        self.kinds = list(kinds)
        unknown = sorted(set(self.kinds) - set(KINDS))
        if unknown:
            raise ValueError(f"kinds: unknown {unknown}; choose from {list(KINDS)}")
        self.num_tasks, self.size = num_tasks, image_size

    def _task(self, i: int, rng: random.Random) -> Task:
        kind = rng.choice(self.kinds)
        side = square_side(kind, self.size)
        spot = lambda lo, hi: (rng.randint(lo, hi), rng.randint(0, self.size - side))  # noqa: E731
        if kind == "colour":
            name = rng.choice(sorted(COLOURS))
            squares, answer = [(*spot(0, self.size - side), COLOURS[name])], name
        elif kind == "count":
            n = rng.randint(1, 4)
            cells = rng.sample(range(4), n)  # one square per quadrant: they never overlap
            half = self.size // 2
            squares = [
                (
                    (c % 2) * half + rng.randint(0, half - side),
                    (c // 2) * half + rng.randint(0, half - side),
                    (255, 255, 255),
                )
                for c in cells
            ]
            answer = str(n)
        else:
            left = rng.random() < 0.5
            half = self.size // 2
            x, y = spot(0, half - side) if left else spot(half, self.size - side)
            squares, answer = [(x, y, (255, 255, 255))], "left" if left else "right"
        return {"id": i, "kind": kind, "squares": squares, "answer": answer}

    def dataset(self, seed: int) -> list[Task]:
        rng = random.Random(seed)
        return [self._task(i, rng) for i in range(self.num_tasks)]

    def prompt(self, task: Task) -> list[dict[str, Any]]:
        image = {"type": "image", "image": draw(task, self.size)}
        return [{"role": "user", "content": [image, {"type": "text", "text": QUESTIONS[task["kind"]]}]}]

    async def score(self, task: Task, completion: str) -> dict[str, float]:
        words = completion.strip().lower().split()
        return {"correct": float(bool(words) and words[0].strip(".,!") == task["answer"])}

    def reference(self, task: Task) -> str | None:
        return task["answer"]
