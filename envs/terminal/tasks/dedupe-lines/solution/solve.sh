#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
awk '!seen[$0]++' emails.txt > unique.txt && cat unique.txt
