"""KB signatures: linear-time matching, and the rules that keep the `re` fallback safe."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from assistant.knowledge.patterns import PatternError, PatternSet, compile_signature

REPO = Path(__file__).resolve().parents[2]
BAD = REPO / "tests" / "data" / "kb_bad"

# pattern -> why it is refused (None: accepted). The same answer with RE2 and
# without it (rules checked statically), so `kb lint` agrees everywhere.
RULES = {
    r"(a+)+$": "nested quantifier",
    r"(\w+\s?)*$": "nested quantifier",
    r"(a*){20}": "nested quantifier",
    r"(a|ab)*c": "repeated alternatives",
    r"(.|\n)*x": "repeated alternatives",
    r"Duplicate GPU (?=detected)": "cannot take",
    r"(a)\1": "cannot take",
    r"a++": "cannot take",
    r"\d{1,5000}": "cannot take",
    r"Duplicate GPU (detected": "not a valid regex",
    r"(?:error|exception)+": None,
    r"(\d+\.){3}\d+": None,
    r"unrecognized arguments: .*--local[-_]rank": None,
    r"多卡\s*训练": None,
}


@pytest.mark.parametrize("linear", [True, False])
@pytest.mark.parametrize("pattern", sorted(RULES))
def test_the_same_rules_with_and_without_re2(pattern, linear):
    reason = RULES[pattern]
    if reason is None:
        assert compile_signature(pattern, linear).source == pattern
        return
    with pytest.raises(PatternError, match=reason.replace("(", r"\(")):
        compile_signature(pattern, linear)


def test_a_pattern_set_gives_the_first_match_with_its_groups():
    errors = PatternSet.from_patterns(
        [r"environment variable (\w+) expected", r"KeyError: '(LOCAL_RANK|RANK)'"]
    )
    found = errors.search("ValueError: Environment variable MASTER_ADDR expected, but not set")
    assert found.group(1) == "MASTER_ADDR"
    assert errors.search("KeyError: 'LOCAL_RANK'").group(1) == "LOCAL_RANK"
    assert errors.search("all good") is None
    assert [s.source for s in errors.matching("KeyError: 'RANK'")] == [
        r"KeyError: '(LOCAL_RANK|RANK)'"
    ]


def test_a_pattern_set_refuses_or_skips_a_hostile_pattern():
    with pytest.raises(PatternError, match="nested quantifier"):
        PatternSet.from_patterns(["Duplicate GPU", "(a+)+$"])
    kept = PatternSet.from_patterns(["Duplicate GPU", "(a+)+$"], skip_invalid=True)
    assert [s.source for s in kept.signatures] == ["Duplicate GPU"]


WITHOUT_RE2 = textwrap.dedent(
    """
    from assistant.knowledge.patterns import compile_signature
    signature = compile_signature("Duplicate GPU detected", linear=False)
    print(signature.search("Duplicate GPU detected"), signature.search("Duplicate GPU detected"))
    """
)


def test_without_re2_nothing_matches_and_it_is_said_once():
    """The fallback policy: no backtracking engine at query time, and no silence."""
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_RE2],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None None"
    from assistant.knowledge.patterns import NO_ENGINE_NOTICE

    assert done.stderr.splitlines() == [NO_ENGINE_NOTICE]
    assert "google-re2 is not installed" in NO_ENGINE_NOTICE


# The retriever's own signature signal over signatures that would never finish
# under backtracking `re`: (a+)+$ (an index built before the lint rule) and
# .*.*.*.*.*x (allowed: polynomial, ~10^15 steps in `re` on this text).
HOSTILE_QUERY = textwrap.dedent(
    """
    import time
    from types import SimpleNamespace
    from assistant.clean import clean_log
    from assistant.knowledge.retrieve import Retriever

    causes = {
        "hostile": {"signatures": ["(a+)+$", ".*.*.*.*.*x"]},
        "plain": {"signatures": ["aaaa!"]},
    }
    retriever = Retriever(SimpleNamespace(causes=causes), embedder=None)
    started = time.perf_counter()
    scores = retriever.signature_scores(clean_log("a" * 3000 + "!"))
    print(sorted(scores), round(time.perf_counter() - started, 3))
    """
)


def test_a_query_against_hostile_signatures_returns_at_once():
    done = subprocess.run(
        [sys.executable, "-c", HOSTILE_QUERY],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    matched, seconds = done.stdout.rsplit(" ", 1)
    assert matched == "['plain']"
    assert float(seconds) < 1.0


@pytest.mark.slow
def test_ask_with_a_hostile_team_kb_ends_with_one_line_at_once(tmp_path):
    """The tester's report, end to end: the KB is refused, the query does not hang."""
    team = tmp_path / "team"
    (team / "causes").mkdir(parents=True)
    (team / "causes" / "catastrophic-backtracking.yaml").write_bytes(
        (BAD / "causes" / "catastrophic-backtracking.yaml").read_bytes()
    )
    env = {**os.environ, "ASSISTANT_BUILD": str(tmp_path / "build"), "ASSISTANT_KB_PATH": ""}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "assistant", "ask", "--no-probe", "--kb", str(team), "a" * 34],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("assistant: error: knowledge base is invalid (1 problem(s)")
    assert "catastrophic-backtracking.yaml: signatures.1: invalid regex '(a+)+$'" in lines[-1]
    assert time.monotonic() - started < 60


def test_re2_decides_like_re_on_every_labelled_query():
    """The switch to RE2 changes no signature decision on the eval sets' 300+ queries,
    against `re` with ASCII classes: RE2's \\w, \\d, \\s, \\b are ASCII-only. That is what a
    signature wants in mixed text: in "提示bus error" (a real Chinese report) Unicode \\b sees
    no word boundary between 示 and "bus", ASCII \\b does."""
    import json
    import re

    from assistant.clean import clean_log
    from assistant.config import kb_dir
    from assistant.knowledge.kb import load_kb

    kb = load_kb(kb_dir())
    linear = {cid: PatternSet.from_patterns(c.signatures) for cid, c in kb.causes.items()}
    backtracking = {
        cid: [re.compile(p, re.IGNORECASE | re.ASCII) for p in c.signatures]
        for cid, c in kb.causes.items()
    }
    texts = [
        json.loads(line)["query"]
        for path in sorted((REPO / "data" / "eval").glob("*.jsonl"))
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]
    assert len(texts) > 300
    for text in texts:
        body = clean_log(text).text
        for cid, patterns in backtracking.items():
            expected = [p.pattern for p in patterns if p.search(body)]
            assert [s.source for s in linear[cid].matching(body)] == expected, (cid, text[:80])
