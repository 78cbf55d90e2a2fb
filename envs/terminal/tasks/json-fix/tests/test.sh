#!/bin/bash
# Verifier: config.json parses with the expected values
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
python3 - <<'EOF' || fail "config.json is wrong"
import json
with open("/work/config.json") as f:
    cfg = json.load(f)
assert cfg == {"name": "web", "port": 8080, "debug": False, "hosts": ["a.example.com", "b.example.com"]}, cfg
EOF
echo 1 > /logs/verifier/reward.txt
echo PASS
