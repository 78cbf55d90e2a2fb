#!/bin/bash
# Verifier: unique.txt holds emails.txt without repeats, in first-seen order
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
[ -f unique.txt ] || fail "unique.txt missing"
diff /tests/expected.txt unique.txt || fail "unique.txt is wrong"
echo 1 > /logs/verifier/reward.txt
echo PASS
