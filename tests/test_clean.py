"""Log cleaning and root-error finding on real torchrun output."""

from __future__ import annotations

from pathlib import Path

import pytest

from assistant.clean import clean_log, strip_line

LOGS = Path(__file__).parent / "data" / "logs"


def test_strip_line_removes_noise_prefixes():
    assert strip_line("\x1b[31m[rank1]: RuntimeError: boom\x1b[0m") == (1, "RuntimeError: boom")
    assert strip_line("W1129 22:30:54.705000 4481 torch/distributed/run.py:874] hello") == (
        None,
        "hello",
    )
    assert strip_line("2024-05-01 12:00:00,123 [default3]:ValueError: x") == (3, "ValueError: x")


def test_root_error_is_first_failing_rank_not_wrapper():
    clean = clean_log((LOGS / "value_error_rank1_then_peer_closed.txt").read_text())
    assert clean.root_error.type == "ValueError"
    assert clean.root_error.message == "boom on rank one"
    assert clean.root_error.rank == 1
    assert clean.ranks == [0, 1]
    assert "ChildFailedError" not in clean.focus
    assert clean.focus.startswith("ValueError: boom on rank one")


def test_per_rank_repeats_fold_into_one_copy():
    log = "\n".join(
        f"[rank{r}]: RuntimeError: Default process group has not been initialized, please make sure to call init_process_group."
        for r in range(8)
    )
    clean = clean_log(log)
    assert len(clean.lines) == 1
    assert clean.root_error.rank == 0


def test_sigkill_without_traceback_becomes_root_error():
    log = """
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2024-05-01_12:00:00
  host      : node1
  rank      : 3 (local_rank: 3)
  exitcode  : -9 (pid: 4242)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4242
"""
    root = clean_log(log).root_error
    assert root.type == "SIGKILL"
    assert root.rank == 3
    assert "exitcode: -9" in root.message


def test_torchruns_summary_fields_are_not_searched():
    """Every torchrun failure prints them: "local_rank" and "exitcode" there say nothing
    of the cause, yet searched they pulled local-rank and killed-rank causes forward."""
    log = """The 'No space left on device' error occurred during a TorchTitan run.
It fails at the first broadcast, on every node:
Root Cause (first observed failure):
[0]:
  time      : 2026-01-13_09:20:58
  host      : node-0
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 1016)
  error_file: /tmp/torchelastic_x/attempt_0/0/error.json
  traceback : Traceback (most recent call last):
    torch.distributed.broadcast(seed_tensor, src=0)
"""
    focus = clean_log(log).focus
    assert "No space left on device" in focus and "first broadcast" in focus
    assert "local_rank" not in focus and "exitcode" not in focus and "Traceback" not in focus


def test_argparse_error_is_a_root_error():
    log = "[rank0]: usage: train.py [-h] [--local_rank LOCAL_RANK]\n[rank0]: train.py: error: unrecognized arguments: --local-rank=0"
    root = clean_log(log).root_error
    assert root.type == "argparse error"
    assert root.message == "unrecognized arguments: --local-rank=0"


def test_multiline_message_is_kept():
    log = (
        "RuntimeError: Expected to have finished reduction in the prior iteration before starting a new one.\n"
        "This error indicates that your module has parameters that were not used in producing loss.\n"
    )
    root = clean_log(log).root_error
    assert "parameters that were not used" in root.message


def test_chinese_question_is_its_own_focus():
    clean = clean_log("用PyTorch做多卡训练，DDP一直报错找不到设备，求指点")
    assert clean.root_error is None
    assert clean.focus == "用PyTorch做多卡训练，DDP一直报错找不到设备，求指点"


def test_ten_megabyte_log_keeps_the_right_root_error():
    noise = "[rank0]: step 1234 loss 0.5432 lr 0.001 throughput 1234.5 samples/s\n" * 150_000
    log = noise + (LOGS / "value_error_rank1_then_peer_closed.txt").read_text()
    assert len(log) > 10_000_000
    clean = clean_log(log)
    assert clean.root_error.type == "ValueError"


def test_root_cause_section_wins_over_sibling_sigterm():
    """torchrun lists the SIGTERM'd sibling under Failures, the killed rank under Root Cause."""
    root = clean_log((LOGS / "sigkill_rank1_sibling_sigterm.txt").read_text()).root_error
    assert (root.type, root.rank) == ("SIGKILL", 1)
    assert "exitcode: -9" in root.message


def test_launcher_log_lines_never_continue_a_message():
    root = clean_log((LOGS / "cuda_on_cpu_build.txt").read_text()).root_error
    assert root.message == "Torch not compiled with CUDA enabled"


