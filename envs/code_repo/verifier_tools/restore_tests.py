"""Restore a repository's test infrastructure from the task, inside the verification sandbox.

usage: python3 -I restore_tests.py CANON WORK

Deletes, anywhere under WORK, every test directory (``tests``, ``test``, ``testing``), test
file (``test_*.py``, ``*_test.py``) and pytest configuration or plugin file (``conftest.py``,
``pytest.ini``, ``.pytest.ini``, ``tox.ini``, ``setup.cfg``, ``pyproject.toml``), whatever the
agent did to them, then copies CANON -- the same kinds of files at the task's base commit
with its test_patch applied -- into WORK. Symlinks are removed, never followed.
"""

import os
import shutil
import sys

TEST_DIRS = {"tests", "test", "testing"}
CONFIG_FILES = {"conftest.py", "pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml"}


def is_test_file(name):
    return name in CONFIG_FILES or name.endswith("_test.py") or (name.startswith("test_") and name.endswith(".py"))


def remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def scrub(work):
    for root, dirs, files in os.walk(work):
        keep = []
        for d in dirs:
            path = os.path.join(root, d)
            if d in TEST_DIRS:
                remove(path)
            elif not os.path.islink(path):
                keep.append(d)
        dirs[:] = keep
        for f in files:
            if f in TEST_DIRS or is_test_file(f):
                os.unlink(os.path.join(root, f))


def restore(canon, work):
    for root, dirs, files in os.walk(canon):
        rel = os.path.relpath(root, canon)
        dest_dir = os.path.normpath(os.path.join(work, rel))
        if os.path.islink(dest_dir) or (os.path.exists(dest_dir) and not os.path.isdir(dest_dir)):
            os.unlink(dest_dir)
        os.makedirs(dest_dir, exist_ok=True)
        for f in files:
            dest = os.path.join(dest_dir, f)
            if os.path.lexists(dest):
                remove(dest)
            shutil.copyfile(os.path.join(root, f), dest)


if __name__ == "__main__":
    canon_dir, work_dir = sys.argv[1:3]
    scrub(work_dir)
    restore(canon_dir, work_dir)
