#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
ls -l
ln -sfn releases/v2 current && readlink current
