#!/bin/bash
# Verifier: only files over 1024 bytes are gone
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
[ "$(cd cache && find . | sort | tr '\n' ' ')" = ". ./a ./a/b ./a/exact.bin ./c ./c/tiny.bin ./small.bin " ] \
    || fail "cache holds: $(cd cache && find . | sort | tr '\n' ' ')"
echo 1 > /logs/verifier/reward.txt
echo PASS
