"""SWE-bench-style records as they are published: through Hugging Face ``datasets``.

``envs.domains.code_repo.dataset=PATH`` names a local dataset instead of ``instances.jsonl``:

- a file: ``.parquet``, ``.arrow`` or ``.jsonl`` / ``.json`` (``datasets.load_dataset`` with the
  ``parquet`` / ``arrow`` / ``json`` builder; a file holds one split, ``train``);
- a directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``
  (``datasets.load_from_disk``; ``dataset_split`` picks a ``DatasetDict``'s split).

``dataset_columns`` maps a field to the column that holds it where a SWE-bench variant names it
differently (``{FAIL_TO_PASS: fail_to_pass}``). A record needs ``REQUIRED``; the test lists
may be lists or JSON strings of one (both of SWE-bench's encodings, ``records.parse_test_list``).
A record missing a required field is a ``ValueError`` naming the field, the record (its row and
``instance_id``) and the columns the dataset has. Each record runs on its repository's git bundle
(``repos/<name>.bundle`` in ``repos_root``, as ``instances.jsonl`` does).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jointrl.envs.code_repo.records import SweRecord

REQUIRED = ("instance_id", "repo", "base_commit", "patch", "test_patch", "problem_statement",
            "FAIL_TO_PASS", "PASS_TO_PASS")
OPTIONAL = ("wrong_patch",)
BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "json", ".json": "json"}


def load_rows(path: Path, split: str = "train") -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of the dataset at ``path`` (file or ``save_to_disk`` directory) and its columns."""
    import datasets  # lazy: only a run that names a dataset pays for importing it

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # the preflight's error is one line on stderr
    try:
        return _load(datasets, path, split)
    finally:
        if bars:
            datasets.enable_progress_bars()


def _load(datasets: Any, path: Path, split: str) -> tuple[list[dict[str, Any]], list[str]]:
    if path.is_dir():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ValueError(f"dataset {str(path)!r} has no split {split!r}; its splits: {list(loaded)}")
            loaded = loaded[split]
    elif path.is_file():
        if path.suffix not in BUILDERS:
            raise ValueError(f"dataset {str(path)!r}: unknown file type {path.suffix!r}; known: {list(BUILDERS)} "
                             f"or a save_to_disk directory")
        if split != "train":
            raise ValueError(f"dataset {str(path)!r} is one file, which holds one split, 'train'; got split {split!r}")
        loaded = datasets.load_dataset(BUILDERS[path.suffix], data_files=str(path), split="train")
    else:
        raise ValueError(f"dataset {str(path)!r} does not exist")
    return loaded.to_list(), list(loaded.column_names)


def read_dataset(path: str | Path, repos_root: Path | None = None, split: str = "train",
                 columns: dict[str, str] | None = None) -> list[SweRecord]:
    """The records of the dataset at ``path``, in its order; bundles from ``repos_root/repos``
    (default: the folder holding the dataset). Raises ``ValueError`` on the first bad record."""
    path = Path(path)
    rows, names = load_rows(path, split)
    columns = dict(columns or {})
    if unknown := sorted(set(columns) - set(REQUIRED) - set(OPTIONAL)):
        raise ValueError(f"dataset_columns maps unknown fields {unknown}; fields: {list(REQUIRED + OPTIONAL)}")
    repos = (path.parent if repos_root is None else Path(repos_root)) / "repos"
    records = []
    for n, row in enumerate(rows):
        raw = {field: row.get(columns.get(field, field)) for field in REQUIRED + OPTIONAL}
        where = f"dataset {str(path)!r} record {n} (instance_id {raw['instance_id']!r})"
        for field in REQUIRED:
            if raw[field] is None:
                col = columns.get(field, field)
                raise ValueError(f"{where}: required field {field!r} is missing (no value in column {col!r}; "
                                 f"its columns: {names}; envs.domains.code_repo.dataset_columns maps a field "
                                 f"to another column)")
        raw["wrong_patch"] = raw["wrong_patch"] or ""
        try:
            records.append(SweRecord.from_dict(raw, repos))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
    ids = [r.instance_id for r in records]
    if dupes := sorted({i for i in ids if ids.count(i) > 1}):
        raise ValueError(f"dataset {str(path)!r}: duplicate instance ids {dupes[:5]}")
    return records
