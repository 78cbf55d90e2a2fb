#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
head -5 numbers.txt
sort -n numbers.txt > sorted.txt
