#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
cat settings.ini
sed -i '/^\[database\]/,/^\[/ s/^max_connections = .*/max_connections = 200/' settings.ini && cat settings.ini
