#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
jq '[.[] | select(.active) | .name] | sort' users.json > active.json && cat active.json
