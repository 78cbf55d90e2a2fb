#!/bin/bash
# Verifier: greet honours NAME, unset or empty
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
[ -x greet ] || fail "greet missing or not executable"
[ "$(NAME=Ann ./greet)" = "Hello, Ann!" ] || fail "NAME=Ann: $(NAME=Ann ./greet)"
[ "$(NAME= ./greet)" = "Hello, world!" ] || fail "NAME empty: $(NAME= ./greet)"
[ "$(env -u NAME ./greet)" = "Hello, world!" ] || fail "NAME unset: $(env -u NAME ./greet)"
echo 1 > /logs/verifier/reward.txt
echo PASS
