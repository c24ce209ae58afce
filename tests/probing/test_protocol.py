"""One protocol between the runner and the probes: probes/probe_protocol.py.

These tests fail when the two sides disagree: the assistant must load the
very file the probes import, the registry and run_probes.py must follow its
probe list, nothing else may spell its variable names, and the typed facts
must read every recorded fixture without losing a key.
"""

from __future__ import annotations

import ast
import importlib
import json
import sys
from pathlib import Path

import pytest

from assistant.config import PROJECT_ROOT
from assistant.probing import protocol
from assistant.probing.recorded import load_runs
from assistant.probing.registry import PROBES

PROBES_DIR = PROJECT_ROOT / "probes"
FACTS = PROJECT_ROOT / "tests" / "fixtures" / "facts"
FIXTURES = sorted(FACTS.glob("*.json"))


@pytest.fixture
def probe_modules():
    """Import probe scripts the way torchrun does: their own folder on sys.path."""
    sys.path.insert(0, str(PROBES_DIR))
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(str(PROBES_DIR))


def test_the_assistant_loads_the_file_the_probes_import(probe_modules):
    canonical = probe_modules("probe_protocol")
    assert Path(canonical.__file__).resolve() == (PROBES_DIR / "probe_protocol.py").resolve()
    assert protocol.DevicesFacts is canonical.DevicesFacts  # one module object, not a copy
    assert protocol.FACTS_DIR_ENV is canonical.FACTS_DIR_ENV
    kit = probe_modules("_probekit")
    assert kit.FACTS_DIR_ENV == protocol.FACTS_DIR_ENV and kit.FORMAT == protocol.FORMAT


def test_registry_and_batch_script_follow_the_protocols_probe_list(probe_modules):
    assert tuple(PROBES) == protocol.PROBE_ORDER
    assert probe_modules("run_probes").ORDER == protocol.PROBE_ORDER
    assert probe_modules("set_device_order").VARIANTS == protocol.SET_DEVICE_VARIANTS
    assert PROBES["set_device_order"].variants == protocol.SET_DEVICE_VARIANTS
    for name in protocol.PROBE_ORDER:
        assert probe_modules(name).NAME == name
    # The probe implements every variant the protocol names.
    setup = probe_modules("set_device_order")._setup
    assert all(setup(variant, 0) for variant in protocol.SET_DEVICE_VARIANTS)


