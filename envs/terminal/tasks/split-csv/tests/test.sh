#!/bin/bash
# Verifier: by_country/<c>.csv with header and rows
# Runs in a fresh sandbox over the final /work; tests are read-only at /tests.
set -u
fail() { echo "FAIL: $*"; exit 1; }
cd /work || fail "no /work"
diff by_country/cn.csv <(printf "%s\n" "id,name,country" '3,Chen,cn' '6,Fang,cn') || fail "cn.csv differs"
diff by_country/pt.csv <(printf "%s\n" "id,name,country" '1,Ana,pt' '4,Dora,pt' '7,Gil,pt') || fail "pt.csv differs"
diff by_country/uk.csv <(printf "%s\n" "id,name,country" '2,Ben,uk' '5,Eve,uk') || fail "uk.csv differs"
[ "$(ls by_country | sort | tr '\n' ' ')" = "cn.csv pt.csv uk.csv " ] || fail "files: $(ls by_country)"
echo 1 > /logs/verifier/reward.txt
echo PASS
