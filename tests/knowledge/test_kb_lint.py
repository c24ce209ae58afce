"""`assistant kb lint`: the real KB passes; each broken file is named with its field."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from assistant.cli import main
from assistant.knowledge.kb import load_kb

BAD = Path(__file__).parents[1] / "data" / "kb_bad"

# broken file -> the "field: message" its lint line must contain
EXPECTED = {
    "causes/unknown-key.yaml": "colour: unknown key",
    "causes/invalid-regex.yaml": "signatures: invalid regex",
    "causes/unknown-probe.yaml": "probes: unknown probe crystal_ball",
    "causes/empty-field.yaml": "fix: must not be empty",
    "causes/no-chinese-symptom.yaml": "symptoms: needs at least one symptom in Chinese",
    "causes/duplicate-id.yaml": "id: duplicate id 'duplicate-gpu-per-rank'",
    "causes/not-yaml.yaml": "(file): not valid YAML",
    "threads/unknown-cause.yaml": "answers.0.claims: unknown cause 'cosmic-rays'",
    "threads/duplicate-answer-id.yaml": "answers.1.id: duplicate answer id 'a1'",
}


def test_every_bad_file_has_an_expectation():
    found = {p.relative_to(BAD).as_posix() for p in BAD.rglob("*.yaml")}
    assert found == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_lint_names_file_and_field(name, mini_kb):
    shutil.copy(BAD / name, mini_kb / name)
    result = CliRunner().invoke(main, ["kb", "lint", "--kb", str(mini_kb)])
    assert result.exit_code == 1
    lines = [line for line in result.stderr.splitlines() if line.startswith(name)]
    assert any(EXPECTED[name] in line for line in lines), result.stderr


def test_real_kb_passes_lint():
    result = CliRunner().invoke(main, ["kb", "lint"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("ok: ")


def test_real_kb_covers_every_contract_cause_in_both_languages():
    from assistant.config import contract_ids, kb_dir

    kb = load_kb(kb_dir())
    assert set(contract_ids()) <= set(kb.causes)
    for cid in contract_ids():
        cause = kb.causes[cid]
        assert cause.title_zh and cause.summary_zh
        assert cause.signatures, f"{cid} has no error signature"


def test_contract_copy_matches_shared():
    shared = Path(__file__).resolve().parents[3] / "shared" / "causes.yaml"
    if not shared.exists():
        pytest.skip("shared/causes.yaml is not beside this checkout")
    from assistant.config import contract_path

    assert contract_path().read_text() == shared.read_text()


def test_every_kb_symptom_retrieves_its_own_cause(engine):
    """ruff's one-fixture-per-rule, applied to search: each symptom finds its cause."""
    from assistant.config import kb_dir

    kb = load_kb(kb_dir())
    misses = []
    for cause in kb.causes.values():
        for symptom in cause.symptoms:
            top = engine.rank_ids(symptom)[:3]
            if cause.id not in top:
                misses.append((cause.id, symptom[:60], top))
    assert not misses, misses


def test_kb_stats_json_shape():
    import json

    result = CliRunner().invoke(main, ["kb", "stats", "--json"])
    assert result.exit_code == 0, result.stderr
    stats = json.loads(result.stdout)
    row = stats["causes"][0]
    assert set(row) == {"id", "title", "title_zh", "has_zh", "signatures", "answers", "probes"}
    assert stats["totals"]["causes"] == len(stats["causes"]) >= 27
    assert stats["totals"]["causes_without_answers"] == []
