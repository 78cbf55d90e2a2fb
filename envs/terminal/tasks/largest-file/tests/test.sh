#!/bin/bash
# Verifier: largest.txt names the largest file of files/ (report.csv)
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
[ -f largest.txt ] || fail "largest.txt missing"
got=$(tr -d ' \t\n' < largest.txt)
[ "$got" = report.csv ] || fail "expected report.csv, got '$got'"
echo 1 > /logs/verifier/reward.txt
echo PASS
