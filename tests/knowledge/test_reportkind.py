"""A report of an error or a hang is not answered first with a cause that never fails a job,
nor a report of a hang alone with a cause that only ever fails with an error, nor a
report launched with torchrun with a launch without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from assistant.knowledge.reportkind import (
    reports_failure,
    reports_hang_only,
    reports_launcher_only,
    reports_several_processes,
)
from assistant.knowledge.retrieve import lowered

KB_CAUSES = Path(__file__).parents[2] / "kb" / "causes"


def kb_causes_where(field: str, value: bool) -> set[str]:
    """The causes whose KB entry sets `field` to `value`."""
    return {
        path.stem
        for path in KB_CAUSES.glob("*.yaml")
        if yaml.safe_load(path.read_text(encoding="utf-8")).get(field) is value
    }


@pytest.mark.parametrize(
    "text",
    [
        "Errors will be reported when training with 2 GPUs",
        "DDP training hangs when computing prototypes",
        "multi-gpu job crashed after the first epoch",
        "fail to run train.py on one node with several GPUs",
        "多卡训练报错，单卡正常",
        "两张卡训练卡住不动",
        "训练到一半进程被 killed",
        # English words next to Chinese ones, as people mix them
        "deepspeed 初始化的时候 hang住了",
        "两张卡训练一会就OOM了",
    ],
)
def test_errors_and_hangs_are_failures(text: str) -> None:
    assert reports_failure(text, has_root_error=False)


@pytest.mark.parametrize(
    "text",
    [
        "DDP on 4 GPUs is slower than one GPU, no error at all",
        "The loss fails to converge with 8 GPUs although the learning rate is the same",
        "Validation accuracy differs on each GPU; the error rate is higher than on one card",
        "训练没有报错，但是只有一张卡在跑",
        "多卡训练不报错，就是精度比单卡低",
        "Training runs without any errors but the epoch takes as long as on one GPU",
    ],
)
def test_a_job_that_runs_is_not_a_failure(text: str) -> None:
    assert not reports_failure(text, has_root_error=False)


def test_a_root_error_is_a_failure_whatever_the_words() -> None:
    assert reports_failure("training runs without any errors", has_root_error=True)


def test_lowering_makes_every_score_smaller() -> None:
    for score in (2.0, 0.3, 0.0, -0.4):
        assert lowered(score) <= score
    assert lowered(2.0) > lowered(1.0)  # the order among silent causes stays


def test_the_kb_marks_only_causes_that_never_fail_a_job() -> None:
    silent = kb_causes_where("fails", False)
    assert {"effective-batch-size-changed", "input-pipeline-bottleneck"} <= silent
    # Causes that print an error or hang are never silent.
    assert not silent & {"collective-timeout", "cuda-out-of-memory", "hardcoded-device"}


@pytest.mark.parametrize(
    ("text", "hang_only"),
    [
        ("4 GPUs hang at batch 141, each rank at a different batch", True),
        ("training is stuck after the first epoch, there is no error at all", True),
        ("4个GPU在batch 141卡住，不同rank卡在不同batch", True),
        ("两张卡训练卡住不动，也没有报错", True),
        ("training hangs, then NCCL reports a timeout error after 30 minutes", False),
        ("多卡训练卡住，然后报错退出", False),
        ("RuntimeError: Expected more than 1 value per channel when training", False),
        ("the loss is lower with 8 GPUs", False),  # no hang said at all
    ],
)
def test_a_hang_alone_is_hang_words_without_error_words(text: str, hang_only: bool) -> None:
    assert reports_hang_only(text, has_root_error=False) is hang_only


def test_a_root_error_is_never_a_hang_alone() -> None:
    assert not reports_hang_only("training hangs", has_root_error=True)


def test_the_kb_marks_as_error_only_no_cause_that_can_stop_silently() -> None:
    error_only = kb_causes_where("hangs", False)
    assert {
        "batch-too-small-per-gpu",
        "state-dict-module-prefix",
        "launcher-not-found",
    } <= error_only
    # Causes people report as a hang (a wait in a collective, a lock, a logger,
    # fp16 overflow skipping every step) are never marked error-only.
    assert not error_only & {
        "collective-mismatch",
        "uneven-inputs",
        "unused-parameters",
        "extension-build-lock",
        "experiment-logger-ddp",
        "mixed-precision-dtype",
        "launched-without-torchrun",
        "hardcoded-device",
    }
    # A cause that never fails a job cannot be one that only fails with an error.
    assert not error_only & kb_causes_where("fails", False)


@pytest.mark.parametrize(
    ("text", "launcher_only"),
    [
        ("torchrun --nproc_per_node 2 train.py hangs at init", True),
        ("python -m torch.distributed.launch --nproc_per_node=7 --use_env run_train.py", True),
        ("accelerate launch src/train_sft.py --do_train", True),
        ("deepspeed --num_gpus 4 train.py --deepspeed ds.json", True),
        ("./tools/dist_train.sh configs/db_r18.py work_dir 2", True),
        ("python train.py --gpus 0,1", False),  # a plain launch
        ("python3 -u tools/train.py -d 4", False),
        # both: the plain launch may be the one that failed
        ("torchrun works, but python train.py fails with KeyError: 'RANK'", False),
        ('D:\\AI\\runtime\\python.exe" s1_train.py, then torchrun', False),
        ("python train.py --deepspeed ds_config.json", False),  # deepspeed as a flag
        ("训练卡住了，没有启动命令", False),
    ],
)
def test_a_launcher_only_report_launches_with_one_and_never_with_plain_python(
    text: str, launcher_only: bool
) -> None:
    assert reports_launcher_only(text) is launcher_only


@pytest.mark.timeout(10)  # milliseconds each; a backtracking pattern would take hours
def test_a_hostile_command_line_is_read_without_backtracking() -> None:
    """Long flag lists after `python` must not make the plain-launch pattern backtrack."""
    assert not reports_launcher_only("python " + "-a " * 7000)
    assert reports_launcher_only("torchrun x " + 'python -x "' * 2000)


def test_only_the_plain_launch_cause_has_no_launcher() -> None:
    assert kb_causes_where("no_launcher", True) == {"launched-without-torchrun"}


@pytest.mark.parametrize(
    ("text", "several"),
    [
        ("With DDP on 4 GPUs the first GPU holds much more memory than the others", True),
        ("torchrun --nproc_per_node 4 train.py: GPU 0 runs out of memory", True),
        ("多卡分布式训练，其他进程也占用第一张卡的显存", True),
        ("nn.DataParallel: GPU 0 holds much more memory than the others", False),
        ("DataParallel with DDP-like speed? GPU 0 is full", False),  # names DataParallel
        ("GPU 0 holds much more memory than the other GPUs", False),  # says neither
        ("DDP训练时0号卡显存比其他卡多", True),  # DDP next to Chinese characters
        ("四个ranks里只有一个报错", True),
        ("ADDP2 model on 2 GPUs", False),  # DDP inside another word is not DDP
    ],
)
def test_several_processes_are_ddp_launchers_and_ranks(text: str, several: bool) -> None:
    assert reports_several_processes(text) is several


def test_only_the_dataparallel_causes_are_one_process_causes() -> None:
    """nn.DataParallel's gather on GPU 0 and a model its replicas break: nothing else."""
    one_process = kb_causes_where("one_process", True)
    assert one_process == {"dataparallel-gather-imbalance", "dataparallel-unsafe-model"}


