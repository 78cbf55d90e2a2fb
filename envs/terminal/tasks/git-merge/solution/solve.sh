#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
git log --oneline --all --graph
git merge --no-edit feature && git branch -d feature && git log --oneline
