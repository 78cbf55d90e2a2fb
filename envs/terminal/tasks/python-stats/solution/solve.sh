#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
cat > stats.py <<'EOF'
import sys

with open(sys.argv[1]) as f:
    xs = [int(line) for line in f if line.strip()]
print(f"{min(xs)} {max(xs)} {sum(xs) / len(xs):.2f}")
EOF
python3 stats.py numbers.txt
