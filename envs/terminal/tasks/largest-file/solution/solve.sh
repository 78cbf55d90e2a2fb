#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
ls -lS files
ls -S files | head -n 1 > largest.txt && cat largest.txt
