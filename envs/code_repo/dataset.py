"""SWE-bench-style records as they are published: through Hugging Face ``datasets``.

``envs.domains.code_repo.dataset=PATH`` names a local dataset instead of ``instances.jsonl``: a ``.parquet`` / ``.arrow`` / ``.jsonl`` file or a ``save_to_disk`` directory
(``envs/dataset_files.load_rows``; ``dataset_split`` picks a ``DatasetDict``'s split).

``dataset_columns`` maps a field to the column that holds it where a SWE-bench variant names it
differently (``{FAIL_TO_PASS: fail_to_pass}``). A record needs ``REQUIRED``; the test lists
may be lists or JSON strings of one (both of SWE-bench's encodings, ``records.parse_test_list``).
A record missing a required field is a ``ValueError`` naming the field, the record (its row and
``instance_id``) and the columns the dataset has. Each record runs on its repository's git bundle
(``repos/<name>.bundle`` in ``repos_root``, as ``instances.jsonl`` does).
"""

from __future__ import annotations

from pathlib import Path

from jointrl.envs.code_repo.records import SweRecord
from jointrl.envs.dataset_files import load_rows

REQUIRED = ("instance_id", "repo", "base_commit", "patch", "test_patch", "problem_statement",
            "FAIL_TO_PASS", "PASS_TO_PASS")
OPTIONAL = ("wrong_patch",)


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
