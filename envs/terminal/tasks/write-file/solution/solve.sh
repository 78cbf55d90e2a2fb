#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
printf 'Hello, jointrl!\n' > /work/hello.txt
cat -A hello.txt
