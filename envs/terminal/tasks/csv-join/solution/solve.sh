#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
head -3 customers.csv orders.csv
python3 - <<'EOF'
import csv
names = {r["id"]: r["name"] for r in csv.DictReader(open("customers.csv"))}
total = {n: 0.0 for n in names.values()}
for r in csv.DictReader(open("orders.csv")):
    total[names[r["customer_id"]]] += float(r["amount"])
with open("totals.csv", "w") as f:
    f.write("name,total\n")
    for n in sorted(total):
        f.write(f"{n},{total[n]:.2f}\n")
EOF
cat totals.csv
