#!/bin/bash
# Verifier: hello.txt holds exactly 'Hello, jointrl!' and a newline
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
[ -f hello.txt ] || fail "hello.txt missing"
printf 'Hello, jointrl!\n' | cmp -s - hello.txt || fail "wrong content: $(head -c 100 hello.txt | od -c | head -3)"
echo 1 > /logs/verifier/reward.txt
echo PASS
