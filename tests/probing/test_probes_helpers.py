"""The probes' own logic, imported in-process (no torchrun needed)."""

from __future__ import annotations

import json
import os
import socket
import sys
import types

import pytest

from assistant.config import PROJECT_ROOT

# The probes import their helper from their own folder; put it on the path
# only while importing them.
sys.path.insert(0, str(PROJECT_ROOT / "probes"))
try:
    import _probekit
    import rendezvous
    import system
finally:
    sys.path.remove(str(PROJECT_ROOT / "probes"))

NICS = [
    {"name": "lo", "up": True, "loopback": True, "ipv4": "127.0.0.1", "ipv6": ["::1"]},
    {"name": "eth0", "up": True, "loopback": False, "ipv4": "10.0.0.5", "ipv6": []},
    {"name": "eth1", "up": False, "loopback": False, "ipv4": "10.0.1.5", "ipv6": []},
    {"name": "docker0", "up": True, "loopback": False, "ipv4": "172.17.0.1", "ipv6": []},
    {"name": "ib0", "up": True, "loopback": False, "ipv4": "192.168.10.5", "ipv6": []},
]


@pytest.mark.parametrize(
    "spec, expected",
    [
        (None, ["ib0"]),  # InfiniBand first
        ("eth", ["eth0"]),  # prefixes; eth1 is down
        ("=eth0", ["eth0"]),
        ("=eth", []),  # exact names only
        ("^docker,lo", ["eth0", "ib0"]),
        ("eth9", []),
    ],
)
def test_nccl_interface_selection_follows_nccl_rules(spec, expected):
    assert system.nccl_interfaces(spec, NICS) == expected


def test_nccl_default_without_infiniband_skips_lo_and_docker():
    assert system.nccl_interfaces(None, [n for n in NICS if n["name"] != "ib0"]) == ["eth0"]
    assert system.nccl_interfaces(None, NICS[:1]) == ["lo"]


def test_gloo_interfaces_are_exact_names():
    assert system.gloo_interfaces(None, NICS) is None
    assert system.gloo_interfaces("eth0,eth7", NICS) == ["eth0"]


def test_interfaces_of_this_host_include_loopback():
    nics = _probekit.interfaces()
    assert any(n["loopback"] and n["ipv4"] == "127.0.0.1" for n in nics)


def test_shm_space_reads_dev_shm():
    shm = system.shm_space()
    assert shm is None or shm["total_mib"] >= shm["free_mib"] >= 0
    assert system.shm_space("/no/such/dir") is None


def test_a_held_port_is_busy_and_its_holder_is_found():
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        free, error = rendezvous.port_free(port)
        assert free is False and "Address already in use" in error
        assert rendezvous.port_holder(port)["pid"] == os.getpid()
    assert rendezvous.port_free(port) == (True, None)


@pytest.mark.parametrize(
    "text, port", [(None, 29500), ("", 29500), ("1234", 1234), ("http", None), ("70000", None)]
)
def test_master_port_parsing(text, port):
    assert rendezvous._parse_port(text) == port


def test_resolve_reports_errors_and_loopback():
    assert rendezvous.resolve("localhost")["addresses"]
    assert rendezvous.resolve("no-such-host.invalid")["error"]
    assert _probekit.is_loopback("127.0.1.1") and not _probekit.is_loopback("10.0.0.1")


def test_user_env_prefers_the_runners_handover(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "41000")
    monkeypatch.delenv("PROBE_RUNNER", raising=False)
    assert _probekit.user_env("MASTER_PORT") == "41000"
    monkeypatch.setenv("PROBE_RUNNER", "1")
    assert _probekit.user_env("MASTER_PORT") is None
    monkeypatch.setenv("PROBE_USER_MASTER_PORT", "29500")
    assert _probekit.user_env("MASTER_PORT") == "29500"


def _module(collect):
    return types.SimpleNamespace(NAME="demo", collect=collect)


def _rank():
    return _probekit.Rank(rank=1, local_rank=1, world_size=2, local_world_size=2, host="h", pid=7)


def test_run_probe_writes_a_record_per_rank(tmp_path):
    record, _ = _probekit.run_probe(
        _module(lambda ctx: {"x": 1, "summary": "fine"}), _rank(), tmp_path
    )
    saved = json.loads((tmp_path / "demo.rank1.json").read_text())
    assert saved == record
    assert record["status"] == "ok" and record["summary"] == "fine" and record["facts"] == {"x": 1}
    assert (record["rank"], record["world_size"], record["host"]) == (1, 2, "h")


def test_run_probe_statuses(tmp_path):
    failed, _ = _probekit.run_probe(_module(lambda ctx: {"problems": ["bad"]}), _rank(), tmp_path)
    assert failed["status"] == "failed" and failed["problems"] == ["bad"]

    def not_here(ctx):
        raise _probekit.NotApplicable("no CUDA device visible", {"cuda_available": False})

    skipped, _ = _probekit.run_probe(_module(not_here), _rank(), tmp_path)
    assert skipped["status"] == "not_applicable" and skipped["facts"] == {"cuda_available": False}

    def crashes(ctx):
        ctx.checkpoint({"step": "half way"})
        raise OSError("disk gone")

    crashed, _ = _probekit.run_probe(_module(crashes), _rank(), tmp_path)
    assert crashed["status"] == "error" and crashed["reason"] == "OSError: disk gone"
    assert crashed["facts"] == {"step": "half way"}  # the facts gathered before the error survive


def test_checkpoint_leaves_a_running_record(tmp_path):
    seen = {}

    def collect(ctx):
        ctx.checkpoint({"step": "one"})
        seen.update(json.loads((tmp_path / "demo.rank1.json").read_text()))
        return {}

    _probekit.run_probe(_module(collect), _rank(), tmp_path)
    assert seen["status"] == "running" and seen["facts"] == {"step": "one"}
    assert not list(tmp_path.glob(".*.tmp"))


def test_one_line_folds_and_cuts():
    assert _probekit.one_line(ValueError("a\n  b")) == "ValueError: a b"
    assert len(_probekit.one_line("x" * 1000, limit=50)) == 50
