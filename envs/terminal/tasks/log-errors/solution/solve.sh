#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
head -3 app.log
awk '$3 == "ERROR" { print $4 }' app.log | sort | uniq -c | sort -k1,1nr -k2,2 | awk '{ print $2, $1 }' > codes.txt && cat codes.txt
