"""The OpenAPI schema is the truth (#33): schemathesis, with every check and every phase, against a live server on a
tiny model finds nothing. Deterministic (a fixed seed, no example database), bounded to a few hundred cases.

The server's limits are set so that JSON Schema can state all of them: a text of at most 300 characters is at most
1200 tokens (a byte-level tokenizer: at most one token per UTF-8 byte), within the token limit, and the largest body
the schema admits is far below the body limit. (With a token limit JSON Schema cannot state, a schema-valid text may
be refused 413: docs/server.md says how the hand run against the real model treats that.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from test_server import live_server, make_engine
from tiny import tiny_model

from slimroute.server import ApiKeys, BatchSettings, ServerSettings, create_app, read_timeout_protocol

KEY = "sk-schema-0123456789"
SEED = 20261203
MAX_EXAMPLES = 40  # per operation and phase


def test_schemathesis_finds_nothing(tmp_path: Path):
    tiny = tiny_model("qwen2")
    engines = {"tickets": make_engine(tiny, name="tickets"), "urgency": make_engine(tiny, "low,high", "urgency")}
    settings = ServerSettings(batch=BatchSettings(max_text_tokens=1200, max_wait_ms=0), max_texts=8,
                              max_text_chars=300, api_keys=ApiKeys([KEY]), read_timeout_s=10)
    report = tmp_path / "report.json"
    with live_server(create_app(engines, settings), http=read_timeout_protocol(10)) as url:
        command = [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json", "--checks", "all",
                   "--phases", "examples,coverage,fuzzing,stateful", "--seed", str(SEED),
                   "--max-examples", str(MAX_EXAMPLES), "--generation-database", "none", "--workers", "1",
                   "--header", f"Authorization: Bearer {KEY}", "--no-color", "--report", "json",
                   "--report-json-path", str(report), "--request-timeout", "20"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    run = json.loads(report.read_text())
    cases, phases = run["test_cases"], run["phases"]
    assert run["complete"] and not run["failures"] and not run["errors"], output[-6000:]
    assert cases["with_failures"] == cases["errored"] == 0
    assert 150 <= cases["generated"] <= 1000, cases  # bounded: a few hundred cases
    assert run["operations"]["tested"] == run["operations"]["total"] == 6
    assert {name for name, phase in phases.items() if phase["status"] not in ("skipped",)} >= {
        "examples", "coverage", "fuzzing"}, phases
