#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
tr -s ' ' '\n' < text.txt | grep -v '^$' | sort | uniq -c | sort -rn | head -3 | awk '{print $1, $2}' > top3.txt && cat top3.txt
