#!/bin/bash
# Verifier: top.txt names the customer with the largest total
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
[ -f top.txt ] || fail "top.txt missing"
[ "$(tr -d ' \n' < top.txt)" = Linus ] || fail "top.txt holds '$(cat top.txt)'"
echo 1 > /logs/verifier/reward.txt
echo PASS
