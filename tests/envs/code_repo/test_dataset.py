"""code_repo records through Hugging Face ``datasets``: a parquet file and a ``save_to_disk``
directory of SWE-bench-format records over the shipped tiny repositories (built here, no
network), both encodings of the test lists, renamed columns; the records play on bwrap through
``jointrl eval``; a record missing a field fails before Ray, naming it."""

from __future__ import annotations

import json
import shutil
import subprocess

import datasets
import pytest

from jointrl.envs.code_repo.records import DATA_DIR, SweRecord, read_records
from jointrl.envs.registry import DatasetSource, load_tasks, scripted_policy
from jointrl.envs.sandbox.docker import unavailable_reason
from jointrl.rl.eval import main
from jointrl.rl.preflight import guard

PICKED = ("ledger-2", "unitconv-1")  # one instance of each of two tiny repositories


def swe_rows(lists: bool = False) -> list[dict]:
    """The picked shipped instances as SWE-bench rows; the test lists as JSON strings (SWE-bench's
    dataset) or, with ``lists``, as lists (SWE-Gym's)."""
    rows = [json.loads(line) for line in (DATA_DIR / "instances.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["instance_id"] in PICKED]
    for r in rows:
        for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
            tests = json.loads(r[key]) if isinstance(r[key], str) else r[key]
            r[key] = tests if lists else json.dumps(tests)
        r["image_name"] = f"jointrl/{r['repo'].split('/')[-1]}:latest"  # extra columns are ignored
    return rows


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """``swe.parquet`` (JSON-string test lists) and ``swe_disk/`` (a DatasetDict with list test
    lists under SWE-Gym-like lower-case column names), ``repos/`` beside them."""
    root = tmp_path_factory.mktemp("published")
    shutil.copytree(DATA_DIR / "repos", root / "repos")
    datasets.Dataset.from_list(swe_rows()).to_parquet(str(root / "swe.parquet"))
    renamed = [{k.lower() if k in ("FAIL_TO_PASS", "PASS_TO_PASS") else k: v for k, v in r.items()}
               for r in swe_rows(lists=True)]
    datasets.DatasetDict({"test": datasets.Dataset.from_list(renamed)}).save_to_disk(str(root / "swe_disk"))
    return root


def _fields(task) -> dict:
    m = dict(SweRecord.from_task(task).to_metadata())
    m.pop("source")
    return m


def test_both_encodings_and_renamed_columns_give_the_shipped_records(published):
    shipped = {t.id: _fields(t) for t in load_tasks("code_repo") if t.id in PICKED}
    from_parquet = load_tasks("code_repo", dataset=DatasetSource(str(published / "swe.parquet")))
    from_disk = load_tasks("code_repo", dataset=DatasetSource(
        str(published / "swe_disk"), "test", {"FAIL_TO_PASS": "fail_to_pass", "PASS_TO_PASS": "pass_to_pass"}))
    for tasks in (from_parquet, from_disk):
        assert [t.id for t in tasks] == sorted(PICKED)
        assert {t.id: _fields(t) for t in tasks} == shipped
        assert all(SweRecord.from_task(t).source.parent == published / "repos" for t in tasks)
    assert len(read_records()) == 20  # the shipped set is unchanged by the dataset path


def test_a_missing_field_or_split_fails_before_ray_naming_it(published, capsys):
    rows = swe_rows()
    rows[1]["patch"] = None  # the column is there, one record's value is not
    datasets.Dataset.from_list(rows).to_parquet(str(published / "bad.parquet"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        guard("eval", ["envs=code_repo", f"envs.domains.code_repo.dataset={published / 'bad.parquet'}", "split=all"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert "record 1 (instance_id 'ledger-2'): required field 'patch' is missing" in err, err
    with pytest.raises(ValueError, match=r"has no split 'train'; its splits: \['test'\]"):
        load_tasks("code_repo", dataset=DatasetSource(str(published / "swe_disk")))
    with pytest.raises(ValueError, match=r"field 'FAIL_TO_PASS' is missing .*'fail_to_pass'"):
        load_tasks("code_repo", dataset=DatasetSource(str(published / "swe_disk"), "test"))


@pytest.mark.parametrize(("policy", "score"), [("oracle", 1.0), ("noop", 0.0), ("wrong", 0.0)])
def test_jointrl_eval_scores_gold_one_noop_and_wrong_zero_on_bwrap(published, tmp_path, policy, score):
    result = main([f"policy={policy}", "envs=code_repo", f"envs.domains.code_repo.dataset={published / 'swe.parquet'}",
                   "split=all", "tier=low", "k=1", f"out={tmp_path}", "logger.wandb_mode=disabled"])
    (row,) = result["rows"]
    assert (row["domain"], row["tasks"], row["env_error"]) == ("code_repo", 2, 0), result["episodes"]
    assert row["pass@1"] == score, result["episodes"]
    assert sorted(e["task_id"] for e in result["episodes"]) == sorted(PICKED)


# --- the same records on the docker backend, one image per repository built here -------------

needs_docker = pytest.mark.skipif(unavailable_reason() is not None, reason=f"docker: {unavailable_reason()}")
BASE = "FROM debian:bookworm-slim\nRUN apt-get update && apt-get install -y --no-install-recommends python3 " \
       "python3-pytest git && rm -rf /var/lib/apt/lists/*\n"  # Debian's packages: no registry but Debian's


def build_repo_images(root) -> dict[str, str]:
    """One image per tiny repository, as SWE-bench's: a Debian base with python3, pytest and git,
    the repository (cloned from its bundle: full history, checked out at its last commit) at
    ``/testbed``, the WORKDIR. Returns {repo name: image tag}."""
    import docker

    cli = docker.from_env(timeout=600)
    tags = {}
    for name in sorted({r["repo"].split("/")[-1] for r in swe_rows()}):
        ctx = root / f"ctx-{name}"
        ctx.mkdir()
        subprocess.run(["git", "clone", "-q", str(DATA_DIR / "repos" / f"{name}.bundle"), str(ctx / "repo")], check=True)
        (ctx / "Dockerfile").write_text(BASE + "COPY repo /testbed\nWORKDIR /testbed\n")
        tags[name] = f"jointrl-test-swe-{name}:latest"
        cli.images.build(path=str(ctx), tag=tags[name], rm=True, forcerm=True)
    return tags


@pytest.fixture(scope="module")
def imaged(published, tmp_path_factory):
    """``swe_images.parquet``: the records naming their images (no bundles beside it)."""
    root = tmp_path_factory.mktemp("imaged")
    tags = build_repo_images(root)
    rows = swe_rows()
    for r in rows:
        r["image_name"] = tags[r["repo"].split("/")[-1]]
    datasets.Dataset.from_list(rows).to_parquet(str(root / "swe_images.parquet"))
    return root


@needs_docker
@pytest.mark.slow
@pytest.mark.parametrize(("policy", "score"), [("oracle", 1.0), ("noop", 0.0), ("wrong", 0.0)])
def test_jointrl_eval_scores_gold_one_noop_and_wrong_zero_on_docker_images(imaged, tmp_path, policy, score):
    result = main([f"policy={policy}", "envs=code_repo", f"envs.domains.code_repo.dataset={imaged / 'swe_images.parquet'}",
                   "envs.sandbox.backend=docker", "split=all", "tier=low", "k=1", f"out={tmp_path}",
                   "logger.wandb_mode=disabled"])
    (row,) = result["rows"]
    assert (row["domain"], row["tasks"], row["env_error"]) == ("code_repo", 2, 0), result["episodes"]
    assert row["pass@1"] == score, result["episodes"]


@needs_docker
def test_a_missing_image_is_listed_once_at_load_and_fails_its_task(published, tmp_path, capsys):
    rows = swe_rows()
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "x.parquet"))
    source = DatasetSource(str(tmp_path / "x.parquet"), image="jointrl-test-absent-{name}:{instance_id}")
    tasks = load_tasks("code_repo", backend="docker", dataset=source)
    load_tasks("code_repo", backend="docker", dataset=source)
    err = capsys.readouterr().err
    assert err.count("docker images not on this host") == 1, err
    assert "jointrl-test-absent-ledger:ledger-2 (ledger-2)" in err and "jointrl-test-absent-unitconv:unitconv-1" in err
    assert [t.id for t in tasks] == sorted(PICKED) and "/testbed" in tasks[0].prompt
    with pytest.raises(ValueError, match="is not on this host"):
        scripted_policy(tasks[0], "oracle")
    with pytest.raises(ValueError, match="set envs.domains.code_repo.dataset"):
        load_tasks("code_repo", backend="docker")
