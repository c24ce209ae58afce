"""The knowledge base: loading and strictly validating the files of every KB layer.

<layer>/causes/<id>.yaml   one file per cause (schema: `Cause`), or an extension
                           of a cause from an earlier layer (schema: `CauseExtension`)
<layer>/threads/<id>.yaml  one community thread with its answers (schema: `Thread`)

The first layer is the built-in kb/; team folders come after it (see
config.kb_layers). A team folder adds its own causes and threads, and extends
a built-in cause with a file that names it and lists only what to append:

    # team/causes/duplicate-gpu-per-rank.yaml
    extends: duplicate-gpu-per-rank
    symptoms: ["our cluster: both ranks on GPU 0 after the driver update"]
    signatures: ['ACME launcher: duplicate device \\d+']

`load_kb` returns the merged KB or raises `KBError` listing every problem as
"file: field: message" (what `assistant kb lint` prints), one per mistake: a
cause file that fails validation still declares its id, so the threads that
claim it and the contract check do not report it a second time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from assistant.config import contract_ids
from assistant.errors import ExitCode, UserError
from assistant.i18n import has_cjk
from assistant.knowledge.files import Layers, as_layers, content_hash
from assistant.knowledge.patterns import PatternError, compile_signature
from assistant.probing.registry import PROBES

ID_PATTERN = r"^[a-z0-9][a-z0-9-]*$"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)


def _non_empty(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be empty")
    _not_todo(value)
    return value


def _not_todo(value: str) -> None:
    """A scaffolded section (`assistant kb new`) must be written before the KB builds."""
    if value.strip().startswith("TODO"):  # the marker, in capitals; ids are lowercase
        raise ValueError("still TODO: write it")


def _safe_signature(pattern: str) -> str:
    """The rules of patterns.py: RE2 takes it, and `re` could not backtrack on it."""
    try:
        compile_signature(pattern)
    except PatternError as exc:
        raise ValueError(f"invalid regex {pattern!r}: {exc}") from None
    return pattern


def _known_probe(name: str) -> str:
    if name not in PROBES:
        raise ValueError(f"unknown probe {name} (known: {', '.join(PROBES)})")
    return name


def _no_empty_entries(values: list[str]) -> list[str]:
    if any(not v.strip() for v in values):
        raise ValueError("must not contain empty entries")
    for value in values:
        _not_todo(value)
    return values


# Checked item by item, so a problem names the entry: "signatures.2: invalid regex ...".
SignatureText = Annotated[str, AfterValidator(_safe_signature)]
ProbeName = Annotated[str, AfterValidator(_known_probe)]


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
    signatures: list[SignatureText]  # regexes over real error text, case-insensitive
    symptoms: list[str]  # how people paste it; at least one in Chinese
    fix: str
    fix_code: str
    risks: str
    probes: list[ProbeName]
    references: list[Reference]
    why_zh: str = ""
    fix_zh: str = ""
    # False for a cause whose job runs without an error or a hang (slow,
    # wrong numbers, one GPU busy): a report of an error is not answered
    # with it first (retrieve.py).
    fails: bool = True
    # False for a cause that only ever fails with an error (an exception, a
    # refused launch): a report of a hang and nothing else is not answered
    # with it first (retrieve.py).
    hangs: bool = True
    # True for a cause whose job was started without a distributed launcher
    # (a plain `python train.py`): a report whose launch uses one (torchrun,
    # torch.distributed.launch, accelerate launch...) and shows no plain
    # `python script.py` is not answered with it first (retrieve.py).
    no_launcher: bool = False
    # True for a cause of one process driving several GPUs (nn.DataParallel):
    # a report of DDP, torchrun or ranks is not answered with it first.
    one_process: bool = False
    # For a cause that belongs to one tool or setting (FSDP, DeepSpeed, Slurm,
    # torch.compile, Windows...): words (regexes, case-insensitive) of which a
    # report of it names at least one. A report that names none is not
    # answered with it first on word likeness alone (retrieve.py); its
    # signatures still count in full.
    named_by: list[SignatureText] = []
    # Causes this one is a special case of: their signature is the error this
    # one prints too ("Default process group has not been initialized" from a
    # SyncBatchNorm layer). A report that names this cause (`named_by`, which
    # it must have) and matches such a signature is answered with this cause:
    # retrieval hands it the match (retrieve.Retriever.refined) and the
    # verdicts read the error as its own (verdicts.signatures.as_refined). The
    # general error names the general cause only when the report says nothing
    # more specific.
    refines: list[str] = []

    _nonempty = field_validator(
        "id", "title", "title_zh", "summary", "summary_zh", "why", "fix", "fix_code", "risks"
    )(_non_empty)

    @field_validator("id")
    @classmethod
    def _id_shape(cls, value: str) -> str:
        if not re.match(ID_PATTERN, value):
            raise ValueError("must be lowercase words joined by '-'")
        return value

    @field_validator("refines")
    @classmethod
    def _refines_named_causes(cls, values: list[str], info: ValidationInfo) -> list[str]:
        # named_by and id are declared earlier, so they are validated already.
        if values and not info.data.get("named_by"):
            raise ValueError(
                "needs named_by (the words that tell a report of this cause "
                "from one of the causes it refines)"
            )
        if info.data.get("id") in values:
            raise ValueError("a cause cannot refine itself")
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
        return _no_empty_entries(values)


# The lists a team layer may append to a cause of an earlier layer; every
# other field of a cause is a scalar that only its own file may set.
EXTENDABLE = ("signatures", "symptoms", "probes", "references")


class CauseExtension(Strict):
    """Additions to a cause of an earlier layer: only lists, appended in order."""

    extends: str
    signatures: list[SignatureText] = []
    symptoms: list[str] = []
    probes: list[ProbeName] = []
    references: list[Reference] = []

    _symptoms = field_validator("symptoms")(_no_empty_entries)


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
    """The merged KB: causes by id, threads, and the hash of every layer's source."""

    causes: dict[str, Cause]
    threads: list[Thread]
    content_hash: str
    files: dict[str, Path] = field(default_factory=dict)  # cause or thread id -> file
    sources: dict[str, Path] = field(default_factory=dict)  # cause id -> layer it came from
    extended_by: dict[str, list[Path]] = field(default_factory=dict)  # cause id -> layers


