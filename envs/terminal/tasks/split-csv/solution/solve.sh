#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
head -3 people.csv
mkdir -p by_country && awk -F, 'NR == 1 { h = $0; next } { f = "by_country/" $3 ".csv"; if (!(f in seen)) { print h > f; seen[f] = 1 } print > f }' people.csv && head by_country/*
