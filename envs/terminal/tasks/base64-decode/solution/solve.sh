#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
head -2 secret.b64
base64 -d secret.b64 > secret.bin && sha256sum secret.bin | cut -d' ' -f1 > digest.txt && cat digest.txt
