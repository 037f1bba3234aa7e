"""Environment tasks from a dataset instead of a built-in generator: a Hugging Face hub id (with its config and
split) or a local parquet, JSON Lines or arrow file, read through the `datasets` library (the `datasets` extra).

`columns` maps the environment's task fields to the dataset's column names (`{question = "problem", answer =
"solution"}`); a field left out reads the column of its own name. A column the dataset lacks fails at once in
one line naming the field, the column and the columns there are. The split takes the `datasets` slicing syntax
(`"train[:1000]"`). A hub dataset is downloaded into the Hugging Face cache when the hub is reachable and read
from the cache offline (`HF_HUB_OFFLINE=1`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from arbor.environments.protocol import Task

LOCAL_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow"}
"""Local file suffix -> the `datasets` builder that reads it."""


class DatasetError(ValueError):
    """A dataset that cannot be read or lacks a column the environment needs; the message is one line."""


def load_rows(source: str, split: str = "train", config: str | None = None) -> list[dict[str, Any]]:
    """The rows of `source` (a local file by its suffix, else a hub id) as plain dicts, in the dataset's order."""
    if importlib.util.find_spec("datasets") is None:
        raise DatasetError(
            f"dataset {source!r} needs the `datasets` library (the `datasets` extra: uv sync --extra datasets)"
        )
    # `datasets` takes seconds to import: only environments given a dataset pay for it.
    import datasets

    datasets.disable_progress_bars()  # a progress bar per read would flood the orchestrator's log
    path = Path(source)
    try:
        if path.suffix in LOCAL_FORMATS:
            if not path.is_file():
                raise DatasetError(f"dataset {source} does not exist")
            data = datasets.load_dataset(LOCAL_FORMATS[path.suffix], data_files=str(path), split=split)
        else:
            data = datasets.load_dataset(source, config, split=split)
    except DatasetError:
        raise
    except Exception as e:  # whatever the library or the hub raises: the user needs the source and the reason
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DatasetError(f"dataset {source!r} (split {split!r}) cannot be read: {reason}") from None
    return data.to_list()


def map_columns(
    rows: list[dict[str, Any]],
    columns: dict[str, str] | None,
    fields: tuple[str, ...],
    source: str,
    optional: tuple[str, ...] = (),
) -> list[Task]:
    """Tasks holding `fields` (and the `optional` fields whose column exists), read from `rows` through the
    mapping `columns` (task field -> column); each task's "id" is its row index."""
    columns = columns or {}
    unknown = sorted(set(columns) - set(fields) - set(optional))
    if unknown:
        raise DatasetError(
            f"columns.{unknown[0]}: the environment has no task field {unknown[0]!r} "
            f"(it reads {', '.join(fields + optional)})"
        )
    if not rows:
        raise DatasetError(f"dataset {source!r} has no rows")
    present = list(rows[0])
    for field in fields:
        column = columns.get(field, field)
        if column not in rows[0]:
            raise DatasetError(
                f"dataset {source!r} has no column {column!r} for the task field {field!r} "
                f"(its columns: {', '.join(present)}): set columns.{field}"
            )
    wanted = list(fields) + [f for f in optional if columns.get(f, f) in rows[0]]
    return [{"id": i, **{f: row[columns.get(f, f)] for f in wanted}} for i, row in enumerate(rows)]
