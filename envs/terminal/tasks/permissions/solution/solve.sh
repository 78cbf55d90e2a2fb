#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
ls -l bin secrets
chmod a+x bin/*.sh && chmod 700 secrets && chmod 600 secrets/* && ls -l bin secrets
