#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
ls photos
cd photos && for f in *.jpeg; do mv -- "$f" "${f%.jpeg}.jpg"; done && ls
