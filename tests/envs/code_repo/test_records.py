"""SWE-bench-style records: both test-list encodings, bad records, the shipped set and its build."""

from __future__ import annotations

import doctest
import json
import shutil
import subprocess

import pytest

import jointrl.envs.code_repo.policies
import jointrl.envs.code_repo.records
import jointrl.envs.code_repo.tools
from jointrl.envs.base import Task
from jointrl.envs.code_repo import DATA_DIR, SweRecord, load_policy, load_tasks, read_records
from jointrl.envs.code_repo.build_instances import build
from jointrl.envs.code_repo.policies import replace_calls
from jointrl.envs.code_repo.snapshot import RepoStore, default_store
from jointrl.envs.code_repo.specs import Bug, RepoSpec

RAW = [json.loads(line) for line in (DATA_DIR / "instances.jsonl").read_text().splitlines()]


def folder(tmp_path, records, source="bundle"):
    (tmp_path / "repos").mkdir()
    if source == "bundle":
        shutil.copy(DATA_DIR / "repos" / "unitconv.bundle", tmp_path / "repos")
    else:  # a plain git directory works as well
        subprocess.run(["git", "clone", "-q", str(DATA_DIR / "repos" / "unitconv.bundle"), str(tmp_path / "repos" / "unitconv")],
                       check=True)
    (tmp_path / "instances.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return tmp_path


def test_doctests():
    for module in (jointrl.envs.code_repo.records, jointrl.envs.code_repo.policies, jointrl.envs.code_repo.tools):
        assert doctest.testmod(module).failed == 0, module.__name__


@pytest.mark.parametrize("source", ["bundle", "directory"])
def test_string_and_list_encodings_and_both_sources(tmp_path, source):
    as_string = RAW[0]
    as_list = {**RAW[1], "FAIL_TO_PASS": json.loads(RAW[1]["FAIL_TO_PASS"]),
               "PASS_TO_PASS": json.loads(RAW[1]["PASS_TO_PASS"]), "extra_field": 1}
    records = read_records(folder(tmp_path, [as_string, as_list], source))
    assert [r.fail_to_pass for r in records] == [tuple(json.loads(r["FAIL_TO_PASS"])) for r in RAW[:2]]
    store = RepoStore(tmp_path / "cache")
    assert (store.workdir(records[1]) / "unitconv" / "units.py").is_file()
    assert "test_alias_ignores_case" in (store.canon(records[1]) / "tests" / "test_parse.py").read_text()
    assert not (store.canon(records[1]) / "unitconv").exists()  # only test infrastructure is restored


@pytest.mark.parametrize(("change", "message"), [
    ({"patch": None}, "field 'patch' must be a string"),
    ({"FAIL_TO_PASS": "[not json"}, "not a JSON list"),
    ({"FAIL_TO_PASS": "[]"}, "FAIL_TO_PASS is empty"),
    ({"PASS_TO_PASS": [1]}, "must be a list of test ids"),
    ({"PASS_TO_PASS": ["/abs/test.py::t"]}, "relative 'path::name'"),
    ({"FAIL_TO_PASS": ["tests/test_x.py"]}, "relative 'path::name'"),
    ({"repo": "jointrl/nowhere"}, "neither nowhere.bundle nor nowhere/"),
])
def test_bad_records_name_the_instance_and_field(tmp_path, change, message):
    with pytest.raises(ValueError, match=message) as e:
        read_records(folder(tmp_path, [{**RAW[0], **change}]))
    assert RAW[0]["instance_id"] in str(e.value) or "repository" in str(e.value)


def test_duplicate_ids_and_foreign_tasks_are_refused(tmp_path):
    with pytest.raises(ValueError, match="duplicate instance ids"):
        read_records(folder(tmp_path, [RAW[0], RAW[0]]))
    with pytest.raises(ValueError, match="not a code_repo task"):
        SweRecord.from_task(Task(id="t", domain="terminal", prompt="p"))
    with pytest.raises(ValueError, match="available"):
        load_policy(load_tasks()[0], "cheat")


def test_shipped_set():
    tasks = load_tasks()
    assert len(tasks) >= 20
    by_repo: dict[str, list[Task]] = {}
    for t in tasks:
        by_repo.setdefault(t.metadata["swe"]["repo"], []).append(t)
        assert len(t.metadata["swe"]["pass_to_pass"]) >= 5 and t.reward == {"swe_tests": 1.0}
    assert len(by_repo) >= 4
    size = sum(p.stat().st_size for p in DATA_DIR.rglob("*") if p.is_file())
    assert size < 300_000, size
    for repo, repo_tasks in by_repo.items():
        bundle = DATA_DIR / "repos" / (repo.split("/")[-1] + ".bundle")
        heads = subprocess.run(["git", "bundle", "list-heads", str(bundle)], capture_output=True, text=True,
                               check=True).stdout
        record = SweRecord.from_task(repo_tasks[0])
        modules = [p for p in default_store().workdir(record).rglob("*.py")
                   if "tests" not in p.parts and p.name != "__init__.py"]
        assert len(modules) >= 3, repo
        for t in repo_tasks:
            assert f"{t.metadata['swe']['base_commit']} refs/heads/{t.id}" in heads


def apply(text: str, calls) -> str:
    for c in calls:
        if c.name == "create":
            text = c.arguments["content"]
            continue
        old, new = c.arguments["old_str"], c.arguments["new_str"]
        assert len(jointrl.envs.code_repo.tools.find_all(text, old)) == 1
        text = text.replace(old, new)
    return text


def test_replace_calls_reproduce_every_shipped_patch():
    for record in read_records():
        for patch in (record.patch, record.wrong_patch):
            before, after = default_store().patched(record, patch)
            for path in before:
                assert apply(before[path], replace_calls(path, before[path], after[path])) == after[path]


def test_replace_calls_widen_context_until_unique():
    before = "x = 1\ny = 2\nx = 1\nz = 3\n"
    calls = replace_calls("f.py", before, "x = 1\ny = 2\nx = 10\nz = 3\n")
    assert [c.arguments["old_str"] for c in calls] == ["x = 1\nz = 3\n"]  # one line after it is enough
    assert apply(before, calls) == "x = 1\ny = 2\nx = 10\nz = 3\n"
    before = "a = 0\nx = 1\nz = 3\nx = 1\nz = 3\n"  # after: not unique; before: unique
    calls = replace_calls("f.py", before, "a = 0\nx = 10\nz = 3\nx = 1\nz = 3\n")
    assert [c.arguments["old_str"] for c in calls] == ["a = 0\nx = 1\n"]
    before = "q\nx\nq\nq\nx\nq\np\n"  # neither side alone: both, then one more after
    calls = replace_calls("f.py", before, "q\nx\nq\nq\nX\nq\np\n")
    assert apply(before, calls) == "q\nx\nq\nq\nX\nq\np\n" and calls[0].arguments["old_str"] == "q\nx\nq\np\n"
    assert apply("a\n", replace_calls("f", "a\n", "a\na\n")) == "a\na\n"


@pytest.mark.slow
def test_build_reproduces_the_shipped_records(tmp_path):
    """The build script rebuilds every repository and record (same commit ids) and checks each instance."""
    build(tmp_path)
    assert (tmp_path / "instances.jsonl").read_text() == (DATA_DIR / "instances.jsonl").read_text()


def _tiny_spec(wrong_new: str, f2p: str = "tests/test_m.py::test_f") -> RepoSpec:
    tests = "".join(f"def test_ok{i}():\n    assert True\n\n\n" for i in range(5))
    return RepoSpec(name="tiny", files={"pkg/__init__.py": "", "pkg/m.py": "def f():\n    return 1\n",
                                        "tests/test_m.py": "from pkg.m import f\n\n\n" + tests},
                    bugs=[Bug(id="tiny-1", problem="f() should be 1", breaks=[("pkg/m.py", "return 1", "return 2")],
                              tests={"tests/test_m.py": "def test_f():\n    assert f() == 1\n"},
                              fail_to_pass=[f2p], wrong=[("pkg/m.py", "return 2", wrong_new)])])


@pytest.mark.slow
def test_build_checks_every_instance_by_running_its_tests(tmp_path):
    """A wrong patch that passes, or a FAIL_TO_PASS test that passes at the base commit, stops the build."""
    records = build(tmp_path / "ok", [_tiny_spec("return 3")])
    assert json.loads(records[0]["PASS_TO_PASS"]) == [f"tests/test_m.py::test_ok{i}" for i in range(5)]
    with pytest.raises(ValueError, match="the wrong patch passes every test"):
        build(tmp_path / "wrong", [_tiny_spec("return 1")])
    with pytest.raises(ValueError, match="test_ok0 does not fail at the base commit"):
        build(tmp_path / "f2p", [_tiny_spec("return 3", f2p="tests/test_m.py::test_ok0")])
