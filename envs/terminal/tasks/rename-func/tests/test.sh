#!/bin/bash
# Verifier: get_data is renamed, get_data_size is not
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
grep -rqw get_data src && fail "get_data is still used"
grep -q 'def fetch_data' src/data.py || fail "no fetch_data definition"
grep -q 'def get_data_size' src/data.py || fail "get_data_size was renamed"
[ "$(cd src && python3 main.py)" = "[1, 2, 3] 3" ] || fail "main.py output: $(cd src && python3 main.py 2>&1)"
echo 1 > /logs/verifier/reward.txt
echo PASS
