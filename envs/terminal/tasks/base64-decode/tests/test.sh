#!/bin/bash
# Verifier: secret.bin decoded, digest.txt its sha256
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
[ "$(sha256sum < secret.bin | cut -d' ' -f1)" = 864416d0eaeb5669a08ce2fd107edd8d4351baa9267eae7e4c04b6dc19587c4c ] || fail "secret.bin is wrong"
[ "$(tr -d ' \n' < digest.txt)" = 864416d0eaeb5669a08ce2fd107edd8d4351baa9267eae7e4c04b6dc19587c4c ] || fail "digest.txt is wrong"
echo 1 > /logs/verifier/reward.txt
echo PASS
