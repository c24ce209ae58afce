"""Code a person pasted into a question, linted where a fragment is enough.

Reports often quote the lines they suspect: `accelerator.wait_for_everyone()`
inside `if accelerator.is_main_process:`, `self.all_gather(...)` under
`if self.trainer.is_global_zero:`. Most checks need the whole script (where
set_device is called, how the job is launched) and on a fragment they guess:
over the 1524 labelled real reports in data/eval, the other checks named a
cause the thread did not resolve 18 times in 24 (most judge what a fragment
does not show: no set_device, no DistributedSampler, no main guard).
FRAGMENT_CHECKS read only what is shown: a collective under a rank test or
with rank-dependent shapes or counts, an attribute read through the wrapper
right after `DDP(model)`, a layer added on rank 0 before it. Over the same
reports they fired three times, all on reports the thread resolved so
(collective-mismatch; data/eval/README.md, session 17); the other three
have not fired on a labelled report yet.

A fragment is a fenced block (```), or a run of code-looking lines, dedented
and trimmed at its ends until it parses. It is parsed after as many blank
lines as precede it, so a finding's line numbers are the question's own.

Pasted launch lines are read too (assistant.lint.launchtext):
`CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc_per_node=4 ...` starts more ranks
per node than it lets them see (world-size-exceeds-devices; over every
labelled query, the three such lines were all on reports the thread
resolved so; an earlier `export` was not counted: it matched one report
whose job ran elsewhere), and `srun torchrun` under several tasks per node
starts torchrun's processes once per task (slurm-without-torchrun).
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Iterator
from dataclasses import replace

from assistant.errors import UserError
from assistant.lint.launchtext import launch_problems
from assistant.results import Finding

FRAGMENT_CHECKS = frozenset(
    {"collective-mismatch", "uneven-inputs", "ddp-wrapper-attribute", "model-differs-across-ranks"}
)
# A fragment rarely shows its imports; these names mean one thing in DDP code.
CONVENTIONAL_IMPORTS = {
    "dist": "torch.distributed",
    "DDP": "torch.nn.parallel.DistributedDataParallel",
}
MAX_QUESTION_CHARS = 200_000  # a long log's code sits near its head
MAX_FRAGMENTS = 20
MIN_LINES = 3  # fewer is a quoted call, not code to follow
MAX_TRIM = 6  # lines tried off each end of a run (prose before it, output after it)
# A fragment past this is a whole script (`ask --script` lints it as one), and
# each trim is a parse: the tries over a question are bounded too.
MAX_FRAGMENT_CHARS = 20_000
MAX_PARSES = 300
FENCE = re.compile(r"^[ \t]*```[^\n`]*\n(.*?)^[ \t]*```", re.DOTALL | re.MULTILINE)
# A line that reads as Python: a statement keyword, a decorator or comment,
# an assignment or call, or a closing bracket. Indented and blank lines
# continue a run that has begun.
CODE_LINE = re.compile(
    r"^\s*(?:import\s|from\s+\S+\s+import\s|def\s|class\s|if\s|elif\s|else\s*:|for\s|while\s"
    r"|with\s|try\s*:|except\b|finally\s*:|return\b|raise\b|pass\b|break\b|continue\b|[@#]"
    r"|[A-Za-z_][\w.]*(?:\[[^\]\n]*\])?\s*(?:=|\+=|-=|\()|[)\]}])"
)


def lint_pasted(text: str) -> list[Finding]:
    """Findings in the code and launch lines pasted into `text` (source "question")."""
    text = text[:MAX_QUESTION_CHARS]
    found: dict[tuple, Finding] = {
        (f.cause_id, f.line, f.message): f for f in launch_line_findings(text)
    }
    fragments = list(pasted_code(text))
    if fragments:
        from assistant.lint.script import lint_source  # the checks load only for code
    for fragment in fragments:
        try:
            findings = lint_source(fragment, path="", assumed_imports=CONVENTIONAL_IMPORTS)
        except UserError:
            continue  # not a script after all, or one too big or deep to follow
        for finding in findings:
            if finding.cause_id in FRAGMENT_CHECKS:
                kept = replace(finding, source="question")
                found.setdefault((kept.cause_id, kept.line, kept.message), kept)
    return list(found.values())


def launch_line_findings(text: str) -> list[Finding]:
    """Pasted launch lines that contradict themselves (assistant.lint.launchtext)."""
    return [
        Finding(cause_id, number, message, source="question")
        for number, cause_id, message in launch_problems(text)
    ]


def pasted_code(text: str) -> Iterator[str]:
    """Each fragment of code in `text` that parses, after blank lines up to its own line."""
    lines = text.splitlines()
    fenced = [False] * len(lines)
    runs: list[tuple[int, list[str]]] = []
    for match in FENCE.finditer(text):
        first = text.count("\n", 0, match.start(1))
        body = match.group(1).splitlines()
        runs.append((first, body))
        for index in range(first - 1, min(first + len(body) + 1, len(lines))):
            fenced[index] = True
    runs.extend(unfenced_runs(lines, fenced))
    runs.sort(key=lambda run: run[0])
    budget = [MAX_PARSES]
    for first, body in runs[:MAX_FRAGMENTS]:
        fragment = parsing_part(first, body, budget)
        if fragment is not None:
            yield fragment


def unfenced_runs(lines: list[str], fenced: list[bool]) -> Iterator[tuple[int, list[str]]]:
    """(first line index, lines) of each run of code-looking lines outside fences."""
    start, run = 0, []
    for index, line in enumerate(lines):
        continues = run and (not line.strip() or line[:1] in (" ", "\t"))
        if not fenced[index] and (CODE_LINE.match(line) or continues):
            if not run:
                start = index
            run.append(line)
            continue
        if len(run) >= MIN_LINES:
            yield start, run
        run = []
    if len(run) >= MIN_LINES:
        yield start, run


def parsing_part(first: int, body: list[str], budget: list[int]) -> str | None:
    """The longest part of a run, trimmed at either end, that parses; None if none does.

    `budget`: parses left for the whole question, spent here.
    """
    if len(body) < MIN_LINES or sum(map(len, body)) > MAX_FRAGMENT_CHARS:
        return None
    for head in range(min(MAX_TRIM, len(body) - MIN_LINES) + 1):
        for end in range(len(body), max(head + MIN_LINES, len(body) - MAX_TRIM) - 1, -1):
            if budget[0] <= 0:
                return None
            budget[0] -= 1
            code = textwrap.dedent("\n".join(body[head:end]))
            if parses(code):
                return "\n" * (first + head) + code
    return None


def parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True
