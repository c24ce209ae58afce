"""Log cleaning: from a pasted torchrun log to the lines that matter.

Strips what varies between runs and ranks (ANSI codes, timestamps, pids,
"[rankN]:" prefixes, torchrun banners), folds per-rank repeats into one copy,
and finds the root error: the first failing rank's own exception, not the
ChildFailedError wrapper that torchrun prints last.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from itertools import islice

from assistant.results import RootError

ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07]*\x07")
# "[rank1]:", "[default0]:" (torchrun --tee), "1: " (srun -l) at line start.
RANK_PREFIX = re.compile(r"^\s*\[(?:rank|default)(\d+)\]:\s?|^(\d{1,3}): (?=\S)")
# "2024-05-01 12:00:00,123", "[2024-05-01T12:00:00.123Z]", glog "E0501 12:00:00.123456 4242 file.cpp:12]"
TIMESTAMP = re.compile(
    r"^\s*\[?\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?Z?\]?\s*(?:[-|]\s*)?"
    r"|^\s*\[?[IWEF]\d{3,4} \d{2}:\d{2}:\d{2}\.\d+(?:\s+\d+)?\s+[\w./-]+:\d+\]\s?"
    # c10d's short form: "[E ProcessGroupNCCL.cpp:475] "
    r"|^\s*\[[IWEF] [\w./-]+:\d+\]\s?"
)
# Numbers that differ between ranks or runs but not in meaning.
PIDS = re.compile(
    r"\b(pid[:=]?\s*|PID\s+|process\s+)\d+|(?<=:)\d{3,}(?=:\d+ \[\d+\])|\b0x[0-9a-f]{6,}\b",
    re.IGNORECASE,
)
BANNER = re.compile(
    r"^\*{5,}$"
    r"|Setting OMP_NUM_THREADS environment variable"
    r"|Please further tune the variable for optimal performance"
    r"|^WARNING:torch\.distributed\.run:"
    r"|^\s*warnings\.warn\("
    r"|^\s*$"
)
EXCEPTION_LINE = re.compile(
    r"^(?P<type>(?:[A-Za-z_]\w*\.)*(?:[A-Z]\w*(?:Error|Exception|Interrupt|Exit)|Exception))"
    r"(?::\s?(?P<message>.*))?$"
)
# A C++ exception that killed a rank (SIGABRT, exitcode -6): no Python traceback,
# and no rank prefix either, as it bypasses Python's stderr.
TERMINATE = re.compile(r"terminate called after throwing an instance of '(?P<type>[^']+)'")
WHAT = re.compile(r"^\s*what\(\):\s*(?P<message>.*)$")
ARGPARSE_ERROR = re.compile(r"^(?P<prog>[\w.\-/]+): error: (?P<message>.+)$")
# The start of another record that can follow an exception line unprefixed
# (another rank's output): a Python warning "path.py:12: UserWarning: ...",
# or any "file:line:" location.
NEW_RECORD = re.compile(r"^\S+\.pyx?:\d+: |^\S*\wWarning: |^\S+:\d+:\d*:? ")
# Launchers' own exceptions that wrap a rank's: torchrun's, and mp.spawn's
# ("-- Process 0 terminated with the following error:" then the rank's traceback).
WRAPPERS = {"ChildFailedError", "SignalException", "ProcessRaisedException"}
SPAWN_PROCESS = re.compile(r"-- Process (\d+) terminated with the following error")
ROOT_CAUSE_RANK = re.compile(r"Root Cause \(first observed failure\):")
SUMMARY_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")
# Other ways launchers and people give a rank's exit status when nothing else
# is known: DeepSpeed's "exits with return code = -9", "exit code 137", and in
# Chinese "返回值是-9", "错误码 -9", "退出码：-9". No \b: in "退出return code" the
# Chinese character before "return" is a word character to `re`.
EXIT_STATUS = re.compile(
    r"exits? with return(?: code)?\s*=?\s*(-?\d+)"
    r"|(?<![a-z])(?:exit|return)(?:ed)? (?:code|status)\s*[:=]?\s*(-?\d+)"
    r"|(?:返回|退出|错误)(?:值|码|代码|错误码)\s*(?:是|为|:|：)?\s*(-?\d+)",
    re.IGNORECASE,
)
# Signals that end a rank without a word, by number: the exit status is minus the
# number (Python's subprocess), or 128 plus it (a shell).
SIGNAL_NAMES = {6: "SIGABRT", 7: "SIGBUS", 9: "SIGKILL", 11: "SIGSEGV", 15: "SIGTERM"}
SIGNAL_LINE = re.compile(r"Signal (\d+) \((SIG\w+)\) received by PID")
SALIENT = re.compile(
    r"error|exception|fail|timed? ?out|warn|nccl|gloo|cuda|hang|killed|signal|refused|unable|"
    r"cannot|can't|could not|invalid|mismatch|duplicate|expected|not (?:set|found|initialized)|"
    r"address|port|exitcode|segmentation|bus error|[\u3400-\u9fff]",
    re.IGNORECASE,
)
# Lines that carry no meaning for retrieval: source lines of a traceback,
# torchrun's failure-summary fields, separators.
FOCUS_NOISE = re.compile(
    r"^(?:raise |return |Sending process|error_file|time\s*:|host\s*:|traceback\s*:"
    r"|rank\s*:\s*\d+\s*\(local_rank|exitcode\s*:\s*-?\d+\s*\(pid"
    r"|Failures:|Root Cause|\[\d+\]:$|[=\-^~ ]+$|.*ChildFailedError|.* FAILED$)"
)
# torch's suffix on every NCCL error ("unhandled cuda error, NCCL version 2.7.8"):
# the library's version, printed whatever failed, read by the word signals as a
# version problem. NCCL's own INFO line ("NCCL INFO NCCL version 2.18.1") stays:
# versions that differ across nodes are evidence.
NCCL_ERROR_VERSION = re.compile(r",\s*NCCL version \d+(?:\.\d+)*\S*")
MAX_FOCUS_LINES = 24
OPENING_LINES = 12  # of a report without a root error, always searched with
# The scaffolding of an issue template and the environment block a report
# pastes: it says nothing about the failure, yet it filled the opening lines of
# a templated report ("### System Info", "- `transformers` version: 4.37.2",
# "- [X] I have searched the existing issues", "### 运行环境 | Environment"),
# where the title and what the person saw belong.
TEMPLATE_LINE = re.compile(
    r"^(?:#{1,6}[^\w\n]{0,8}(?:bug|describe|description|reproduc|to reproduce|steps|environment|system info|"
    r"expected|current behavio|who can help|information|tasks?\b|checklist|questions?\b|"
    r"reminder|prerequisite|additional|anything else|error messages|logs?\b|versions?\b|"
    r"what version|is there an existing|motivation|运行环境|当前行为|期望行为|复现|问题类型|操作系统|"
    r"详细描述|是否已有|该问题是否|备注|其他信息|环境)[^\n]{0,60}"
    r"|[-*]\s*\[[ xX]\]\s.*"
    r"|[-*]?[ \t]*+(?:[\w./()`-]++[ \t]++){1,5}version\b[^:\n]{0,20}:.*"
    r"|(?:Platform|OS|GPU models and configuration|Nvidia driver version|cuDNN version|"
    r"CUDA used to build PyTorch|Is CUDA available|Python platform)\s*:.*"
    r"|\[(?:pip3?|conda)\]\s.*"
    r"|@[\w-]+(?:\s+@[\w-]+)*)$",
    re.IGNORECASE,
)


@dataclass
class CleanLog:
    """A cleaned log: deduplicated lines, the root error and the lines to search with."""

    lines: list[str]
    root_error: RootError | None
    focus: str  # root error plus salient lines: what retrieval searches with
    ranks: list[int] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def strip_line(raw: str) -> tuple[int | None, str]:
    """One raw line -> (rank from its prefix or None, the line without noise)."""
    rank, line, _ = _strip(raw)
    return rank, line


def _strip(raw: str) -> tuple[int | None, str, bool]:
    """(rank, line, whether a logger timestamp was removed)."""
    line = ANSI.sub("", raw).rstrip()
    rank = None
    logged = False
    for _ in range(2):  # a timestamp may precede or follow the rank prefix
        line, removed = TIMESTAMP.subn("", line)
        logged = logged or bool(removed)
        match = RANK_PREFIX.match(line)
        if match:
            rank = int(match.group(1) or match.group(2))
            line = line[match.end() :]
    return rank, line, logged


def _dedup_key(line: str) -> str:
    """Lines equal up to pids and rank numbers are one line."""
    key = PIDS.sub(lambda m: (m.group(1) or "") + "#", line)
    return re.sub(r"\b(rank|local_rank|Rank)\s*[:=]?\s*\d+", r"\1 #", key).strip()


def _split(text: str) -> tuple[list[tuple[int | None, str]], set[int]]:
    """Cleaned (rank, line) entries, and the positions of logger lines.

    Logger lines (torchrun's own "W1129 12:00:00 ... api.py:1028]" output)
    never continue an exception message.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    out = []
    logged_at = set()
    for raw in text.split("\n"):
        rank, line, logged = _strip(raw)
        if line and not BANNER.search(line):
            if logged:
                logged_at.add(len(out))
            out.append((rank, line))
    return out, logged_at


def _find_exceptions(
    entries: list[tuple[int | None, str]], logged_at: set[int] = frozenset()
) -> list[tuple[int, int | None, RootError]]:
    """Every exception-looking line: (position, rank, error)."""
    found = []
    for pos, (rank, line) in enumerate(entries):
        stripped = line.strip()
        match = EXCEPTION_LINE.match(stripped)
        if match and not stripped.startswith(("File ", "raise ")):
            message = (match.group("message") or "").strip()
            message = _continue_message(entries, pos, rank, message, logged_at)
            found.append((pos, rank, RootError(match.group("type"), message, rank)))
            continue
        match = TERMINATE.search(stripped)
        if match:
            found.append((pos, rank, _terminate_error(entries, pos, match, rank)))
            continue
        match = ARGPARSE_ERROR.match(stripped)
        if match:
            found.append((pos, rank, RootError("argparse error", match.group("message"), rank)))
    return found


def _terminate_error(entries, pos: int, match: re.Match, rank: int | None) -> RootError:
    """`terminate called ... 'gloo::EnforceNotMet'` and its `what():` line."""
    rest = entries[pos][1][match.end() :]
    following = [rest] + [line for _, line in entries[pos + 1 : pos + 3]]
    for line in following:
        what = WHAT.match(line)
        if what:
            return RootError(match.group("type"), what.group("message").strip()[:2000], rank)
    return RootError(match.group("type"), "", rank)


def _continue_message(entries, pos: int, rank: int | None, message: str, logged_at) -> str:
    """Exception messages that span lines (DDP's reduction error does) keep them."""
    parts = [message] if message else []
    for offset, (next_rank, line) in enumerate(entries[pos + 1 : pos + 6], start=pos + 1):
        if offset in logged_at or line[:1].isspace():  # logger output or traceback source
            break
        if (
            next_rank != rank
            or EXCEPTION_LINE.match(line.strip())
            or NEW_RECORD.match(line)
            or line.startswith(
                ("Traceback", "  File", "During handling", "The above exception", "[")
            )
        ):
            break
        parts.append(line.strip())
    return " ".join(parts)[:2000]


def _summary_rank(entries: list[tuple[int | None, str]]) -> int | None:
    """The rank torchrun names under "Root Cause (first observed failure)"."""
    for pos, (_, line) in enumerate(entries):
        if ROOT_CAUSE_RANK.search(line):
            for _, after in entries[pos + 1 : pos + 8]:
                match = SUMMARY_RANK.match(after)
                if match:
                    return int(match.group(1))
    return None


def _exit_signal_error(entries: list[tuple[int | None, str]], rank: int | None) -> RootError | None:
    """When a rank died without a traceback, its exit code is the root error.

    The "Root Cause" section is read first: siblings that torchrun itself
    stopped with SIGTERM are listed above it under "Failures".
    """
    start = next((i for i, (_, line) in enumerate(entries) if ROOT_CAUSE_RANK.search(line)), None)
    if start is not None:
        found = _signal_error(entries[start:], rank)
        if found is not None:
            return found
    return _signal_error(entries, rank)


def _signal_error(entries: list[tuple[int | None, str]], rank: int | None) -> RootError | None:
    for _, line in entries:
        match = SIGNAL_LINE.search(line)
        if match:
            return RootError(match.group(2), f"exitcode: -{match.group(1)} ({line.strip()})", rank)
    for _, line in entries:
        match = EXITCODE.search(line)
        if match:
            # torchrun's own line is already in its words: no need to quote it.
            found = _exit_status_error(int(match.group(1)), rank)
            if found is not None:
                return found
    for _, line in entries:
        match = EXIT_STATUS.search(line)
        if match:
            code = int(next(g for g in match.groups() if g))
            found = _exit_status_error(code, rank, quoted=line)
            if found is not None:
                return found
    return None


def _exit_status_error(code: int, rank: int | None, quoted: str = "") -> RootError | None:
    """A rank's exit status as torchrun writes it ("exitcode: -9"), named by its signal.

    One wording, whatever launcher or person gave it, so that one KB signature
    matches them all; the original line is quoted after it. 0 and 1 say
    nothing about the cause.
    """
    if code - 128 in SIGNAL_NAMES:  # a shell reports SIGKILL as 137 = 128 + 9
        code = 128 - code
    if code in (0, 1):
        return None
    name = SIGNAL_NAMES.get(-code, "ChildFailedError")
    message = f"exitcode: {code} ({quoted.strip()[:200]})" if quoted else f"exitcode: {code}"
    return RootError(name, message, rank)


def find_root_error(
    entries: list[tuple[int | None, str]], logged_at: set[int] = frozenset()
) -> RootError | None:
    """The first failing rank's own exception (not the launcher's wrapper)."""
    exceptions = [
        e for e in _find_exceptions(entries, logged_at) if e[2].type.split(".")[-1] not in WRAPPERS
    ]
    summary_rank = _summary_rank(entries)
    if summary_rank is not None:
        own = [e for e in exceptions if e[1] == summary_rank]
        if own:
            return _with_rank(own[-1][2], summary_rank)
        # The first failing rank aborted in C++: its unprefixed terminate message.
        aborted = [e for e in exceptions if e[1] is None and TERMINATE.search(entries[e[0]][1])]
        if aborted:
            return _with_rank(aborted[0][2], summary_rank)
    if exceptions:
        pos, rank, error = exceptions[0]
        if rank is None:
            rank = summary_rank if summary_rank is not None else _spawn_process(entries, pos)
        return _with_rank(error, rank)
    return _exit_signal_error(entries, summary_rank)


def _spawn_process(entries: list[tuple[int | None, str]], pos: int) -> int | None:
    """The mp.spawn process index announced above an exception, if any."""
    for _, line in reversed(entries[:pos]):
        match = SPAWN_PROCESS.search(line)
        if match:
            return int(match.group(1))
    return None


def _with_rank(error: RootError, rank: int | None) -> RootError:
    return RootError(error.type, error.message, rank)


def _fold_ranks(entries: list[tuple[int | None, str]]) -> list[str]:
    """Keep the first copy of each line across ranks, in order of appearance."""
    seen: set[str] = set()
    lines = []
    for _, line in entries:
        key = _dedup_key(line)
        if key not in seen:
            seen.add(key)
            lines.append(line)
    return lines


def _focus(lines: list[str], root: RootError | None) -> str:
    """Root error first, then the salient lines (deduplicated, capped)."""
    picked: list[str] = []
    if root is not None:
        picked.append(f"{root.type}: {root.message}".strip())
    for line in lines:
        if len(picked) >= MAX_FOCUS_LINES:
            break
        stripped = line.strip()
        if stripped.startswith(('File "', "Traceback")) or stripped in picked:
            continue
        if FOCUS_NOISE.match(stripped):
            continue
        if SALIENT.search(stripped):
            picked.append(stripped[:500])
    if len(picked) <= 1 and len(lines) <= MAX_FOCUS_LINES:
        # A short question: everything it says is the focus, but a template's.
        picked = [line.strip() for line in lines if not TEMPLATE_LINE.match(line.strip()[:500])]
    if root is None:
        # No root error: a report in prose. Its opening lines (the title, what
        # was run and what was seen) carry the meaning without an error word
        # ("GPU 0 holds more memory", "with jupyter notebook"); the salient
        # lines of the rest follow. Over the 664 real reports and 149 queries
        # this put the right cause first 20 times more and 8 times less.
        # Lazily: a long log's remaining lines are never tested.
        opening = (line for line in (raw.strip()[:500] for raw in lines) if _prose(line))
        head = list(islice(opening, OPENING_LINES))
        picked = (head + [line for line in picked if line not in head])[:MAX_FOCUS_LINES]
    return NCCL_ERROR_VERSION.sub("", "\n".join(picked))


def _prose(line: str) -> bool:
    """A line a person wrote or a log printed, not a traceback frame or a separator."""
    return (
        bool(line)
        and not line.startswith(('File "', "Traceback"))
        and not FOCUS_NOISE.match(line)
        and not TEMPLATE_LINE.match(line)
    )


def clean_log(text: str) -> CleanLog:
    """Clean a pasted error, question or multi-rank log."""
    entries, logged_at = _split(text)
    root = find_root_error(entries, logged_at)
    lines = _fold_ranks(entries)
    ranks = sorted({rank for rank, _ in entries if rank is not None})
    return CleanLog(lines=lines, root_error=root, focus=_focus(lines, root), ranks=ranks)
