#!/bin/bash
# Verifier: only the port setting of app.conf changed to 9090
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
[ -f app.conf ] || fail "app.conf missing"
diff /tests/expected.conf app.conf || fail "app.conf is not as expected"
echo 1 > /logs/verifier/reward.txt
echo PASS
