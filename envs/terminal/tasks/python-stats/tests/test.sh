#!/bin/bash
# Verifier: stats.py computes min, max and mean of any file
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
[ -f stats.py ] || fail "stats.py missing"
got=$(python3 stats.py /tests/hidden.txt) || fail "stats.py failed"
[ "$got" = "-833 891 -12.32" ] || fail "hidden input: got '$got'"
got=$(python3 stats.py numbers.txt)
[ "$got" = "-12 498 160.10" ] || fail "numbers.txt: got '$got'"
echo 1 > /logs/verifier/reward.txt
echo PASS
