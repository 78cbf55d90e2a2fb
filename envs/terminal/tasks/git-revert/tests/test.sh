#!/bin/bash
# Verifier: Break config is reverted by a new commit
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
[ "$(git rev-list --count HEAD)" = 4 ] || fail "expected 4 commits, found $(git rev-list --count HEAD)"
[ "$(git log --format=%s HEAD~1 -1)" = 'Add readme' ] || fail "history was rewritten"
[ "$(git show HEAD:config.ini)" = "$(printf 'retries = 3\ntimeout = 30')" ] || fail "config.ini not restored"
[ -f README.md ] || fail "README.md is gone"
[ -z "$(git status --porcelain)" ] || fail "working tree is not clean"
echo 1 > /logs/verifier/reward.txt
echo PASS
