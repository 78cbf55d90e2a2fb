#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
tar -czf backup.tar.gz data && tar -tzf backup.tar.gz
