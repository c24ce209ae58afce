"""`assistant kb new`: a new cause file scaffolded from a real report.

    draft = draft_cause("nccl-bus-clash", report_text)
    draft.signature          # '... rank \\d+ and rank \\d+ both on CUDA device [0-9a-f]+'
    draft.matched            # the part of the report the signature matches
    path = write_new_file(kb_folder / "causes" / "nccl-bus-clash.yaml", draft.yaml)

The report gives what a person cannot invent: the root error (as clean.py
finds it), a signature proposed from it with the parts that vary between runs
generalised (paths, numbers, hosts, ranks, hex ids, pids), and the report
itself as the first symptom. Every section a person must write is left empty
with a `# TODO` comment beside it: empty text, an empty reference list and a
symptom list without Chinese are what `kb lint` rejects, so the file fails
lint until each TODO is written, and on nothing else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from assistant.clean import clean_log
from assistant.errors import UserError
from assistant.i18n import has_cjk
from assistant.knowledge.kb import ID_PATTERN
from assistant.knowledge.patterns import PatternError, compile_signature
from assistant.results import RootError

# A report longer than this is a log: its cleaned focus lines (root error and
# salient lines, what retrieval searches with) become the symptom instead.
MAX_SYMPTOM_CHARS = 1000
# A signature is the distinctive start of the error message, not all of it.
MAX_SIGNATURE_SOURCE_CHARS = 240
# NCCL puts what went wrong last: "... invalid usage ... Last error: Duplicate GPU detected : ..."
LAST_ERROR = re.compile(r"\bLast error:\s*(?P<detail>\S.*)$")

# The parts of an error line that change between runs, machines and ranks, in
# the order they are tried (a path may hold numbers, an address holds a port).
# Each becomes a pattern with no nested repeat, so patterns.py accepts it.
VARIABLE_PARTS = [
    # starts where a run of path characters starts: tried from inside a long run
    # without a slash, it rescanned the run from every character (quadratic)
    ("path", r"(?<![\w.~+-])(?:[A-Za-z]:)?(?:[\w.~+-]*[/\\])+[\w.+-]*", r"\S+"),
    ("ipv4", r"\b\d{1,3}(?:\.\d{1,3}){3}\b", r"[\d.]+"),
    # c10d's "[node01]:29500" and "(node01, 29500)"
    ("bracketed-host", r"(?<=\[)[^\]\s/]+(?=\]:\d)", r"[^\]]+"),
    ("host-port-pair", r"(?<=\()[A-Za-z0-9][\w.-]*(?=, \d+\))", r"[\w.-]+"),
    ("named-host", r"(?<=\b(?:host|node)[ =:])[A-Za-z0-9][\w.-]*", r"[\w.-]+"),
    ("hex-address", r"\b0x[0-9a-fA-F]+\b", r"0x[0-9a-f]+"),
    # bus ids, uuids: hex digits with at least one letter and one digit
    (
        "hex-id",
        r"\b(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{5,}\b",
        r"[0-9a-f]+",
    ),
    # a count or id, not a digit inside a name (c10d, sm_80); "10000ms" still counts
    ("number", r"(?<![A-Za-z_\d])\d+", r"\d+"),
]
_VARIABLE = re.compile(
    "|".join(f"(?P<{name.replace('-', '_')}>{rx})" for name, rx, _ in VARIABLE_PARTS)
)
_REPLACEMENT = {name.replace("-", "_"): pattern for name, _, pattern in VARIABLE_PARTS}
_REGEX_SPECIAL = re.compile(r"([.^$*+?{}\[\]\\|()])")

# The sections a person writes; each is scaffolded empty with this hint.
TODO_TEXT = {
    "title": "one line: what is wrong, in English",
    "title_zh": "the same line in Chinese",
    "summary": "one or two sentences a user recognises their failure in",
    "summary_zh": "the summary in Chinese",
    "why": "why it happens (the mechanism, not the symptom)",
    "fix": "what to change, in words",
    "fix_code": "the fix as code",
    "risks": "what the fix can break or hide",
}


@dataclass
class CauseDraft:
    """A scaffolded cause: its YAML text and what was found in the report."""

    cause_id: str
    root_error: RootError | None
    signature: str | None  # None: no error line found that a signature could match
    matched: str  # the text of the report the signature matches
    symptom: str
    yaml: str


def check_new_id(cause_id: str) -> str:
    """The id, or a UserError when it is not lowercase words joined by '-'."""
    if not re.match(ID_PATTERN, cause_id or ""):
        raise UserError(
            f"invalid id {cause_id!r}: use lowercase words joined by '-', e.g. nccl-bus-clash"
        )
    return cause_id


def literal(text: str) -> str:
    """Regex for the text as written: metacharacters escaped, spaces kept readable."""
    return _REGEX_SPECIAL.sub(r"\\\1", text)


def generalise(line: str) -> str:
    """A regex for `line` with its variable parts (paths, numbers, hosts, hex ids) generalised."""
    out, last = [], 0
    for match in _VARIABLE.finditer(line):
        out.append(literal(line[last : match.start()]))
        out.append(_REPLACEMENT[match.lastgroup])
        last = match.end()
    out.append(literal(line[last:]))
    return "".join(out)


def signature_source(root: RootError) -> str:
    """The part of the root error a signature is made from: the message's distinctive start.

    The exception type is left out: the same failure is a RuntimeError in one
    torch version and a DistBackendError in the next.
    """
    text = (root.message or root.type or "").strip()
    text = text.splitlines()[0] if text else ""
    last_error = LAST_ERROR.search(text)
    if last_error:
        text = last_error.group("detail")
    if len(text) <= MAX_SIGNATURE_SOURCE_CHARS:
        return text
    head = text[:MAX_SIGNATURE_SOURCE_CHARS]
    sentence_end = head.rfind(". ")
    cut = sentence_end + 1 if sentence_end > 40 else head.rfind(" ")
    return head[:cut].rstrip() if cut > 40 else head


def propose_signature(root: RootError | None, report: str) -> tuple[str | None, str]:
    """(signature, the text of the report it matches), or (None, "") without a usable error line.

    The proposal must pass `kb lint`'s rules and match the report's root error
    (where retrieval weighs a match three times); when the generalised form
    fails either, the message's literal text is tried instead.
    """
    if root is None:
        return None, ""
    source = signature_source(root)
    if not source:
        return None, ""
    root_text = f"{root.type}: {root.message}"
    for candidate in (generalise(source), literal(source)):
        try:
            found = compile_signature(candidate).search(root_text)
        except PatternError:
            continue
        if found is not None:
            return candidate, found.group(0)
    return None, ""


def symptom_from(report: str) -> str:
    """The report as a symptom: as written when short, its cleaned focus lines when a long log."""
    text = report.strip()
    if len(text) <= MAX_SYMPTOM_CHARS:
        return text
    return clean_log(text).focus[:MAX_SYMPTOM_CHARS].strip()


class _Dumper(yaml.SafeDumper):
    """Multi-line text as `|` blocks, so a scaffolded symptom reads like the report."""


def _str_presenter(dumper: yaml.SafeDumper, value: str):
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str_presenter)


def yaml_field(key: str, value) -> str:
    """One `key: value` entry as YAML (Unicode kept, multi-line text as a block)."""
    return yaml.dump(
        # Never folded: a signature or symptom stays one line, as it was written.
        {key: value},
        Dumper=_Dumper,
        allow_unicode=True,
        sort_keys=False,
        width=1_000_000,
    ).rstrip("\n")


def todo_field(key: str, hint: str) -> str:
    return f"{key}: ''  # TODO: {hint}"


def render_cause_yaml(
    cause_id: str, root: RootError | None, signature: str | None, symptom: str, source_name: str
) -> str:
    """The cause file's text: what the report gave, and a TODO for every other section."""
    found = f"{root.type}: {root.message}" if root else "no exception line found"
    lines = [
        f"# Scaffolded by `assistant kb new` from {source_name}.",
        f"# Root error: {found[:200]}".rstrip(),
        "# `assistant kb lint` fails until every TODO below is written.",
        yaml_field("id", cause_id),
        *(
            todo_field(key, TODO_TEXT[key])
            for key in ("title", "title_zh", "summary", "summary_zh", "why")
        ),
    ]
    if signature:
        lines += [
            "# Proposed from the root error; matches the report. Check it is not too broad.",
            yaml_field("signatures", [signature]),
        ]
    else:
        lines.append(
            "signatures: []  # TODO: no exception line in the report; add its error line as a regex"
        )
    if not has_cjk(symptom):
        lines.append("# TODO: add a symptom in Chinese (kb lint requires one).")
    lines += [
        yaml_field("symptoms", [symptom]),
        *(todo_field(key, TODO_TEXT[key]) for key in ("fix", "fix_code", "risks")),
        "probes: []  # TODO: the registered probes that test this cause, if any (assistant probe --help)",
        "references: []  # TODO: at least one {title, url} that documents this failure",
    ]
    return "\n".join(lines) + "\n"


def draft_cause(cause_id: str, report: str, source_name: str = "a report") -> CauseDraft:
    """Scaffold a cause from a report's text (raises UserError on an empty report)."""
    check_new_id(cause_id)
    if not report.strip():
        raise UserError("the report is empty: give a file with the error or log")
    root = clean_log(report).root_error
    signature, matched = propose_signature(root, report)
    symptom = symptom_from(report)
    text = render_cause_yaml(cause_id, root, signature, symptom, source_name)
    return CauseDraft(cause_id, root, signature, matched, symptom, text)


def write_new_file(path: Path, text: str) -> Path:
    """Create `path` with `text`; never overwrites (UserError when it exists)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with path.open("x", encoding="utf-8") as handle:
            handle.write(text)
    except FileExistsError:
        raise UserError(f"{path} already exists; not overwriting it (choose another id)") from None
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path
