#!/bin/bash
# Verifier: total.txt holds the sum of the amount column (11579.52)
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
[ -f total.txt ] || fail "total.txt missing"
got=$(tr -d ' \t\n' < total.txt)
[ "$got" = "11579.52" ] || fail "expected 11579.52, got '$got'"
echo 1 > /logs/verifier/reward.txt
echo PASS
