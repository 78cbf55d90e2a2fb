#!/bin/bash
# Verifier: /work is a git repo on main with one clean commit of notes.md
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
[ -d .git ] || fail "not a git repository"
[ "$(git rev-parse --abbrev-ref HEAD)" = main ] || fail "branch is not main"
[ "$(git rev-list --count HEAD)" = 1 ] || fail "expected exactly one commit"
[ "$(git log -1 --format='%an <%ae>|%s')" = "Agent Smith <agent@example.com>|Add notes" ] \
    || fail "commit is: $(git log -1 --format='%an <%ae>|%s')"
git show HEAD:notes.md | cmp -s - /tests/notes.md || fail "committed notes.md differs"
[ -z "$(git status --porcelain)" ] || fail "working tree is not clean"
echo 1 > /logs/verifier/reward.txt
echo PASS
