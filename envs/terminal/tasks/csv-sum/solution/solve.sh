#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
head -3 sales.csv
awk -F, 'NR > 1 { s += $3 } END { printf "%.2f\n", s }' sales.csv > total.txt && cat total.txt
