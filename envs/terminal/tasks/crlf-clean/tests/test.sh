#!/bin/bash
# Verifier: notes.txt has LF endings and no trailing blanks
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
cmp -s notes.txt /tests/expected.txt || fail "notes.txt: $(od -c notes.txt | head -5)"
echo 1 > /logs/verifier/reward.txt
echo PASS
