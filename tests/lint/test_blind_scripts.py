"""The linter on training scripts written blind (data/eval/blind_scripts).

Two helpers who never saw the linter wrote 40 realistic training scripts
(plain DDP, launch.py-era, nanoGPT-style, Accelerate, Lightning, DeepSpeed):
32 with one mistake each, labelled with its cause, and 8 correct ones. Measured
once at session 18's 59ad93b: 10 of the 32 causes found, and 14 other findings
in 9 of the 40 files. What they taught was then fixed in general words
(data/eval/README.md, "Session 18"); these floors keep it. Causes no static
check can decide from one file (a checkpoint's saved keys, unused parameters,
metrics left per rank) are counted as misses, not left out.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from assistant.lint import lint_script

BLIND = Path(__file__).parents[2] / "data" / "eval" / "blind_scripts"
FOUND_FLOOR = 21  # of 32 (measured once: 10)
OTHER_FINDINGS_CEILING = 6  # measured once: 14, in 9 files


def labelled_scripts() -> list[tuple[Path, dict]]:
    return [
        (folder / label["file"], label)
        for folder in sorted(p for p in BLIND.iterdir() if p.is_dir())
        for label in map(json.loads, (folder / "labels.jsonl").read_text().splitlines())
    ]


@pytest.fixture(scope="module")
def linted() -> list[tuple[dict, list]]:
    return [(label, lint_script(path)) for path, label in labelled_scripts()]


def test_there_are_broken_and_correct_blind_scripts():
    labels = [label for _path, label in labelled_scripts()]
    assert sum(label["cause"] is not None for label in labels) == 32
    assert sum(label["cause"] is None for label in labels) == 8


def test_the_labelled_cause_is_found_in_enough_broken_scripts(linted):
    found = [
        label["file"]
        for label, findings in linted
        if label["cause"] in {f.cause_id for f in findings}
    ]
    assert len(found) >= FOUND_FLOOR, found


def test_correct_scripts_get_no_finding_and_broken_ones_few_others(linted):
    correct = {label["file"]: findings for label, findings in linted if label["cause"] is None}
    assert all(findings == [] for findings in correct.values()), correct
    others = [
        (label["file"], f.cause_id, f.line)
        for label, findings in linted
        for f in findings
        if f.cause_id != label["cause"]
    ]
    assert len(others) <= OTHER_FINDINGS_CEILING, others
