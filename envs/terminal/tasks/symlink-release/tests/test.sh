#!/bin/bash
# Verifier: current -> releases/v2
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
[ -L current ] || fail "current is not a symlink"
[ "$(readlink current)" = releases/v2 ] || fail "current -> $(readlink current)"
[ "$(ls -A releases/v1)" = VERSION ] || fail "releases/v1 was modified: $(ls -A releases/v1)"
[ "$(ls -A releases/v2)" = VERSION ] || fail "releases/v2 was modified: $(ls -A releases/v2)"
echo 1 > /logs/verifier/reward.txt
echo PASS
