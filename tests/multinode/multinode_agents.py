"""Running `assistant doctor` agents as separate processes, as on separate nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
AGENT_LIMIT = 240  # seconds one agent may take before the test fails (never hangs)


@dataclass
class Agent:
    """One doctor agent: its process, and what it printed once it ended."""

    node_rank: int
    process: subprocess.Popen
    started: float
    code: int | None = None
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0

    def finish(self) -> Agent:
        try:
            self.stdout, self.stderr = self.process.communicate(timeout=AGENT_LIMIT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.stdout, self.stderr = self.process.communicate()
            raise AssertionError(f"node {self.node_rank}'s doctor hung: {self.stderr[-2000:]}")
        self.code = self.process.returncode
        self.seconds = time.monotonic() - self.started
        return self

    @property
    def result(self) -> dict:
        try:
            return json.loads(self.stdout)
        except ValueError:
            raise AssertionError(f"node {self.node_rank}: no JSON: {self.stderr[-2000:]}") from None

    def nodes(self) -> dict[int, dict]:
        return {entry["node_rank"]: entry for entry in self.result["nodes"]}

    def cause(self, cause_id: str) -> dict:
        return next(c for c in self.result["causes"] if c["id"] == cause_id)


def start_agent(
    rank: int,
    args: list[str],
    env: dict[str, str] | None = None,
    netns: str | None = None,
    node_rank: bool = True,
    prefix: list[str] | None = None,
) -> Agent:
    """`assistant doctor --json --nodes-only ARGS --node-rank R`, in a network namespace if given,
    after `prefix` (a command that ends by running the rest, as `unshare ... sh -c '...; exec "$@"'`).

    node_rank=False leaves --node-rank out (--slurm reads it from SLURM_NODEID).
    """
    command = [sys.executable, "-m", "assistant", "doctor", "--json", "--nodes-only", *args]
    command += ["--node-rank", str(rank)] if node_rank else []
    if netns:
        command = ["ip", "netns", "exec", netns, *command]
    command = [*(prefix or []), *command]  # e.g. a mount namespace of its own
    full_env = {**os.environ, **(env or {})}
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return Agent(rank, process, time.monotonic())


def confirmed(agent: Agent) -> list[str]:
    """Cause ids confirmed in the agent's answer, or in any node's own verdicts."""
    ids = {c["id"] for c in agent.result["causes"] if c["verdict"] == "confirmed"}
    for node in agent.result["nodes"]:
        ids |= {v["id"] for v in node["verdicts"] if v["verdict"] == "confirmed"}
    return sorted(ids)
