#!/bin/bash
# Verifier: every photos/*.jpeg renamed to *.jpg, other files untouched
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
got=$(cd photos && ls -1 | sort)
want=$(printf '%s\n' beach.jpg 'city night.jpg' dog.jpg notes.txt old.png | sort)
[ "$got" = "$want" ] || fail "photos/ holds: $got"
[ "$(cat 'photos/city night.jpg')" = city ] || fail "content of 'city night.jpg' changed"
echo 1 > /logs/verifier/reward.txt
echo PASS
