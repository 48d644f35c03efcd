"""``dataset``: local Parquet, Arrow or JSON(L) files read through the ``datasets`` library (extra ``datasets``).

The same task as ``jsonl`` (:mod:`hacrl_fed.tasks.jsonl_math`: the same params ``path``, ``test_path``,
``test_fraction``, ``question_field``, ``answer_field``, ``answer_format``, ``system_prompt``, ``prompt_template``,
``reward_fn``; the same split and id rules and the same verifier), with the rows read from another file format:

- ``format: auto`` (default) picks by the path: ``*.parquet`` → Parquet, ``*.arrow`` → an Arrow file as
  ``datasets`` writes it, ``*.json`` / ``*.jsonl`` → JSON(L), a directory → ``Dataset.save_to_disk`` output;
- ``format: parquet | arrow | json | disk`` forces one.

Only local paths are read (never a hub id), with ``HF_DATASETS_OFFLINE=1`` and a throw-away cache, so nothing is
downloaded or left behind. Row ids are the row order of the file; a row is named ``FILE row N`` (N from 1) in
errors, a missing column by the file, the column and the param that names it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Literal

from hacrl_fed.config import BuildError
from hacrl_fed.tasks.base import register_task
from hacrl_fed.tasks.jsonl_math import JsonlMathParams, JsonlMathTask, Row, _row

_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".jsonl": "json"}


class DatasetParams(JsonlMathParams):
    format: Literal["auto", "parquet", "arrow", "json", "disk"] = "auto"


def _format_of(path: Path, fmt: str, param: str) -> str:
    if fmt != "auto":
        return fmt
    if path.is_dir():
        return "disk"
    found = _SUFFIXES.get(path.suffix.lower())
    if found is None:
        raise BuildError(
            f"task.params.{param}: cannot tell the format of {path} from its suffix "
            f"(expected one of {sorted(_SUFFIXES)} or a save_to_disk folder); set task.params.format"
        )
    return found


def read_table(path: str, fmt: str, param: str) -> Any:
    """A ``datasets.Dataset`` of the local file or folder ``path`` (module docstring); :class:`BuildError`
    naming ``task.params.<param>`` for a missing path, a missing ``datasets`` package or an unreadable file."""
    file = Path(path).expanduser()
    if not file.exists():
        raise BuildError(f"task.params.{param}: file not found: {path}")
    kind = _format_of(file, fmt, param)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise BuildError("task.name=dataset needs the `datasets` package: pip install 'hacrl-fed[datasets]'") from None
    datasets.disable_progress_bars()
    try:
        with tempfile.TemporaryDirectory(prefix="hacrl-datasets-") as cache:
            if kind == "parquet":
                table = datasets.Dataset.from_parquet(str(file), cache_dir=cache, keep_in_memory=True)
            elif kind == "json":
                table = datasets.Dataset.from_json(str(file), cache_dir=cache, keep_in_memory=True)
            elif kind == "arrow":
                table = datasets.Dataset.from_file(str(file), in_memory=True)
            else:
                table = datasets.load_from_disk(str(file), keep_in_memory=True)
    except Exception as err:  # pyarrow / datasets errors of every kind: one line naming the file
        first = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
        raise BuildError(f"task.params.{param}: cannot read {path} as {kind}: {type(err).__name__}: {first}") from err
    if not isinstance(table, datasets.Dataset):
        raise BuildError(f"task.params.{param}: {path} holds several splits ({list(table)}); point at one of them")
    return table


def load_table_rows(path: str, p: DatasetParams, param: str) -> list[Row]:
    """The rows of a local dataset file with the ``jsonl`` checks (a missing column names the file, the column
    and the param; a bad value names the file and row)."""
    table = read_table(path, p.format, param)
    columns = list(table.column_names)
    for column, name in ((p.question_field, "question_field"), (p.answer_field, "answer_field")):
        if column not in columns:
            raise BuildError(f"{path}: no column {column!r} (task.params.{name}); columns: {columns}")
    if len(table) == 0:
        raise BuildError(f"task.params.{param}: {path} has no rows")
    questions, answers = table[p.question_field], table[p.answer_field]
    return [
        _row({p.question_field: q, p.answer_field: a}, f"{path} row {i}", p)
        for i, (q, a) in enumerate(zip(questions, answers), 1)
    ]


@register_task("dataset")
class DatasetTask(JsonlMathTask):
    """``jsonl``'s task over a Parquet / Arrow / JSON(L) file read with ``datasets`` (module docstring)."""

    Params = DatasetParams
    params: DatasetParams

    def load(self, path: str, param: str) -> list[Row]:
        return load_table_rows(path, self.params, param)