def test_the_protocol_imports_only_the_standard_library():
    tree = ast.parse((PROBES_DIR / "probe_protocol.py").read_text(encoding="utf-8"))
    imported = {
        (node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}


def _string_constants(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


PROTOCOL_NAMES = {
    protocol.FACTS_DIR_ENV,
    protocol.VARIANT_ENV,
    protocol.RUNNER_ENV,
    protocol.NPROC_SOURCE_ENV,
    protocol.USER_PREFIX,
    protocol.BATCH_SCRIPT,
}


@pytest.mark.parametrize(
    "path",
    sorted((PROJECT_ROOT / "assistant").rglob("*.py")) + sorted(PROBES_DIR.glob("*.py")),
    ids=lambda p: p.relative_to(PROJECT_ROOT).as_posix(),
)
def test_protocol_names_are_spelled_only_in_the_protocol(path):
    if path.name == "probe_protocol.py":
        return
    assert not (_string_constants(path) & PROTOCOL_NAMES)


def test_a_probe_writes_exactly_the_protocols_record(probe_modules, tmp_path):
    kit = probe_modules("_probekit")
    module = type(sys)("fake_probe")
    module.NAME = "devices"
    module.collect = lambda ctx: {"cuda_available": False, "physical_gpus": 0, "new_key": 1}
    rank = kit.Rank(rank=0, local_rank=0, world_size=1, local_world_size=1, host="h", pid=1)
    kit.run_probe(module, rank, tmp_path)
    written = json.loads((tmp_path / protocol.record_filename("devices", 0)).read_text())
    assert tuple(written) == protocol.RECORD_KEYS
    record = protocol.RankRecord.from_dict(written)
    assert isinstance(record.facts, protocol.DevicesFacts)
    assert record.facts.physical_gpus == 0 and record.facts.extra == {"new_key": 1}


def test_typed_facts_tolerate_missing_and_odd_input():
    facts = protocol.DevicesFacts.from_dict({})
    assert facts.cuda_available is False and facts.visible == [] and facts.local_rank_device is None
    assert protocol.BackendFacts.from_dict(None).gloo is None
    older = protocol.RankRecord.from_dict({"probe": "backend", "facts": {"gloo": {"result": "ok"}}})
    assert older.status == "error" and older.facts.gloo.result == "ok" and older.rank is None
    unknown = protocol.RankRecord.from_dict({"probe": "from_the_future", "status": "ok"})
    assert type(unknown.facts) is protocol.Facts


def _covers(original, plain) -> bool:
    """Every key and value of original is in plain (which may add defaults)."""
    if isinstance(original, dict):
        return isinstance(plain, dict) and all(
            k in plain and _covers(v, plain[k]) for k, v in original.items()
        )
    if isinstance(original, list) and isinstance(plain, list):
        return len(original) == len(plain) and all(map(_covers, original, plain))
    return original == plain


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_typed_facts_read_every_recorded_fixture_without_loss(path):
    for run in load_runs(path):
        for raw in run.ranks:
            record = protocol.RankRecord.from_dict(raw)
            assert isinstance(record.facts, protocol.FACTS_TYPES[run.name])
            assert record.facts.extra == {}, (run.name, record.facts.extra)  # every key typed
            facts = dict(raw["facts"])
            if isinstance(facts.get("variants"), list):  # the preflight's list of names
                facts.pop("variants")
            assert _covers(facts, record.facts.to_dict()), run.name
            assert type(record.facts).from_dict(record.facts.to_dict()) == record.facts


@pytest.mark.parametrize(
    "physical, visible, expected",
    [
        (None, None, 0),  # a driver that cannot be asked: no GPU to count on
        (0, "0,1", 0),
        (8, None, 8),
        (8, "", 0),
        (8, "0,9,1", 1),  # CUDA stops at the first invalid entry
        (8, "MIG-3f2a,GPU-aa", 2),
    ],
)
def test_one_gpu_count_rule(physical, visible, expected):
    assert protocol.visible_gpu_count(physical, visible) == expected


def test_no_driver_means_zero_gpus_not_unknown(monkeypatch, tmp_path):
    if Path("/proc/driver/nvidia/gpus").is_dir():
        pytest.skip("this machine has an NVIDIA driver")
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi on it
    assert protocol.physical_gpu_count() == 0


def _variant_run(status, step, uuid=None, failed_step=None, error=None):
    facts = {"step": step, "failed_step": failed_step, "error": error, "current_uuid": uuid}
    return {"status": status, "reason": "", "facts": facts}


def _ranks(**variants) -> list[dict]:
    """Two ranks on one host; variants maps a name to each rank's variant run."""
    return [
        {
            "host": "h",
            "rank": rank,
            "facts": {"variants": {v: runs[rank] for v, runs in variants.items()}},
        }
        for rank in range(2)
    ]


def test_variant_outcomes_read_failures_hangs_and_shared_gpus():
    outcomes = protocol.variant_outcomes(
        _ranks(
            **{
                "before-init": [
                    _variant_run("ok", "done", "GPU-a"),
                    _variant_run("ok", "done", "GPU-b"),
                ],
                # A rank's own failure explains the rank that hung waiting for it.
                "after-init": [
                    _variant_run("timeout", "barrier"),
                    _variant_run("failed", "init", failed_step="init", error="NCCL error"),
                ],
                "no-set-device": [
                    _variant_run("timeout", "barrier"),
                    _variant_run("timeout", None),
                ],
                "device-id": [
                    _variant_run("ok", "done", "GPU-a"),
                    _variant_run("ok", "done", "GPU-a"),
                ],
            }
        )
    )
    assert outcomes["before-init"].works and outcomes["before-init"].describe() == "ok"
    failed = outcomes["after-init"]
    assert (
        not failed.works and failed.describe() == "failed at init" and failed.error == "NCCL error"
    )
    assert outcomes["no-set-device"].describe() == "hang at barrier"
    shared = outcomes["device-id"]
    assert shared.kind == "ok" and not shared.works and shared.shared_uuid == "GPU-a"


def test_a_probe_run_gives_its_facts_typed_and_keeps_the_dicts():
    runs = {run.name: run for run in load_runs(FACTS / "two_ranks_one_gpu.json")}
    devices = runs["devices"]
    typed = devices.typed_facts()
    assert [type(f) for f in typed] == [protocol.DevicesFacts] * len(devices.ranks)
    for facts, raw in zip(typed, devices.ranks):
        landed = raw["facts"]["local_rank_device"]
        assert facts.local_rank_device.uuid == landed["uuid"]
    records = runs["backend"].typed_records()
    assert records[0].probe == "backend" and records[0].facts.gloo.result == "ok"
    assert isinstance(devices.ranks[0], dict)  # the dict records verdicts read today
