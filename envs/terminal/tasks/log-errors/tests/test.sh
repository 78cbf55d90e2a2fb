#!/bin/bash
# Verifier: codes.txt holds the ERROR counts per code
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
[ -f codes.txt ] || fail "codes.txt missing"
diff <(sed 's/[[:space:]]*$//' codes.txt) /tests/expected.txt || fail "codes.txt differs"
echo 1 > /logs/verifier/reward.txt
echo PASS
