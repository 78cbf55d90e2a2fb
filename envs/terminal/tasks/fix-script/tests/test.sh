#!/bin/bash
# Verifier: greet.sh is executable and greets its first argument
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
[ -f greet.sh ] || fail "greet.sh missing"
[ -x greet.sh ] || fail "greet.sh is not executable"
for who in Alice Bob; do
    got=$(timeout 5 ./greet.sh "$who" 2>&1)
    [ "$got" = "Hello, $who!" ] || fail "./greet.sh $who printed '$got'"
done
echo 1 > /logs/verifier/reward.txt
echo PASS
