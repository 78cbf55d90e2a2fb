#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
mkdir -p project/src project/tests project/docs && touch project/README.md project/src/__init__.py
find project | sort
