"""The KB site tests' data: a team layer whose every text tries to inject markup.

(A module of its own, not conftest.py: test modules import from it, and a
`from conftest import` would find another folder's conftest in a full run.)
"""

from __future__ import annotations

from pathlib import Path

import yaml

REPO_KB = Path(__file__).resolve().parents[2] / "kb"
HOSTILE_ID = "script-in-every-field"
HOSTILE_TITLE = "<script>window.kbSitePwned = 1</script> breaks the page"
HOSTILE_THREAD_ID = "../../outside <b>thread</b>"


def write_yaml(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, allow_unicode=True, sort_keys=False), encoding="utf-8")
    return path


def make_hostile_team(root: Path) -> Path:
    """Write the hostile team folder at `root` (also for module-scoped fixtures)."""
    write_yaml(
        root / "causes" / f"{HOSTILE_ID}.yaml",
        {
            "id": HOSTILE_ID,
            "title": HOSTILE_TITLE,
            "title_zh": "<script>window.kbSitePwned = 2</script> 页面被注入",
            "summary": 'A summary with "quotes" and <img src=x onerror="window.kbSitePwned=3">.',
            "summary_zh": "摘要 <iframe src=javascript:alert(1)></iframe>",
            "why": "Because `</p><script>window.kbSitePwned=4</script>` is text.",
            "signatures": [r"kb site test: <tag> \d+ injected"],
            "symptoms": ["kb site test: <tag> 7 injected", "网站测试 <script>注入</script>"],
            "fix": "Escape it.",
            "fix_code": "print('</pre><script>window.kbSitePwned = 5</script>')\n",
            "risks": "None <b>at all</b>.",
            "probes": [],
            "references": [
                {"title": "A link that runs code", "url": "javascript:window.kbSitePwned=6"},
                {"title": "A real one", "url": "https://example.org/docs?a=1&b=<2>"},
            ],
        },
    )
    write_yaml(
        root / "threads" / "hostile.yaml",
        {
            "id": HOSTILE_THREAD_ID,
            "title": "Thread <em>title</em>",
            "lang": "en",
            "question": "Why does <script>window.kbSitePwned=7</script> show?",
            "answers": [
                {
                    "id": "a1",
                    "text": '<img src=x onerror="window.kbSitePwned=8"> it is the escaping.',
                    "lang": "en",
                    "claims": [HOSTILE_ID],
                    "stance": "right",
                    "note": "<b>bold</b> note",
                }
            ],
        },
    )
    return root
