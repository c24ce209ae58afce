"""Team KB layers: a team folder adds causes and threads and extends built-in causes;
every command that reads the KB reads the layered whole."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from assistant import config
from assistant.cli import main
from assistant.knowledge.files import content_hash
from assistant.knowledge.kb import KBError, load_kb

REPO_KB = Path(__file__).resolve().parents[2] / "kb"
TEAM_SIGNATURE = r"ACME launcher: device \d+ already claimed by rank \d+"
TEAM_ERROR = "ACME launcher: device 3 already claimed by rank 0"


def write_yaml(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, allow_unicode=True, sort_keys=False), encoding="utf-8")
    return path


def team_cause(cause_id: str) -> dict:
    """A full cause of the team's own, made from a built-in one."""
    data = yaml.safe_load((REPO_KB / "causes" / "shm-too-small.yaml").read_text("utf-8"))
    return {
        **data,
        "id": cause_id,
        "title": "The ACME scheduler gives every job a 64 MB /dev/shm",
        "signatures": [r"ACME scheduler: shm quota \d+ MB exceeded"],
        "symptoms": ["ACME scheduler: shm quota 64 MB exceeded", "ACME 调度器 共享内存 配额 超了"],
    }


@pytest.fixture
def team(tmp_path) -> Path:
    """A team folder: an extension of a built-in cause, a cause and a thread of its own."""
    root = tmp_path / "team"
    write_yaml(
        root / "causes" / "duplicate-gpu-per-rank.yaml",
        {
            "extends": "duplicate-gpu-per-rank",
            "signatures": [TEAM_SIGNATURE],
            "symptoms": ["Our ACME launcher says the device is already claimed"],
        },
    )
    write_yaml(root / "causes" / "acme-shm-quota.yaml", team_cause("acme-shm-quota"))
    write_yaml(
        root / "threads" / "acme-support-1.yaml",
        {
            "id": "acme-support-1",
            "title": "Jobs die with shm quota exceeded",
            "lang": "en",
            "question": "Our 8-GPU jobs die at the first batch with shm quota exceeded.",
            "answers": [
                {
                    "id": "a1",
                    "lang": "en",
                    "text": "Ask the scheduler for --shm 8G.",
                    "claims": ["acme-shm-quota"],
                    "stance": "right",
                },
                {
                    "id": "a2",
                    "lang": "en",
                    "text": "Call set_device after init_process_group.",
                    "claims": ["set-device-order"],
                    "stance": "wrong",
                    "advice": "set-device-after-init",
                },
            ],
        },
    )
    return root


def test_a_team_layer_adds_and_extends(team):
    kb = load_kb([REPO_KB, team])
    builtin = load_kb(REPO_KB)
    assert set(kb.causes) == set(builtin.causes) | {"acme-shm-quota"}
    extended = kb.causes["duplicate-gpu-per-rank"]
    before = builtin.causes["duplicate-gpu-per-rank"]
    assert extended.signatures == [*before.signatures, TEAM_SIGNATURE]
    assert extended.symptoms[-1] == "Our ACME launcher says the device is already claimed"
    assert extended.fix == before.fix  # scalars stay the built-in's
    assert kb.sources["acme-shm-quota"] == team
    assert kb.sources["duplicate-gpu-per-rank"] == REPO_KB
    assert kb.extended_by == {"duplicate-gpu-per-rank": [team]}
    assert [t.id for t in kb.threads][-1] == "acme-support-1"


def test_a_later_team_layer_extends_an_earlier_one(team, tmp_path):
    second = tmp_path / "second"
    write_yaml(
        second / "causes" / "acme-shm-quota.yaml",
        {"extends": "acme-shm-quota", "signatures": [r"ACME scheduler: shm quota hit"]},
    )
    kb = load_kb([REPO_KB, team, second])
    assert kb.causes["acme-shm-quota"].signatures[-1] == "ACME scheduler: shm quota hit"
    with pytest.raises(KBError) as err:  # the other order: nothing to extend yet
        load_kb([REPO_KB, second, team])
    expected = (
        f"{second / 'causes' / 'acme-shm-quota.yaml'}: extends: unknown cause 'acme-shm-quota' "
        "(an extension adds to a cause of an earlier layer)"
    )
    assert err.value.problems == [expected]


def test_the_kb_path_variable_and_the_option_choose_the_layers(team, tmp_path, monkeypatch):
    other = tmp_path / "other"
    (other / "causes").mkdir(parents=True)
    monkeypatch.setenv("ASSISTANT_KB_PATH", f"{team}:{other}")
    assert config.kb_layers() == [config.kb_dir(), team, other]
    builtin = load_kb(REPO_KB)
    causes, threads = len(builtin.causes), len(builtin.threads)
    result = CliRunner().invoke(main, ["kb", "lint", "--kb", str(other)])
    assert result.exit_code == 0, result.stderr
    # --kb replaced the variable
    assert result.stdout.startswith(f"ok: {causes} causes, {threads} threads")
    assert config.team_kb_dirs() == [team, other]  # and only while the command ran
    result = CliRunner().invoke(main, ["kb", "lint"])
    expected = f"ok: {causes + 1} causes, 1 extended, {threads + 1} threads"
    assert result.stdout.startswith(expected), result.stderr


