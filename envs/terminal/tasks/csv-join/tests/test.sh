#!/bin/bash
# Verifier: totals.csv holds every customer's order total
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
[ -f totals.csv ] || fail "totals.csv missing"
diff <(tr -d '\r' < totals.csv) /tests/expected.csv || fail "totals.csv differs"
echo 1 > /logs/verifier/reward.txt
echo PASS
