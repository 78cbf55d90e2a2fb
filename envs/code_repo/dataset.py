"""SWE-bench-style records as they are published: through Hugging Face ``datasets``.

``envs.domains.code_repo.dataset=PATH`` names a local dataset instead of ``instances.jsonl``: a ``.parquet`` / ``.arrow`` / ``.jsonl`` file or a ``save_to_disk`` directory
(``envs/dataset_files.load_rows``; ``dataset_split`` picks a ``DatasetDict``'s split).

``dataset_columns`` maps a field to the column that holds it where a SWE-bench variant names it
differently (``{FAIL_TO_PASS: fail_to_pass}``). A record needs ``REQUIRED``; the test lists
may be lists or JSON strings of one (both of SWE-bench's encodings, ``records.parse_test_list``).
A record missing a required field is a ``ValueError`` naming the field, the record (its row and
``instance_id``) and the columns the dataset has. On bwrap each record runs on its repository's
git bundle (``repos/<name>.bundle`` in ``repos_root``, as ``instances.jsonl`` does); on docker on
its image (``image_name`` or ``dataset_image``; ``images.py``), the repository at its ``workdir``.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from jointrl.envs.code_repo.images import image_name
from jointrl.envs.code_repo.records import SweRecord
from jointrl.envs.dataset_files import load_rows

REQUIRED = ("instance_id", "repo", "base_commit", "patch", "test_patch", "problem_statement",
            "FAIL_TO_PASS", "PASS_TO_PASS")
OPTIONAL = ("wrong_patch", "image_name", "workdir")
IMAGE_WORKDIR = "/testbed"  # where SWE-bench's images hold the repository (a record's ``workdir`` overrides)


def read_dataset(path: str | Path, repos_root: Path | None = None, split: str = "train",
                 columns: dict[str, str] | None = None, image_template: str | None = None) -> list[SweRecord]:
    """The records of the dataset at ``path``, in its order. ``image_template`` None: each runs on
    its bundle in ``repos_root/repos`` (default: the folder holding the dataset); else on its Docker
    image, named by the template ("": by its ``image_name``), the repository at its ``workdir``
    (default ``/testbed``). Raises ``ValueError`` on the first bad record."""
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
        image = ""
        if image_template is not None:
            image = image_name(image_template, raw["repo"], raw["instance_id"]) if image_template else raw["image_name"]
            if not image:
                raise ValueError(f"{where}: no Docker image: its {columns.get('image_name', 'image_name')!r} is empty "
                                 f"and envs.domains.code_repo.dataset_image (a template) is not set")
        try:
            records.append(SweRecord.from_dict(raw, None, image, raw["workdir"] or IMAGE_WORKDIR) if image_template
                           is not None else SweRecord.from_dict(raw, repos))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
    if dupes := sorted(i for i, n in Counter(r.instance_id for r in records).items() if n > 1):
        raise ValueError(f"dataset {str(path)!r}: duplicate instance ids {dupes[:5]}")
    return records
