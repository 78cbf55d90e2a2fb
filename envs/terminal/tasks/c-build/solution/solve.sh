#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
sed -i 's/i < argc - 1;/i < argc;/' calc.c && grep -n 'argc' calc.c
gcc -O2 -o calc calc.c && ./calc 2 3 4
