#!/bin/bash
# Verifier: count.txt holds the line count of access.log (137)
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
[ -f count.txt ] || fail "count.txt missing"
got=$(tr -d ' \t\n' < count.txt)
[ "$got" = "137" ] || fail "expected 137, got '$got'"
echo 1 > /logs/verifier/reward.txt
echo PASS
