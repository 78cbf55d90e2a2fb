#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
cat app.conf
sed -i 's/^port = 8080$/port = 9090/' app.conf
