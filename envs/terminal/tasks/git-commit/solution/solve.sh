#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
git init -b main && git add notes.md
git -c user.name='Agent Smith' -c user.email=agent@example.com commit -m 'Add notes' && git log --oneline
