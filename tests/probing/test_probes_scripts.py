"""The probe scripts as files: standalone, documented, runnable by hand.

A probe runs in the user's training environment, which may not have this
package: it may import only the standard library, torch and its sibling
helpers probes/_probekit.py and probes/probe_protocol.py.
"""

from __future__ import annotations

import ast
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from assistant.config import PROJECT_ROOT
from assistant.probing.registry import PROBES

PROBES_DIR = PROJECT_ROOT / "probes"
SCRIPTS = sorted(PROBES_DIR.glob("*.py"))
ALLOWED = set(sys.stdlib_module_names) | {"torch", "_probekit", "probe_protocol", "__future__"}
# A probe may reuse a sibling probe (nodes.py reads versions.py, system.py): each is held
# to this same rule here, and probes/ travels to a node as one folder.
ALLOWED |= {path.stem for path in SCRIPTS}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_every_registered_probe_has_a_script():
    for spec in PROBES.values():
        assert (PROBES_DIR / f"{spec.name}.py").is_file(), spec.name


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_scripts_import_only_the_standard_library_and_torch(path):
    assert imported_modules(path) <= ALLOWED


@pytest.mark.parametrize("name", list(PROBES))
def test_probe_docstring_gives_the_command_and_what_to_do_on_a_hang(name):
    tree = ast.parse((PROBES_DIR / f"{name}.py").read_text(encoding="utf-8"))
    doc = ast.get_docstring(tree)
    assert doc and doc.splitlines()[0] == PROBES[name].question
    assert f"probes/{name}.py" in doc and (
        "torchrun --nproc_per_node=" in doc or "python probes/" in doc
    )
    assert "If it hangs" in doc


@pytest.mark.parametrize("name", list(PROBES))
def test_probe_defines_name_and_collect(name):
    tree = ast.parse((PROBES_DIR / f"{name}.py").read_text(encoding="utf-8"))
    assigned = {
        t.id: n.value.value
        for n in tree.body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)
    }
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert assigned.get("NAME") == name
    assert "collect" in functions


def test_plain_python_start_reports_the_missing_launch_variables(tmp_path):
    """`python probes/launch_env.py`: what a script started without torchrun sees."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "PROBE_RUNNER")
    }
    done = subprocess.run(
        [sys.executable, str(PROBES_DIR / "launch_env.py"), "--out", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert "launch_env: failed: not started by torchrun: RANK, LOCAL_RANK" in done.stdout
    record = json.loads((tmp_path / "launch_env.rank0.json").read_text())
    assert record["status"] == "failed" and record["facts"]["missing"][0] == "RANK"
    assert record["facts"]["user_env"] is None  # by hand the launch is the user's own


@pytest.mark.slow
def test_a_probe_runs_on_its_own_under_torchrun(tmp_path, torchrun):
    """`torchrun --nproc_per_node=2 probes/devices.py`: one record and one line per rank."""
    done = torchrun(PROBES_DIR / "devices.py", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads((tmp_path / f"devices.rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["world_size"]) for r in records] == [(0, 2), (1, 2)]
    host = socket.gethostname()
    for record in records:
        assert f"[{host}:{record['rank']}] devices: {record['status']}" in done.stdout


@pytest.mark.slow
def test_the_system_probe_finds_a_worker_of_an_earlier_run(tmp_path, torchrun):
    """A process with a launcher's LOCAL_RANK left behind is reported; this launch's ranks are not."""
    stale = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"],
        env={**os.environ, "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "an-earlier-run"},
        start_new_session=True,
    )
    try:
        done = torchrun(PROBES_DIR / "system.py", "--out", str(tmp_path))
        assert done.returncode == 0, done.stderr[-2000:]
        for rank in (0, 1):
            facts = json.loads((tmp_path / f"system.rank{rank}.json").read_text())["facts"]
            pids = {worker["pid"]: worker for worker in facts["stale_workers"]}
            assert stale.pid in pids
            assert pids[stale.pid]["local_rank"] == "1"
            assert "time.sleep(120)" in pids[stale.pid]["cmdline"]
            # The other rank of this launch is a sibling, not a stale worker.
            assert all("system.py" not in w["cmdline"] for w in facts["stale_workers"])
    finally:
        stale.kill()
        stale.wait()
