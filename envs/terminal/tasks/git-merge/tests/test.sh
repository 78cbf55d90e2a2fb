#!/bin/bash
# Verifier: feature is merged into main and deleted
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
[ "$(git rev-parse --abbrev-ref HEAD)" = main ] || fail "not on main"
[ -z "$(git branch --list feature)" ] || fail "branch feature still exists"
git log --format=%s | grep -qx 'Add feature' || fail "the feature commit is not in main"
git log --format=%s | grep -qx 'Update base' || fail "main's own commit is gone"
[ "$(git show HEAD:feature.txt)" = feat ] || fail "feature.txt not in HEAD"
[ -z "$(git status --porcelain)" ] || fail "working tree is not clean"
echo 1 > /logs/verifier/reward.txt
echo PASS
