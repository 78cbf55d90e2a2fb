#!/bin/bash
# Terminal-Bench 2 style: pytest (installed in the image) over the final /app, then the reward file.
cd /app
python3 -m pytest -q /tests/test_outputs.py -rA
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
