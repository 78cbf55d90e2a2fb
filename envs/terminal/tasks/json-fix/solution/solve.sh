#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
python3 -m json.tool config.json
python3 - <<'EOF'
import json, re
text = open("config.json").read()
cfg = json.loads(re.sub(r",\s*([\]}])", r"\1", text))
cfg["port"] = 8080
with open("config.json", "w") as f:
    json.dump(cfg, f, indent=2)
EOF
python3 -m json.tool config.json
