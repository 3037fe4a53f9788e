"""The agent loop example in docs/examples runs as documented: the official client against `radixkv serve`,
a real local tool called, its result sent back, the conversation's prefix read from the cache."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.server_fixture import running_server

ROOT = Path(__file__).resolve().parents[1]


def test_the_agent_loop_example_calls_its_tool_and_reads_its_prefix_from_the_cache():
    with running_server("smollm2-135m", "--kv-cache-tokens", "8192") as (base, _):
        run = subprocess.run([sys.executable, str(ROOT / "docs/examples/agent_loop.py"), "--base-url", f"{base}/v1",
                              "--rounds", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("round 0:") and "finish_reason=tool_calls" in lines[0], run.stdout
    assert lines[1].lstrip().startswith("read_file(") and "characters" in lines[1], run.stdout
    second = next(line for line in lines if line.startswith("round 1:"))
    cached = int(second.split(", ")[1].split()[0])
    assert cached > 0, run.stdout  # the first round's prompt and call, read from the prefix cache
