#!/bin/bash
# Verifier: the project/ tree exists with its two empty files
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
for d in project project/src project/tests project/docs; do [ -d "$d" ] || fail "missing dir $d"; done
for f in project/README.md project/src/__init__.py; do
    [ -f "$f" ] || fail "missing file $f"
    [ -s "$f" ] && fail "$f is not empty"
done
true
echo 1 > /logs/verifier/reward.txt
echo PASS
