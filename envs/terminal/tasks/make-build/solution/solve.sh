#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
cat -A Makefile | head -5
sed -i 's/^    /\t/' Makefile && make && ./hello
