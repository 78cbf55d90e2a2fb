#!/bin/bash
# Verifier: top3.txt lists the three most frequent words with counts, most frequent first
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
[ -f top3.txt ] || fail "top3.txt missing"
diff <(sed 's/[[:space:]]*$//' top3.txt) /tests/expected.txt || fail "top3.txt is wrong"
echo 1 > /logs/verifier/reward.txt
echo PASS
