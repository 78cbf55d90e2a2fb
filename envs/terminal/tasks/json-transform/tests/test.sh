#!/bin/bash
# Verifier: active.json is the sorted array of active users' names
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
[ -f active.json ] || fail "active.json missing"
python3 - <<'EOF' || fail "active.json is wrong"
import json, sys
try:
    got = json.load(open("/work/active.json"))
except ValueError:
    sys.exit(1)
sys.exit(0 if got == ["alice", "carol", "mallory", "peggy", "trent"] else 1)
EOF
echo 1 > /logs/verifier/reward.txt
echo PASS
