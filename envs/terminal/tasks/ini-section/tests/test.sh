#!/bin/bash
# Verifier: only [database] max_connections changed to 200
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
[ "$(diff settings.ini /tests/expected.ini)" = "" ] || fail "settings.ini differs: $(diff settings.ini /tests/expected.ini)"
echo 1 > /logs/verifier/reward.txt
echo PASS
