"""Rows of a local Hugging Face ``datasets`` file or directory, as plain Python values.

- a file: ``.parquet``, ``.arrow`` or ``.jsonl`` / ``.json`` (``datasets.load_dataset`` with the
  ``parquet`` / ``arrow`` / ``json`` builder; a file holds one split, ``train``);
- a directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``
  (``datasets.load_from_disk``; ``split`` picks a ``DatasetDict``'s split).

Used by the code_repo records (``code_repo/dataset.py``) and ``jointrl sft``'s transcripts
(``rl/sft_data.py``). Nothing is fetched: a path that does not exist is a ``ValueError``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