# Each premise, a report that contradicts it and one that fits it: (KB field,
# its value, the contradicting report, the fitting report, the fitting report's
# first cause, or None where any cause of the premise may come first). Each
# contradicting report is one whose words alone put a cause of the premise
# first (checked by switching the rule off), so each case tests its rule.
PREMISES = {
    "a silent cause after an error": (
        "fails",
        False,
        "DDP training on 4 GPUs fails with an error while one GPU trains, the DataLoader has no DistributedSampler",
        "Training with 2 GPUs instead of one gives lower accuracy with the same batch size",
        None,
    ),
    "an error-only cause after a hang alone": (
        "hangs",
        False,
        "With 4 GPUs and batch size 1 per GPU, training is stuck at a different batch on each rank",
        "With 4 GPUs and batch size 1 per GPU: Expected more than 1 value per channel when training",
        "batch-too-small-per-gpu",
    ),
    "a launch without torchrun after a torchrun launch": (
        "no_launcher",
        True,
        "torchrun --nproc_per_node=4 train.py hangs in init_process_group, the env variables look missing",
        "python train.py: the ranks never start training, RANK and WORLD_SIZE are not set",
        "launched-without-torchrun",
    ),
    "DataParallel after a DDP report": (
        "one_process",
        True,
        "With DDP the outputs and loss gathered on GPU 0 make it run out of memory",
        "With nn.DataParallel, GPU 0 holds far more memory than the other GPUs and runs out",
        "dataparallel-gather-imbalance",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("premise", sorted(PREMISES))
def test_a_report_that_contradicts_a_premise_does_not_lead_with_its_causes(engine, premise) -> None:
    field, value, contradicting, fitting, first = PREMISES[premise]
    causes = engine._retriever.causes_where(field, value)
    assert engine.rank_ids(contradicting)[0] not in causes
    fitting_first = engine.rank_ids(fitting)[0]
    assert fitting_first in causes if first is None else fitting_first == first


@pytest.mark.slow
def test_a_signature_outweighs_the_launcher_named(engine) -> None:
    """A signature is evidence of its own: torchrun named beside it does not lower it."""
    log = "torchrun train.py\nKeyError: 'LOCAL_RANK'"
    assert engine.rank_ids(log)[0] == "launched-without-torchrun"


NAMED_BY = {
    # a tool-bound cause and the words of reports that name its tool
    "fsdp-state-dict": "FSDP state_dict() on rank 0 only hangs when saving the checkpoint",
    "torch-compile-ddp": "torch.compile with DDP fails in backward",
    "slurm-without-torchrun": "srun python train.py: every task thinks it is rank 0",
    "windows-libuv": "on Windows 11 torchrun fails with use_libuv",
    # a tool's other names count as naming it
    "experiment-logger-ddp": "tracking DDP training with Weights & Biases hangs at the end",
    "syncbn-without-process-group": "单卡训练时用了同步BN就报错",
}


@pytest.mark.slow
@pytest.mark.parametrize("cause", sorted(NAMED_BY))
def test_a_tool_bound_cause_needs_its_tool_named(engine, cause) -> None:
    """Named, its words count in full; never named, they are lowered like a contradicted premise."""
    from assistant.clean import clean_log

    retriever = engine._retriever
    assert cause in retriever.named_by
    assert cause not in retriever.causes_not_named(clean_log(NAMED_BY[cause]))
    assert cause in retriever.causes_not_named(
        clean_log("the job fails when saving the checkpoint")
    )


@pytest.mark.slow
def test_without_re2_no_tool_counts_as_unnamed(engine, monkeypatch) -> None:
    """Without the linear engine no pattern matches: that is no evidence a tool went unnamed."""
    from assistant.clean import clean_log
    from assistant.knowledge import retrieve

    plain = clean_log("the job fails when saving the checkpoint")
    assert engine._retriever.causes_not_named(plain)
    monkeypatch.setattr(retrieve, "LINEAR_ENGINE", False)
    assert engine._retriever.causes_not_named(plain) == set()


@pytest.mark.slow
def test_a_plain_ddp_save_question_is_not_answered_with_fsdp(engine) -> None:
    ddp = "With DDP the checkpoint saved on rank 0 is incomplete and loading it fails"
    fsdp = "With FSDP the checkpoint saved on rank 0 is incomplete and loading it fails"
    assert "fsdp-state-dict" not in engine.rank_ids(ddp)[:1]
    assert engine.rank_ids(fsdp)[0] == "fsdp-state-dict"