def test_interleaved_unprefixed_tracebacks_keep_a_clean_message():
    root = clean_log((LOGS / "sampler_before_init_two_ranks_unprefixed.txt").read_text()).root_error
    assert root.type == "ValueError"
    assert root.message == (
        "Default process group has not been initialized, please make sure to call init_process_group."
    )


def test_c10d_log_prefixes_of_every_torch_version_are_stripped():
    lines = [
        "[rank1]:[E626 06:24:44.903881913 ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation timeout",
        "[E ProcessGroupNCCL.cpp:475] [Rank 1] Watchdog caught collective operation timeout",
        "E0501 12:00:00.123456 4242 torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation timeout",
    ]
    for line in lines:
        assert strip_line(line)[1] == "[Rank 1] Watchdog caught collective operation timeout"
    assert len(clean_log("\n".join(lines)).lines) == 1


def test_rank_that_aborted_in_cpp_gives_its_terminate_message():
    # Rank 0 died on gloo's size check (SIGABRT, no traceback, no rank prefix);
    # rank 1 only saw the connection drop. torchrun names rank 0 first.
    root = clean_log((LOGS / "gloo_abort_rank0_shape_mismatch.txt").read_text()).root_error
    assert (root.type, root.rank) == ("gloo::EnforceNotMet", 0)
    assert "op.preamble.length <= op.nbytes. 2000 vs 1000" in root.message
    assert "Connection reset" not in root.message


def test_a_pasted_terminate_message_is_a_root_error():
    text = (
        "terminate called after throwing an instance of 'c10::DistBackendError'\n"
        "  what():  [PG 0 Rank 1] Process group watchdog thread terminated with exception: "
        "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, "
        "OpType=ALLREDUCE) ran for 600011 milliseconds before timing out.\n"
    )
    root = clean_log(text).root_error
    assert root.type == "c10::DistBackendError" and "Watchdog caught" in root.message


def test_the_root_error_is_one_ranks_exception_not_the_next_ranks_warning():
    # Real log (torchrun, 2 ranks, init_process_group("nccl") on a CPU-only torch):
    # rank 1's UserWarning follows rank 0's exception line without a rank prefix.
    clean = clean_log((LOGS / "nccl_on_cpu_only_torch.txt").read_text())
    assert clean.root_error.type == "RuntimeError"
    assert clean.root_error.message == "Distributed package doesn't have NCCL built in"


def test_a_message_that_spans_lines_still_keeps_them():
    text = (
        "RuntimeError: Expected to have finished reduction in the prior iteration before\n"
        "starting a new one. This error indicates that your module has parameters that\n"
        "were not used in producing loss.\n"
        "/usr/lib/python3/site-packages/torch/nn/modules/module.py:1501: UserWarning: x\n"
    )
    message = clean_log(text).root_error.message
    assert message.endswith("were not used in producing loss.") and "UserWarning" not in message


def test_mp_spawn_wrapper_gives_way_to_the_process_own_error():
    # Real log (data/eval/logs): mp.spawn's ProcessRaisedException wraps process 0's error.
    log = (LOGS.parents[2] / "data" / "eval" / "logs" / "log-spawn-port-in-use.log").read_text()
    root = clean_log(log).root_error
    assert root.type == "torch.distributed.DistNetworkError" and root.rank == 0
    assert "EADDRINUSE" in root.message


@pytest.mark.parametrize(
    ("text", "signal", "code"),
    [
        (
            "[launch.py:324:sigkill_handler] ['python', 'train.py'] exits with return code = -9",
            "SIGKILL",
            -9,
        ),
        ("[Error][launch.py:324:sigkill_handler]exits with return -7", "SIGBUS", -7),
        ("用deepspeed方式返回错误码-9 啥意思", "SIGKILL", -9),
        ("训练报错，返回值是-9，请问如何处理", "SIGKILL", -9),
        ("多卡训练退出码：-11", "SIGSEGV", -11),
        ("运行 run_lora.sh 退出return code=-7", "SIGBUS", -7),  # no word boundary after 出
        ("the container ended with exit code 137", "SIGKILL", -9),
        ("worker exited with exit status 2", "ChildFailedError", 2),
    ],
)
def test_an_exit_status_in_any_wording_is_the_root_error_as_torchrun_writes_it(text, signal, code):
    root = clean_log(text).root_error
    assert root.type == signal
    assert root.message.startswith(f"exitcode: {code} (")


@pytest.mark.parametrize(
    "text", ["Process finished with exit code 0", "the script exited with exit status 1"]
)
def test_an_exit_status_that_says_nothing_is_no_root_error(text):
    assert clean_log(text).root_error is None


