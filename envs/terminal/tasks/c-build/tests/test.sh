#!/bin/bash
# Verifier: calc is a compiled ELF binary that sums its arguments
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
[ -x calc ] || fail "calc missing or not executable"
[ "$(head -c 4 calc | od -An -c | tr -d ' ')" = "177ELF" ] || fail "calc is not an ELF binary"
[ "$(./calc 2 3 4)" = 9 ] || fail "calc 2 3 4 gave $(./calc 2 3 4)"
[ "$(./calc 10 -3)" = 7 ] || fail "calc 10 -3 gave $(./calc 10 -3)"
[ "$(./calc)" = 0 ] || fail "calc without arguments gave $(./calc)"
echo 1 > /logs/verifier/reward.txt
echo PASS
