#!/bin/bash
cd /app
jq -r .name config.json > name.txt
mkdir -p out && cp config.json out/