def test_a_missing_team_folder_is_one_line(tmp_path, monkeypatch):
    result = CliRunner().invoke(main, ["kb", "lint", "--kb", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "does not exist" in result.stderr
    monkeypatch.setenv("ASSISTANT_KB_PATH", str(tmp_path / "nope"))
    result = CliRunner().invoke(main, ["kb", "lint"])
    assert result.exit_code == 1
    assert result.stderr.splitlines()[0] == (
        f"{tmp_path / 'nope'}: (dir): knowledge base directory not found"
    )


def test_stats_name_the_layer_of_every_cause(team):
    result = CliRunner().invoke(main, ["kb", "stats", "--json", "--kb", str(team)])
    assert result.exit_code == 0, result.stderr
    rows = {row["id"]: row for row in json.loads(result.stdout)["causes"]}
    assert rows["acme-shm-quota"]["source"] == str(team)
    assert rows["duplicate-gpu-per-rank"]["source"] == str(config.kb_dir())
    assert rows["duplicate-gpu-per-rank"]["extended_by"] == [str(team)]
    assert rows["acme-shm-quota"]["answers"] == 1
    text = CliRunner().invoke(main, ["kb", "stats", "--kb", str(team)]).stdout.splitlines()
    assert next(line for line in text if line.startswith("acme-shm-quota")).endswith(f"from={team}")
    duplicate = next(line for line in text if line.startswith("duplicate-gpu-per-rank"))
    assert duplicate.endswith(f"extended-by={team}")


def test_a_change_in_any_layer_changes_the_content_hash(team):
    layers = [REPO_KB, team]
    first = content_hash(layers)
    assert content_hash([REPO_KB]) != first
    extension = team / "causes" / "duplicate-gpu-per-rank.yaml"
    extension.write_text(extension.read_text() + "- one more symptom\n")
    assert content_hash(layers) != first


def test_doctor_reads_the_team_layer(team):
    """doctor's catalogue (community advice a probe can settle) includes the team's."""
    from assistant.knowledge.catalog import contract_causes

    config.set_team_kb_dirs([team])
    try:
        causes = {c.id: c for c in contract_causes()}
    finally:
        config.set_team_kb_dirs(None)
    threads = {a.thread for a in causes["set-device-order"].answers}
    assert "acme-support-1" in threads
    assert "acme-support-1" not in {a.thread for a in causes_without_team()}


def causes_without_team():
    from assistant.knowledge.catalog import contract_causes

    return next(c for c in contract_causes() if c.id == "set-device-order").answers


@pytest.mark.slow
def test_ask_and_build_read_every_layer(team, private_engine):
    runner = CliRunner()
    result = runner.invoke(main, ["kb", "build"])
    learned = re.search(r"learned from (\d+) labelled reports", result.stdout)
    assert learned, result.stdout
    # The team's confirmed answers (kb feedback --export) in its reports/ folder count too.
    (team / "reports").mkdir()
    ticket = {"id": "t1", "query": "ACME: rank 3 stuck in allreduce", "causes": ["p2p-hang"]}
    (team / "reports" / "confirmed.jsonl").write_text(json.dumps(ticket) + "\n")
    result = runner.invoke(main, ["kb", "build", "--kb", str(team)])
    assert result.exit_code == 0, result.stderr
    assert "computed" in result.stdout
    assert f"learned from {int(learned.group(1)) + 1} labelled reports" in result.stdout
    result = runner.invoke(main, ["ask", "--json", "--no-probe", "--kb", str(team), TEAM_ERROR])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["causes"][0]["id"] == "duplicate-gpu-per-rank"
    quota = "RuntimeError: ACME scheduler: shm quota 64 MB exceeded"
    result = runner.invoke(main, ["ask", "--json", "--no-probe", "--kb", str(team), quota])
    assert json.loads(result.stdout)["causes"][0]["id"] == "acme-shm-quota"
    # Without the layer the index notices the change, rebuilds, and the team cause is gone.
    result = runner.invoke(main, ["ask", "--json", "--no-probe", quota])
    assert result.exit_code == 0, result.stderr
    assert "acme-shm-quota" not in {c["id"] for c in json.loads(result.stdout)["causes"]}
    assert any("rebuilding the index" in line for line in private_engine)


def test_explain_shows_what_the_team_layer_added(team):
    result = CliRunner().invoke(
        main, ["explain", "duplicate-gpu-per-rank", "--json", "--kb", str(team)]
    )
    assert result.exit_code == 0, result.stderr
    assert TEAM_SIGNATURE in result.stdout.replace("\\\\", "\\")
    result = CliRunner().invoke(main, ["explain", "acme-shm-quota", "--kb", str(team)])
    assert result.exit_code == 0, result.stderr


def test_the_chat_runs_with_the_team_layers(team, monkeypatch):
    """The chat builds its engine from config.kb_layers(): --kb is in force while it runs."""
    monkeypatch.delenv("ASSISTANT_KB_PATH", raising=False)
    seen = []
    monkeypatch.setattr(
        "assistant.tui.app.run_chat", lambda **options: seen.append(config.kb_layers())
    )
    result = CliRunner().invoke(main, ["chat", "--kb", str(team)])
    assert result.exit_code == 0, result.stderr
    assert seen == [[config.kb_dir(), team]]
    assert config.kb_layers() == [config.kb_dir()]  # and no longer after it


def test_an_extension_in_the_same_layer_as_its_cause_is_one_problem(team):
    write_yaml(
        team / "causes" / "acme-shm-quota-more.yaml",
        {"extends": "acme-shm-quota", "symptoms": ["ACME: shm quota exceeded again"]},
    )
    with pytest.raises(KBError) as err:
        load_kb([REPO_KB, team])
    expected = (
        f"{team / 'causes' / 'acme-shm-quota-more.yaml'}: extends: 'acme-shm-quota' is defined "
        f"in this same layer ({team / 'causes' / 'acme-shm-quota.yaml'}): edit that file instead"
    )
    assert err.value.problems == [expected]


def test_a_folder_named_twice_is_one_layer(team, monkeypatch):
    monkeypatch.setenv("ASSISTANT_KB_PATH", f"{team}:{config.kb_dir()}:{team}/")
    assert config.kb_layers() == [config.kb_dir(), team]
