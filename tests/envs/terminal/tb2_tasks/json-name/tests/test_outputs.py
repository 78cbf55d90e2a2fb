import json
from pathlib import Path


def test_name():
    assert Path("/app/name.txt").read_text() == "ledger-api\n"


def test_copy():
    assert json.loads(Path("/app/out/config.json").read_text())["port"] == 8080
