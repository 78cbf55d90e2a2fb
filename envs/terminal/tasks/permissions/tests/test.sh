#!/bin/bash
# Verifier: bin/*.sh are a+x, secrets/ is 700 with 600 files
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
for f in bin/build.sh bin/deploy.sh; do
    [ "$(( 0$(stat -c %a $f) & 0111 ))" = 73 ] || fail "$f is not executable by everyone ($(stat -c %a $f))"
done
[ "$(stat -c %a secrets)" = 700 ] || fail "secrets/ has mode $(stat -c %a secrets)"
for f in secrets/*; do [ "$(stat -c %a "$f")" = 600 ] || fail "$f has mode $(stat -c %a "$f")"; done
echo 1 > /logs/verifier/reward.txt
echo PASS