class KBError(Exception):
    """The KB does not validate; `problems` are 'file: field: message' lines."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


def _describe(name: str, exc: ValidationError) -> list[str]:
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


def _read_yaml(path: Path, name: str, problems: list[str]) -> dict | None:
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


def _declared_id(data: dict | None, path: Path) -> str:
    """The id a file means to define, even when it does not validate."""
    value = (data or {}).get("id")
    return value if isinstance(value, str) and value.strip() else path.stem


class _LayeredLoader:
    """Reads the layers bottom first, collecting problems; one mistake, one problem."""

    def __init__(self, layers: list[Path]):
        self.layers = layers
        self.problems: list[str] = []
        self.causes: dict[str, Cause] = {}
        self.threads: list[Thread] = []
        self.thread_names: list[str] = []
        self.files: dict[str, Path] = {}
        self.sources: dict[str, Path] = {}
        self.extended_by: dict[str, list[Path]] = {}
        self.broken: set[str] = set()  # ids of files that failed: not reported again

    def name(self, path: Path, layer: Path) -> str:
        """How a problem names a file: relative in the built-in layer, the full path above it."""
        if layer == self.layers[0]:
            return path.relative_to(layer).as_posix()
        return str(path)

    def load_layer(self, layer: Path) -> None:
        extensions = []
        for path in sorted(layer.glob("causes/*.yaml")):
            data = _read_yaml(path, self.name(path, layer), self.problems)
            if data is not None and "extends" in data:
                extensions.append((path, data))
            else:
                self.add_cause(path, layer, data)
        # Extensions apply after the layer's own causes, to causes of earlier layers only.
        for path, data in extensions:
            self.extend_cause(path, layer, data)
        for path in sorted(layer.glob("threads/*.yaml")):
            self.add_thread(path, layer)

    def add_cause(self, path: Path, layer: Path, data: dict | None) -> None:
        name = self.name(path, layer)
        if data is None:
            self.broken.add(path.stem)
            return
        try:
            cause = Cause.model_validate(data)
        except ValidationError as exc:
            self.problems.extend(_describe(name, exc))
            self.broken.add(_declared_id(data, path))
            return
        if cause.id in self.causes:
            self.problems.append(self.duplicate_cause(name, cause.id, layer))
            return
        if path.stem != cause.id:
            self.problems.append(f"{name}: id: {cause.id!r} does not match the file name")
        self.causes[cause.id] = cause
        self.files[cause.id] = path
        self.sources[cause.id] = layer

    def duplicate_cause(self, name: str, cause_id: str, layer: Path) -> str:
        other = self.files[cause_id]
        where = self.name(other, self.sources[cause_id])
        if self.sources[cause_id] != layer:
            return (
                f"{name}: id: duplicate id {cause_id!r} (also in {where}); to add to it, "
                f"write `extends: {cause_id}` with only the lists to append"
            )
        return f"{name}: id: duplicate id {cause_id!r} (also in {where})"

    def extend_cause(self, path: Path, layer: Path, data: dict) -> None:
        name = self.name(path, layer)
        overrides = [key for key in data if key in Cause.model_fields and key not in EXTENDABLE]
        for key in overrides:
            self.problems.append(
                f"{name}: {key}: an extension cannot override {key!r}; "
                f"it may only add to {', '.join(EXTENDABLE)}"
            )
        rest = {key: value for key, value in data.items() if key not in overrides}
        try:
            extension = CauseExtension.model_validate(rest)
        except ValidationError as exc:
            self.problems.extend(_describe(name, exc))
            return
        target = extension.extends
        if target in self.broken:
            return  # its own file's problem is already reported
        if target in self.causes and self.sources[target] == layer:
            where = self.name(self.files[target], layer)
            self.problems.append(
                f"{name}: extends: {target!r} is defined in this same layer ({where}): "
                "edit that file instead"
            )
            return
        if target not in self.causes:
            self.problems.append(
                f"{name}: extends: unknown cause {target!r} (an extension adds to a cause "
                "of an earlier layer)"
            )
            return
        self.causes[target] = _merged(self.causes[target], extension)
        self.extended_by.setdefault(target, []).append(layer)

    def add_thread(self, path: Path, layer: Path) -> None:
        name = self.name(path, layer)
        data = _read_yaml(path, name, self.problems)
        if data is None:
            return
        try:
            thread = Thread.model_validate(data)
        except ValidationError as exc:
            self.problems.extend(_describe(name, exc))
            return
        if thread.id in self.files:
            self.problems.append(f"{name}: id: duplicate id {thread.id!r}")
            return
        self.threads.append(thread)
        self.thread_names.append(name)
        self.files[thread.id] = path

    def check_threads(self) -> None:
        """Claims are checked once every layer is read: a team thread may claim a team cause."""
        known = set(self.causes) | self.broken
        for name, thread in zip(self.thread_names, self.threads):
            self.problems.extend(_thread_problems(name, thread, known))

    def check_refines(self) -> None:
        """`refines` names causes of any layer, so it is checked once all are read."""
        known = set(self.causes) | self.broken
        for cid, cause in self.causes.items():
            name = self.name(self.files[cid], self.sources[cid])
            for other in cause.refines:
                if other not in known:
                    self.problems.append(f"{name}: refines: unknown cause {other!r}")
                elif other in self.causes and self.causes[other].refines:
                    # One step only: retrieval and the verdicts hand a general cause's
                    # error over once, so a chain's last link would depend on order.
                    self.problems.append(
                        f"{name}: refines: {other!r} refines other causes itself; "
                        "refine the general cause it refines instead"
                    )

    def check_contract(self) -> None:
        known = set(self.causes) | self.broken
        missing = [cid for cid in contract_ids() if cid not in known]
        if missing:
            self.problems.append(
                f"kb/causes: (dir): no file for contract cause(s) {', '.join(missing)}"
            )


def _merged(cause: Cause, extension: CauseExtension) -> Cause:
    """The cause with the extension's list entries appended (duplicates dropped)."""
    update = {}
    for key in EXTENDABLE:
        added = getattr(extension, key)
        if added:
            current = list(getattr(cause, key))
            update[key] = current + [item for item in added if item not in current]
    return cause.model_copy(update=update)


