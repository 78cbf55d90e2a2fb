#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
wc -l < access.log > count.txt
cat count.txt
