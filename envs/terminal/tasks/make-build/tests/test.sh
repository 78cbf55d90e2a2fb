#!/bin/bash
# Verifier: the Makefile builds hello from a clean tree
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
cp -r /work /tmp/build && cd /tmp/build || fail "cannot copy /work"
make clean >/dev/null 2>&1
make >/tmp/make.log 2>&1 || fail "make failed: $(tail -3 /tmp/make.log)"
[ "$(./hello)" = "Hello, world!" ] || fail "hello printed '$(./hello)'"
cmp -s main.c /tests/main.c || fail "main.c was changed"
echo 1 > /logs/verifier/reward.txt
echo PASS
