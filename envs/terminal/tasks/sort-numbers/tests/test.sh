#!/bin/bash
# Verifier: sorted.txt holds numbers.txt sorted numerically ascending
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
[ -f sorted.txt ] || fail "sorted.txt missing"
diff -q /tests/expected.txt sorted.txt >/dev/null || fail "sorted.txt differs from the expected order"
echo 1 > /logs/verifier/reward.txt
echo PASS
