"""`assistant kb lint`: the real KB passes; each broken file is named with its field."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from assistant.cli import main
from assistant.knowledge.kb import load_kb

BAD = Path(__file__).parents[1] / "data" / "kb_bad"
REPO_KB = Path(__file__).parents[2] / "kb"

# broken file -> the "field: message" of its one lint line. Each is linted as
# a team layer over the real KB, so it must be the only problem reported.
EXPECTED = {
    "causes/unknown-key.yaml": "colour: unknown key",
    "causes/invalid-regex.yaml": "signatures.0: invalid regex",
    "causes/catastrophic-backtracking.yaml": "signatures.1: invalid regex '(a+)+$': nested",
    "causes/lookahead-regex.yaml": "signatures.0: invalid regex 'Duplicate GPU (?=detected)': "
    "the linear engine (RE2) cannot take it",
    "causes/unknown-probe.yaml": "probes.1: unknown probe crystal_ball",
    "causes/empty-field.yaml": "fix: must not be empty",
    "causes/todo-left-in-fix.yaml": "fix: still TODO: write it",
    "causes/no-chinese-symptom.yaml": "symptoms: needs at least one symptom in Chinese",
    "causes/duplicate-id.yaml": "id: duplicate id 'duplicate-gpu-per-rank' (also in causes/"
    "duplicate-gpu-per-rank.yaml); to add to it, write `extends: duplicate-gpu-per-rank`",
    "causes/not-yaml.yaml": "(file): not valid YAML",
    "causes/extends-unknown-cause.yaml": "extends: unknown cause 'cosmic-rays'",
    "causes/extends-overrides-scalar.yaml": "fix: an extension cannot override 'fix'",
    "causes/refines-unknown-cause.yaml": "refines: unknown cause 'cosmic-rays'",
    "causes/refines-without-named-by.yaml": "refines: needs named_by",
    "causes/refines-itself.yaml": "refines: a cause cannot refine itself",
    "causes/refines-a-special-case.yaml": "refines: 'syncbn-without-process-group' refines "
    "other causes itself",
    "threads/unknown-cause.yaml": "answers.0.claims: unknown cause 'cosmic-rays'",
    "threads/duplicate-answer-id.yaml": "answers.1.id: duplicate answer id 'a1'",
}


def test_every_bad_file_has_an_expectation():
    found = {p.relative_to(BAD).as_posix() for p in BAD.glob("*/*.yaml")}
    assert found == set(EXPECTED)


def lint(*args: str, env: dict | None = None):
    return CliRunner().invoke(main, ["kb", "lint", *args], env=env)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_one_mistake_one_problem_naming_file_and_field(name, tmp_path):
    team = tmp_path / "team"
    (team / name).parent.mkdir(parents=True)
    (team / "causes").mkdir(exist_ok=True)
    shutil.copy(BAD / name, team / name)
    result = lint("--kb", str(team))
    assert result.exit_code == 1
    problems = result.stderr.splitlines()[:-1]
    assert len(problems) == 1, result.stderr
    assert problems[0].startswith(f"{team / name}: {EXPECTED[name]}"), result.stderr
    assert result.stderr.splitlines()[-1].startswith("1 problem(s) in ")


def test_a_bad_regex_in_a_claimed_cause_is_one_problem_not_six(tmp_path):
    """The tester's report: the threads claiming it and the contract did not cascade."""
    kb = tmp_path / "kb"
    shutil.copytree(REPO_KB, kb)
    cause = kb / "causes" / "duplicate-gpu-per-rank.yaml"
    text = cause.read_text(encoding="utf-8")
    cause.write_text(text.replace("- 'Duplicate GPU detected'", "- 'Duplicate GPU (detected'", 1))
    result = lint(env={"ASSISTANT_KB": str(kb), "ASSISTANT_KB_PATH": ""})
    assert result.exit_code == 1
    expected = (
        "causes/duplicate-gpu-per-rank.yaml: signatures.0: invalid regex "
        "'Duplicate GPU (detected': not a valid regex: missing ), unterminated subpattern "
        "at position 14"
    )
    assert result.stderr.splitlines()[:-1] == [expected]


def test_a_team_cause_with_a_bad_regex_and_its_threads_is_one_problem():
    team = BAD / "layers" / "regex-error-claimed-by-threads"
    result = lint("--kb", str(team))
    assert result.exit_code == 1
    problems = result.stderr.splitlines()[:-1]
    assert (
        len(problems) == 1
        and "bad-regex-claimed.yaml: signatures.0: invalid regex" in (problems[0])
    ), result.stderr


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

    from assistant.config import kb_dir

    result = CliRunner().invoke(main, ["kb", "stats", "--json"])
    assert result.exit_code == 0, result.stderr
    stats = json.loads(result.stdout)
    row = stats["causes"][0]
    assert set(row) == {
        "id",
        "title",
        "title_zh",
        "has_zh",
        "signatures",
        "answers",
        "probes",
        "source",
        "extended_by",
    }
    assert row["source"] == str(kb_dir()) and row["extended_by"] == []
    assert stats["totals"]["causes"] == len(stats["causes"]) >= 27
    assert stats["totals"]["causes_without_answers"] == []


def test_a_team_layers_broken_term_bridge_is_one_lint_problem(tmp_path):
    team = tmp_path / "team"
    (team / "causes").mkdir(parents=True)
    shutil.copy(BAD.parent / "bridge" / "key_twice.yaml", team / "bridge.yaml")
    result = lint("--kb", str(team))
    assert result.exit_code == 1
    problems = result.stderr.splitlines()[:-1]
    assert len(problems) == 1 and str(team / "bridge.yaml") in problems[0], result.stderr