def test_a_real_exception_wins_over_an_exit_status():
    root = clean_log("RuntimeError: boom\nexits with return code = -9").root_error
    assert root.type == "RuntimeError" and root.message.startswith("boom")


def test_torchruns_own_exitcode_line_is_named_like_the_other_wordings():
    log = "ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: -9) local_rank: 0 (pid: 77) of binary: /usr/bin/python"
    root = clean_log(log).root_error
    assert (root.type, root.message) == ("SIGKILL", "exitcode: -9")
    argparse_exit = clean_log(log.replace("-9", "2")).root_error
    assert (argparse_exit.type, argparse_exit.message) == ("ChildFailedError", "exitcode: 2")


def test_a_prose_report_is_searched_with_its_opening_lines() -> None:
    # A title without any error word, then a long body with a few salient lines:
    # the title must reach retrieval, and the salient lines of the rest follow it.
    body = [f"step {i}: loss 0.{i:02d}" for i in range(40)]
    report = "\n".join(
        [
            "How to train on multiple GPUs in a jupyter notebook?",
            "My machine has 2 GPUs but only one is busy.",
            *body,
            "Warning: NCCL was not initialised in the notebook kernel",
        ]
    )
    clean = clean_log(report)
    assert clean.root_error is None
    lines = clean.focus.splitlines()
    assert lines[0] == "How to train on multiple GPUs in a jupyter notebook?"
    assert "Warning: NCCL was not initialised in the notebook kernel" in lines
    assert len(lines) <= 24


def test_an_issue_templates_scaffolding_does_not_fill_the_opening() -> None:
    # A templated GitHub issue: headings, checkboxes and an environment block
    # come before what the person saw, and would take the opening lines.
    environment = [f"- `library{i}` version: 1.{i}.0" for i in range(10)]
    report = "\n".join(
        [
            "Fine-tuning is slower on two GPUs than on one",
            "### System Info",
            *environment,
            "- PyTorch version (GPU?): 2.2.0+cu121 (True)",
            "Platform: Linux-5.15.0-92-generic-x86_64-with-glibc2.29",
            "### Who can help?",
            "## To Reproduce",
            "@some-maintainer",
            "- [X] I have searched the existing issues",
            "### 运行环境 | Environment",
            "### The GPU memory is not balanced between the cards",
            "One GPU trains at 1.5 it/s, two GPUs at 4.6 s/it.",
        ]
    )
    lines = clean_log(report).focus.splitlines()
    assert lines[:3] == [
        "Fine-tuning is slower on two GPUs than on one",
        # a heading that says something is the person's words, not the template's
        "### The GPU memory is not balanced between the cards",
        "One GPU trains at 1.5 it/s, two GPUs at 4.6 s/it.",
    ]
    assert not any("version" in line or "[X]" in line or "@" in line for line in lines)


def test_a_log_with_a_root_error_still_leads_with_it() -> None:
    log = (
        "starting run 17\n"
        + "\n".join(f"epoch {i}" for i in range(30))
        + (
            '\nTraceback (most recent call last):\n  File "train.py", line 3, in <module>\n'
            "RuntimeError: NCCL error: unhandled system error"
        )
    )
    clean = clean_log(log)
    assert clean.focus.splitlines()[0].startswith("RuntimeError: NCCL error")
    assert "starting run 17" not in clean.focus


@pytest.mark.timeout(30)
def test_template_lines_cannot_make_cleaning_slow() -> None:
    # Hostile lines aimed at the line patterns: a heading marker before a long
    # run of spaces once backtracked cubically (1,000 spaces never ended).
    for line in (
        "#" + " " * 200_000 + "x",
        "- " + "a" * 200_000 + " version: 1",
        "@a" + " @a" * 100_000 + "!",
        "- [x]" + " " * 200_000,
        "a" * 200_000,  # a record's "...Warning: " prefix was sought quadratically
    ):
        clean = clean_log(f"{line}\n{line}")
        assert clean.root_error is None


def test_the_nccl_version_torch_appends_to_every_nccl_error_leaves_the_focus():
    # ", NCCL version 2.7.8" ends whatever NCCL error torch raises: not evidence of a
    # version problem. NCCL's own INFO line with its version stays (nodes may differ).
    error = "RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:825, unhandled cuda error, NCCL version 2.7.8"
    focus = clean_log(error).focus
    assert "unhandled cuda error" in focus and "NCCL version" not in focus
    info = "node1:42:42 [0] NCCL INFO NCCL version 2.18.1+cuda12.1"
    assert "NCCL version 2.18.1+cuda12.1" in clean_log(info).focus
