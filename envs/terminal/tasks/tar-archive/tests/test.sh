#!/bin/bash
# Verifier: backup.tar.gz holds data/ with its three files intact
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
[ -f backup.tar.gz ] || fail "backup.tar.gz missing"
gzip -t backup.tar.gz 2>/dev/null || fail "not gzip-compressed"
mkdir -p /tmp/x && tar -xzf backup.tar.gz -C /tmp/x 2>/dev/null || fail "cannot extract"
[ "$(cat /tmp/x/data/alpha.txt 2>/dev/null)" = alpha ] || fail "data/alpha.txt missing or wrong"
[ "$(cat /tmp/x/data/beta.txt 2>/dev/null)" = beta ] || fail "data/beta.txt missing or wrong"
[ "$(cat /tmp/x/data/gamma.csv 2>/dev/null)" = "$(printf 'g,1\ng,2')" ] || fail "data/gamma.csv missing or wrong"
echo 1 > /logs/verifier/reward.txt
echo PASS
