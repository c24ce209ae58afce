"""An installed wheel (pip install ., pipx) carries its KB, probes and contract.

Builds the real wheel, installs it into a fresh virtual environment (its
dependencies borrowed from this one through a .pth file, so nothing is
downloaded) and runs the installed `assistant` from a folder that is not the
checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from assistant.config import PROJECT_ROOT

pytestmark = pytest.mark.slow


def run(cmd: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, f"{cmd}: {done.stderr[-2000:]}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The bin/ folder of a fresh venv with the wheel installed."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"  # a copy: building writes build/ beside pyproject.toml
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "build", "*.egg-info")
    for name in ("assistant", "kb", "probes"):
        shutil.copytree(PROJECT_ROOT / name, source / name, ignore=skip)
    eval_sets = [
        p.relative_to(PROJECT_ROOT).as_posix() for p in PROJECT_ROOT.glob("data/eval/*.jsonl")
    ]
    shipped = ("data/eval/vectors.npz",)
    for name in ("pyproject.toml", "README.md", "data/causes.yaml", *eval_sets, *shipped):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(PROJECT_ROOT / name, source / name)
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(source),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(root / "dist"),
        ],
        cwd=root,
    )
    venv.EnvBuilder(with_pip=False).create(root / "env")
    python = root / "env" / "bin" / "python"
    purelib = run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=root
    ).stdout.strip()
    Path(purelib, "borrowed_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    wheel = next((root / "dist").glob("ddp_assistant-*.whl"))
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "-q",
            str(wheel),
        ],
        cwd=root,
    )
    return root / "env" / "bin"


WHERE = (
    "from assistant import config; print(config.kb_dir()); print(config.probes_dir()); "
    "print(config.build_dir()); print(len(config.contract_ids()))"
)


def clean_env(tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASSISTANT_")}
    return {**env, "XDG_CACHE_HOME": str(tmp / "cache")}


def test_installed_wheel_finds_its_kb_and_probes(installed, tmp_path):
    env = clean_env(tmp_path)
    lint = run([str(installed / "assistant"), "kb", "lint"], cwd=tmp_path, env=env)
    causes = len(list((PROJECT_ROOT / "kb" / "causes").glob("*.yaml")))  # the KB grows
    assert lint.stdout.startswith(f"ok: {causes} causes")
    stats = json.loads(
        run([str(installed / "assistant"), "kb", "stats", "--json"], cwd=tmp_path, env=env).stdout
    )
    assert len(stats["causes"]) == causes
    where = run(
        [
            str(installed / "python"),
            "-c",
            WHERE,
        ],
        cwd=tmp_path,
        env=env,
    ).stdout.split()
    share = installed.parent / "share" / "ddp-assistant"
    assert where[:2] == [str(share / "kb"), str(share / "probes")]
    assert (share / "probes" / "run_probes.py").is_file()
    # Built artifacts go to the user's cache, never into the installation.
    assert where[2] == str(tmp_path / "cache" / "ddp-assistant") and where[3] == "27"


def test_installed_wheel_ships_the_eval_set(installed, tmp_path):
    """`assistant kb eval` with no file works from the wheel: the labelled set is shipped."""
    where = run(
        [str(installed / "python"), "-c", "from assistant import config; print(config.eval_dir())"],
        cwd=tmp_path,
        env=clean_env(tmp_path),
    ).stdout.strip()
    share = installed.parent / "share" / "ddp-assistant"
    assert where == str(share / "data" / "eval")
    shipped = sorted(p.name for p in Path(where).glob("*.jsonl"))
    assert "queries.jsonl" in shipped
    assert shipped == sorted(p.name for p in (PROJECT_ROOT / "data" / "eval").glob("*.jsonl"))
    # and the vectors a first build reads instead of embedding (shipped.py)
    assert (Path(where) / "vectors.npz").stat().st_size > 1_000_000
