"""What a report says about itself that some causes' premises contradict.

Some causes never fail a job: it runs, but slowly, with worse numbers, or on
one GPU (the KB marks them `fails: false`). A report of an error or a hang
is not answered first with one of them, however much its words look alike
("errors when training with 2 GPUs" is not a learning-rate question).

Other causes only ever fail with an error (an exception, a refused launch;
the KB marks them `hangs: false`). A report of a hang and nothing else (hang
words, no error words, no root error in its log) is not answered first with
one of them: "4 GPUs stop at batch 141" is no BatchNorm error.

A cause whose job was started without a distributed launcher (`no_launcher:
true`) is contradicted by a report whose launch uses one (torchrun,
torch.distributed.launch, accelerate launch, deepspeed, dist_train.sh) and
that shows no plain `python script.py` anywhere.

Some causes live in one process that drives several GPUs (nn.DataParallel's
gather on GPU 0; `one_process: true`). A report of DDP, torchrun or ranks is
not answered first with one of them: "GPU 0 holds more memory" there is a
rank placing its tensors on the wrong GPU.
"""

from __future__ import annotations

import re
from functools import lru_cache

# Word edges that only Latin letters and digits close: Python's \b also counts
# a Chinese character as a word character, so "\bhang\b" missed "hang住",
# "OOM了" and "DDP训练", which people who mix the two languages write.
START = r"(?<![A-Za-z0-9_])"
END = r"(?![A-Za-z0-9_])"

# A stop without an error: what people write when a job hangs.
HANG_WORDS = re.compile(
    START + r"(?:hang|hangs|hanging|hung|stuck|freez\w*|froze|frozen|deadlock\w*|"
    r"waits? forever|no (?:output|progress)|nothing happens|does not (?:start|progress))"
    + END
    # 卡 is also a card: "一张卡在跑" (one card is running) is no hang
    + r"|卡住|卡死|(?<![张块号个])卡[在着]|不动|没反应|无响应|没有反应|停住|一直等|挂起|假死",
    re.IGNORECASE,
)
# An error, a crash, a kill. "fails to converge" and "error rate" are numbers, not failures.
ERROR_WORDS = re.compile(
    START + r"(?:errors?(?!\s*rate)|exceptions?|traceback|crash\w*|killed|segfault\w*|aborted|"
    r"fail(?:s|ed|ing|ure)?(?!\s+to\s+(?:converge|decrease|improve|learn|reach|match|speed))|"
    r"timed out|time ?out|oom)" + END + r"|报错|错误|异常|失败|崩溃|出错|超时|挂掉|挂了|中断",
    re.IGNORECASE,
)
# "no error", "without any exception", "没有报错": a job that runs, said outright.
NEGATED = re.compile(
    START + r"(?:no|without(?: any)?|not any|never (?:an?|any))\s+(?:an?\s+)?"
    r"(?:errors?|exceptions?|crash\w*|warnings? or errors?)"
    + END
    + r"|(?:没有?|并没有|也没有?|不会|不|无|未)(?:任何)?(?:报错|错误|异常|出错)",
    re.IGNORECASE,
)
# Distributed launchers: each starts the ranks and sets RANK, LOCAL_RANK, WORLD_SIZE.
LAUNCHER = re.compile(
    r"\btorchrun\b|torch\.distributed\.(?:launch|run)\b|accelerate\s+launch\b|"
    r"(?m:^\s*deepspeed\s)|\bdist_train\.sh\b",  # mmdetection's and its kin's wrapper
    re.IGNORECASE,
)
# `python train.py`, `python3 -u tools/train.py`, `...\python.exe" s1_train.py`: not `python -m ...`.
PLAIN_PYTHON_LAUNCH = re.compile(
    r"(?<![-\w/])python[\d.]*(?:\.exe)?\"?\s+(?!-m\s)(?:-\S+\s+)*[\w./\\:-]+\.py\b",
    re.IGNORECASE,
)
MAX_CHARS = 20_000  # the words that matter are at the top of a report
# Several processes: DDP and its launchers, ranks, "other processes on GPU 0".
SEVERAL_PROCESSES = re.compile(
    r"DistributedDataParallel|torchrun|torch\.distributed|accelerate launch|deepspeed|进程|分布式|"
    + START
    + r"(?:DDP|ranks?|processes)"
    + END,
    re.IGNORECASE,
)
# nn.DataParallel itself (not DistributedDataParallel): one process, so no contradiction.
DATA_PARALLEL = re.compile(r"(?<!Distributed)DataParallel|数据并行")


def reports_failure(text: str, has_root_error: bool) -> bool:
    """The report shows an error (a root error in its log, or in words) or a hang."""
    if has_root_error:
        return True
    said = affirmed(text)
    return bool(ERROR_WORDS.search(said) or HANG_WORDS.search(said))


def reports_hang_only(text: str, has_root_error: bool) -> bool:
    """The report shows a hang and no error: hang words, and neither error
    words nor a root error in its log."""
    if has_root_error:
        return False
    said = affirmed(text)
    return bool(HANG_WORDS.search(said)) and not ERROR_WORDS.search(said)


@lru_cache(maxsize=8)
def affirmed(text: str) -> str:
    """The head of a report with what it denies ("no error", "没有报错") blanked out.

    Kept for the last few reports: reports_failure and reports_hang_only read
    the same report in one ranking, and the substitution over a long log is
    the costly part of both."""
    return NEGATED.sub(" ", text[:MAX_CHARS])


def reports_launcher_only(text: str) -> bool:
    """The report launches with a distributed launcher and never with a plain `python x.py`."""
    head = text[:MAX_CHARS]
    return bool(LAUNCHER.search(head)) and not PLAIN_PYTHON_LAUNCH.search(head)


def reports_several_processes(text: str) -> bool:
    """The report runs one process per GPU (DDP, a launcher, ranks) and never names DataParallel."""
    head = text[:MAX_CHARS]
    return bool(SEVERAL_PROCESSES.search(head)) and not DATA_PARALLEL.search(head)
