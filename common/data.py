"""Where problems come from: the built-in tiny task, a local JSON/JSONL file, a `save_to_disk` folder or a hub id.

Every script loads its rows here so that bad input fails the same way everywhere: at start-up, in one
sentence that names the dataset, the row index and the missing field (docs/reference.md, "Data and models").
"""

from __future__ import annotations

import json
import os
from pathlib import Path


class DataError(SystemExit):
    """A problem with the data set, reported as one clear sentence (exits without a traceback)."""


def load_rows(dataset: str, split: str, fields: list[str], limit: int | None = None) -> list[dict]:
    """Rows of `dataset` (split `split`) that all have non-empty `fields`; `limit` keeps the first rows.

    `dataset` is `tiny` (the built-in task; splits `train`/`test`), a `.json` / `.jsonl` file, a folder written
    by `datasets.save_to_disk`, or a hub id.
    """
    if dataset == "tiny":
        from common.tiny import tiny_dataset

        rows = tiny_dataset(split)
    elif dataset.endswith((".json", ".jsonl")):
        rows = _read_json(Path(dataset))
    elif os.path.isdir(dataset):
        rows = _read_hf(dataset, split, from_disk=True)
    else:
        rows = _read_hf(dataset, split, from_disk=False)
    if limit is not None:
        rows = rows[:limit]
    if not rows:
        raise DataError(f"dataset {dataset!r} (split {split!r}) has no rows.")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"dataset {dataset!r}: row {i} is a {type(row).__name__}, not an object with fields.")
        for f in fields:
            value = row.get(f)
            if value is None or (isinstance(value, str) and not value.strip()):
                what = "is missing field" if f not in row else "has an empty field"
                raise DataError(
                    f"dataset {dataset!r}: row {i} {what} {f!r} (fields present: {sorted(row)}); "
                    f"choose the field with the matching --*-field flag."
                )
    return rows


def _read_json(path: Path) -> list[dict]:
    if not path.exists():
        raise DataError(f"dataset file {str(path)!r} does not exist.")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DataError(f"dataset file {str(path)!r}: line {n} is not valid JSON ({e.msg}).") from None
        return rows
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"dataset file {str(path)!r} is not valid JSON ({e.msg}, line {e.lineno}).") from None
    if isinstance(data, dict):  # {"train": [...]} or a single list under some key
        lists = [v for v in data.values() if isinstance(v, list)]
        data = lists[0] if len(lists) == 1 else data
    if not isinstance(data, list):
        raise DataError(f"dataset file {str(path)!r} must hold a list of objects (or one JSON object per line).")
    return data


def _read_hf(dataset: str, split: str, from_disk: bool) -> list[dict]:
    try:
        import datasets

        if from_disk:
            ds = datasets.load_from_disk(dataset)
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise DataError(f"dataset folder {dataset!r} has splits {list(ds)}, not {split!r}.")
                ds = ds[split]
        else:
            ds = datasets.load_dataset(dataset, split=split)
    except DataError:
        raise
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(
            f"could not load dataset {dataset!r} (split {split!r}): {reason[:300]}. "
            f"Check the name and your network, or pass a local .json/.jsonl file (or `tiny`)."
        ) from None
    return [dict(r) for r in ds]
