#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
find cache -type f -printf '%s %p\n'
find cache -type f -size +1024c -delete && find cache | sort
