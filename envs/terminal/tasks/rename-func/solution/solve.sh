#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
grep -rn get_data src
sed -i -E 's/\bget_data\b/fetch_data/g' src/*.py && cd src && python3 main.py
