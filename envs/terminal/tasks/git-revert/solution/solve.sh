#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
git log --oneline
git revert --no-edit "$(git log --format=%H --grep='^Break config$')" && git log --oneline