def load_kb(layers: Layers, require_contract: bool = True) -> KnowledgeBase:
    """Parse, validate and merge the KB layers (one folder or several, built-in first).

    Raises KBError with every problem found.
    """
    roots = as_layers(layers)
    missing = [root for root in roots if not root.is_dir()]
    if missing:
        raise KBError([f"{root}: (dir): knowledge base directory not found" for root in missing])
    loader = _LayeredLoader(roots)
    for root in roots:
        loader.load_layer(root)
    loader.check_threads()
    loader.check_refines()
    if require_contract:
        loader.check_contract()
    if loader.problems:
        raise KBError(loader.problems)
    return KnowledgeBase(
        loader.causes,
        loader.threads,
        content_hash(roots),
        loader.files,
        loader.sources,
        loader.extended_by,
    )


def load_valid_kb(layers: Layers, require_contract: bool = True) -> KnowledgeBase:
    """`load_kb` for a command: an invalid KB is a UserError (exit 1) pointing to `kb lint`."""
    try:
        return load_kb(layers, require_contract=require_contract)
    except KBError as exc:
        raise UserError(
            f"knowledge base is invalid ({len(exc.problems)} problem(s), first: "
            f"{exc.problems[0]}); run `assistant kb lint`",
            ExitCode.FAILED,
        ) from None


def _thread_problems(name: str, thread: Thread, known_causes: set[str]) -> list[str]:
    problems = []
    seen: set[str] = set()
    ids = {a.id for a in thread.answers}
    for i, answer in enumerate(thread.answers):
        where = f"{name}: answers.{i}"
        if answer.id in seen:
            problems.append(f"{where}.id: duplicate answer id {answer.id!r}")
        seen.add(answer.id)
        for cid in answer.claims:
            if cid not in known_causes:
                problems.append(f"{where}.claims: unknown cause {cid!r}")
        for other in answer.contradicts:
            if other not in ids or other == answer.id:
                problems.append(f"{where}.contradicts: unknown answer {other!r}")
    return problems
