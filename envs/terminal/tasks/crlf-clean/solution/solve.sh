#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
od -c notes.txt | head
sed -i 's/\r$//; s/[[:space:]]*$//' notes.txt && cat -A notes.txt
