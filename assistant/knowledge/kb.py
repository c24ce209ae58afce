"""The knowledge base: loading and strictly validating the files under kb/.

kb/causes/<id>.yaml   one file per cause (schema: `Cause`)
kb/threads/<id>.yaml  one community thread with its answers (schema: `Thread`)

`load_kb` returns the parsed KB or raises `KBError` listing every problem as
"file: field: message", which is what `assistant kb lint` prints.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from assistant.config import contract_ids
from assistant.i18n import has_cjk
from assistant.knowledge.files import content_hash
from assistant.probing.registry import PROBES

ID_PATTERN = r"^[a-z0-9][a-z0-9-]*$"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)


def _non_empty(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be empty")
    return value


class Reference(Strict):
    title: str
    url: str


class Cause(Strict):
    """One failure mode, documented like a lint rule."""

    id: str
    title: str
    title_zh: str
    summary: str
    summary_zh: str
    why: str
    signatures: list[str]  # regexes over real error text, case-insensitive
    symptoms: list[str]  # how people paste it; at least one in Chinese
    fix: str
    fix_code: str
    risks: str
    probes: list[str]
    references: list[Reference]
    why_zh: str = ""
    fix_zh: str = ""

    _nonempty = field_validator(
        "id", "title", "title_zh", "summary", "summary_zh", "why", "fix", "fix_code", "risks"
    )(_non_empty)

    @field_validator("id")
    @classmethod
    def _id_shape(cls, value: str) -> str:
        if not re.match(ID_PATTERN, value):
            raise ValueError("must be lowercase words joined by '-'")
        return value

    @field_validator("signatures")
    @classmethod
    def _regexes_compile(cls, values: list[str]) -> list[str]:
        for pattern in values:
            try:
                re.compile(pattern, re.IGNORECASE)
            except re.error as exc:
                raise ValueError(f"invalid regex {pattern!r}: {exc}") from None
        return values

    @field_validator("symptoms", "references")
    @classmethod
    def _at_least_one(cls, values: list) -> list:
        if not values:
            raise ValueError("needs at least one entry")
        return values

    @field_validator("symptoms")
    @classmethod
    def _one_in_chinese(cls, values: list[str]) -> list[str]:
        if not any(has_cjk(v) for v in values):
            raise ValueError("needs at least one symptom in Chinese")
        if any(not v.strip() for v in values):
            raise ValueError("must not contain empty entries")
        return values

    @field_validator("probes")
    @classmethod
    def _known_probes(cls, values: list[str]) -> list[str]:
        unknown = [name for name in values if name not in PROBES]
        if unknown:
            raise ValueError(f"unknown probe {', '.join(unknown)} (known: {', '.join(PROBES)})")
        return values


Stance = Literal["right", "partly_right", "wrong", "unverified"]


class ThreadAnswer(Strict):
    """An answer as people wrote it, tagged with the causes it claims."""

    id: str
    text: str
    lang: Literal["en", "zh"]
    claims: list[str]
    stance: Stance
    note: str = ""
    contradicts: list[str] = []  # ids of answers in the same thread
    advice: str = ""  # a tag a probe can refute, e.g. "set-device-after-init"

    _nonempty = field_validator("id", "text")(_non_empty)


class Thread(Strict):
    """A community thread: the question and its answers."""

    id: str
    title: str
    lang: Literal["en", "zh"]
    question: str
    answers: list[ThreadAnswer]
    source: str = ""

    _nonempty = field_validator("id", "title", "question")(_non_empty)

    @field_validator("answers")
    @classmethod
    def _at_least_one(cls, values: list) -> list:
        if not values:
            raise ValueError("needs at least one answer")
        return values


@dataclass
class KnowledgeBase:
    """The parsed KB: causes by id, threads, and the hash of their source."""

    causes: dict[str, Cause]
    threads: list[Thread]
    content_hash: str
    files: dict[str, Path] = field(default_factory=dict)  # cause or thread id -> file


class KBError(Exception):
    """The KB does not validate; `problems` are 'file: field: message' lines."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


def _describe(path: Path, root: Path, exc: ValidationError) -> list[str]:
    name = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
    lines = []
    for err in exc.errors():
        loc = ".".join(str(part) for part in err["loc"]) or "(top)"
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = "unknown key"
        lines.append(f"{name}: {loc}: {message}")
    return lines


# libyaml's loader when PyYAML has it: five times faster on the whole KB.
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _read_yaml(path: Path, root: Path, problems: list[str]) -> dict | None:
    name = path.relative_to(root).as_posix()
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=SAFE_LOADER)
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        problems.append(f"{name}: (file): not valid YAML: {first}")
        return None
    if not isinstance(data, dict):
        problems.append(f"{name}: (file): expected a mapping of fields")
        return None
    return data


def load_kb(root: Path, require_contract: bool = True) -> KnowledgeBase:
    """Parse and validate the whole KB; raise KBError with every problem found."""
    if not root.is_dir():
        raise KBError([f"{root}: (dir): knowledge base directory not found"])
    problems: list[str] = []
    causes: dict[str, Cause] = {}
    threads: list[Thread] = []
    files: dict[str, Path] = {}

    for path in sorted(root.glob("causes/*.yaml")):
        data = _read_yaml(path, root, problems)
        if data is None:
            continue
        try:
            cause = Cause.model_validate(data)
        except ValidationError as exc:
            problems.extend(_describe(path, root, exc))
            continue
        name = path.relative_to(root).as_posix()
        if cause.id in causes:
            other = files[cause.id].relative_to(root).as_posix()
            problems.append(f"{name}: id: duplicate id {cause.id!r} (also in {other})")
            continue
        if path.stem != cause.id:
            problems.append(f"{name}: id: {cause.id!r} does not match the file name")
        causes[cause.id] = cause
        files[cause.id] = path

    for path in sorted(root.glob("threads/*.yaml")):
        data = _read_yaml(path, root, problems)
        if data is None:
            continue
        try:
            thread = Thread.model_validate(data)
        except ValidationError as exc:
            problems.extend(_describe(path, root, exc))
            continue
        name = path.relative_to(root).as_posix()
        if thread.id in files:
            problems.append(f"{name}: id: duplicate id {thread.id!r}")
            continue
        problems.extend(_thread_problems(name, thread, causes))
        threads.append(thread)
        files[thread.id] = path

    if require_contract:
        missing = [cid for cid in contract_ids() if cid not in causes]
        if missing:
            problems.append(f"kb/causes: (dir): no file for contract cause(s) {', '.join(missing)}")
    if problems:
        raise KBError(problems)
    return KnowledgeBase(causes, threads, content_hash(root), files)


def _thread_problems(name: str, thread: Thread, causes: dict[str, Cause]) -> list[str]:
    problems = []
    seen: set[str] = set()
    ids = {a.id for a in thread.answers}
    for i, answer in enumerate(thread.answers):
        where = f"{name}: answers.{i}"
        if answer.id in seen:
            problems.append(f"{where}.id: duplicate answer id {answer.id!r}")
        seen.add(answer.id)
        for cid in answer.claims:
            if cid not in causes:
                problems.append(f"{where}.claims: unknown cause {cid!r}")
        for other in answer.contradicts:
            if other not in ids or other == answer.id:
                problems.append(f"{where}.contradicts: unknown answer {other!r}")
    return problems
