"""The parts of `assistant run` that need no launch: the hook's chaining, stacks, hang rules, command parsing."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from assistant.watch import jobhook
from assistant.watch.hang import RankPosition, analyse, enclosing_loop
from assistant.watch.launch import interpreter_of, nproc_of, probe_environment, script_of
from assistant.watch.stacks import Frame, innermost_user_frame, main_thread, parse_dump, waiting_in
from assistant.watch.watcher import prepare_log_dir

DUMP = """\
Thread 0x00007f3a1c5ff640 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 324 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f3a2d1b7740 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2950 in all_reduce
  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 81 in wrapper
  File "/home/me/train.py", line 14 in main
  File "/home/me/train.py", line 30 in <module>
"""


def test_a_faulthandler_dump_gives_the_main_threads_place_and_collective():
    threads = parse_dump(DUMP)
    assert [t.ident for t in threads] == [0x7F3A1C5FF640, 0x7F3A2D1B7740]
    main = main_thread(threads, 0x7F3A2D1B7740)
    assert innermost_user_frame(main.frames) == Frame("/home/me/train.py", 14, "main")
    assert waiting_in(main.frames) == "all_reduce"
    assert waiting_in(threads[0].frames) is None


def _script(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "train.py"
    path.write_text(text)
    return path


LOOP = """\
import torch.distributed as dist
def main(batches):
    for batch in batches:
        dist.all_reduce(batch)
    dist.barrier()
"""


def test_a_rank_past_the_loop_while_another_is_in_it_ran_out_of_batches(tmp_path):
    path = str(_script(tmp_path, LOOP))
    assert enclosing_loop(path, 4) == (3, 4)
    positions = [
        RankPosition(0, True, Frame(path, 4, "main"), "all_reduce"),
        RankPosition(1, True, Frame(path, 5, "main"), "barrier"),
    ]
    analysis = analyse(positions, 8)
    assert analysis.cause_id == "uneven-inputs" and analysis.odd_ranks == [1]
    assert analysis.findings[0].line == 5 and analysis.findings[0].source == "probe"


def test_different_collectives_outside_a_loop_are_a_mismatch_naming_the_skipped_one(tmp_path):
    path = str(_script(tmp_path, "if rank == 0:\n    all_reduce(x)\nbarrier()\n"))
    positions = [
        RankPosition(0, True, Frame(path, 2, "main"), "all_reduce"),
        RankPosition(1, True, Frame(path, 3, "main"), "barrier"),
        RankPosition(2, True, Frame(path, 3, "main"), "barrier"),
    ]
    analysis = analyse(positions, 8)
    assert analysis.cause_id == "collective-mismatch" and analysis.odd_ranks == [0]
    assert "ranks 1, 2 never issued" in analysis.findings[0].message


def test_a_rank_outside_any_collective_is_the_straggler():
    positions = [
        RankPosition(0, True, Frame("/t.py", 9, "main"), "barrier"),
        RankPosition(1, True, Frame("/t.py", 4, "load"), None),
    ]
    analysis = analyse(positions, 8)
    assert analysis.cause_id == "collective-timeout" and analysis.odd_ranks == [1]
    assert analysis.findings[0].line == 4


def test_no_rank_in_a_collective_names_no_cause():
    analysis = analyse([RankPosition(0, True, Frame("/t.py", 4, "load"), None)], 8)
    assert analysis.cause_id is None and analysis.findings == []


def test_every_rank_in_the_same_collective_while_one_left_cleanly_is_uneven_inputs():
    positions = [
        RankPosition(0, True, Frame("/t.py", 9, "main"), "all_reduce"),
        RankPosition(1, False, None, None, exited_cleanly=True),
    ]
    analysis = analyse(positions, 8)
    assert analysis.cause_id == "uneven-inputs" and analysis.odd_ranks == [1]


def test_the_command_gives_its_script_ranks_and_interpreter(tmp_path):
    script = _script(tmp_path, "print()\n")
    command = ["srun", "-N1", "torchrun", "--nproc-per-node", "4", "train.py", "--lr", "0.1"]
    assert script_of(command, tmp_path) == script
    assert nproc_of(command) == 4
    assert nproc_of(["torchrun", "--nproc_per_node=3", "x.py"]) == 3
    assert nproc_of(["python", "x.py"]) is None
    assert interpreter_of([sys.executable, "x.py"]) == sys.executable
    fake = tmp_path / "torchrun"
    fake.write_text(f"#!{sys.executable}\nprint()\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    assert interpreter_of(["srun", str(fake), "x.py"]) == sys.executable


def test_the_probes_see_the_jobs_device_and_distributed_variables_only():
    env = {"CUDA_VISIBLE_DEVICES": "1", "NCCL_DEBUG": "INFO", "MASTER_PORT": "1", "HOME": "/root"}
    assert probe_environment(env) == {k: v for k, v in env.items() if k != "HOME"}


def _python_with_hook(hook_dir: Path, extra_path: Path, env_extra: dict, output=None) -> str:
    """Run a python with the hook; its output captured, or into `output` (out, err) files."""
    env = {k: v for k, v in os.environ.items() if k != jobhook.WATCH_DIR_VAR}
    env.update(env_extra)
    env["PYTHONPATH"] = os.pathsep.join([str(hook_dir), str(extra_path)])
    code = "import sys, threading; print(sys.modules['sitecustomize'].__file__, threading.active_count())"
    streams = (
        {"capture_output": True} if output is None else dict(zip(("stdout", "stderr"), output))
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, text=True, timeout=60, check=False, **streams
    )
    assert done.returncode == 0, done.stderr
    return (done.stdout or "") + (done.stderr or "")


def test_the_hook_knows_every_collective_the_lint_rules_know():
    # The hook runs in the user's job as a standalone sitecustomize, so it
    # keeps its own copy of the names; it may add places a rank blocks in
    # (send, wait, init_process_group...) but must not miss a collective.
    from assistant.lint.torchapi import COLLECTIVES

    assert COLLECTIVES <= jobhook.COLLECTIVES, sorted(COLLECTIVES - jobhook.COLLECTIVES)


def test_the_hook_chains_to_the_users_sitecustomize_and_is_idle_without_a_watch_dir(tmp_path):
    hook_dir = prepare_log_dir(tmp_path / "logs")
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("print('user sitecustomize ran')\n")
    printed = _python_with_hook(hook_dir, user, {})
    assert "user sitecustomize ran" in printed
    assert str(user / "sitecustomize.py") in printed  # the user's module, as without us
    assert printed.strip().endswith(" 1")  # no watcher thread when not watching
    assert not any((tmp_path / "logs" / "procs").iterdir())


def test_the_hook_records_the_process_and_still_chains(tmp_path):
    log_dir = tmp_path / "logs"
    hook_dir = prepare_log_dir(log_dir)
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import sys; sys.stderr.write('user hook\\n')\n")
    with open(log_dir / "launch.out", "w") as out, open(log_dir / "launch.err", "w") as err:
        _python_with_hook(hook_dir, user, {jobhook.WATCH_DIR_VAR: str(log_dir)}, (out, err))
    # The launch's own output files stay empty: the process wrote to its own.
    assert (log_dir / "launch.out").read_text() == (log_dir / "launch.err").read_text() == ""
    procs = log_dir / "procs"
    (out,) = procs.glob("*.out")
    assert "user hook" in out.with_suffix(".err").read_text()
    assert str(user / "sitecustomize.py") in out.read_text()
    assert (procs / f"{out.stem}.json").exists() and (procs / f"{out.stem}.exit").exists()


def test_output_the_launcher_sent_elsewhere_stays_there(tmp_path):
    log_dir = tmp_path / "logs"
    hook_dir = prepare_log_dir(log_dir)
    printed = _python_with_hook(hook_dir, tmp_path, {jobhook.WATCH_DIR_VAR: str(log_dir)})
    assert "sitecustomize.py" in printed  # a pipe of its own (srun, --redirects): untouched
    assert not list((log_dir / "procs").glob("*.out"))
    assert len(list((log_dir / "procs").glob("*.json"))) == 1  # recorded all the same


def _tail_of_a_watch_folder(tmp_path):
    """(log folder, its OutputTail, the chunks the tail passes on, in order)."""
    from assistant.watch.output import OutputTail

    log_dir = tmp_path / "logs"
    prepare_log_dir(log_dir)
    seen: list[bytes] = []
    tail = OutputTail(log_dir, lambda stream, data: seen.append(data), log_dir / "output.log")
    return log_dir, tail, seen


def test_in_one_poll_the_file_written_last_ends_the_output(tmp_path):
    # torchrun's agent is a watched process too: its summary lands in its own
    # file, whose pid is lower than its workers'. It printed last, so it ends.
    log_dir, tail, seen = _tail_of_a_watch_folder(tmp_path)
    procs = log_dir / "procs"
    for name, text, written in [
        ("100.err", "torch.distributed.elastic...ChildFailedError\n", 3),
        ("120.err", "[rank0]: RuntimeError: Connection closed by peer\n", 2),
        ("121.err", "[rank1]: ValueError: bad batch\n", 1),
    ]:
        (procs / name).with_suffix(".out").write_text("")
        (procs / name).write_text(text)
        os.utime(procs / name, ns=(written * 10**9, written * 10**9))
    (log_dir / "launch.err").write_text("")
    assert tail.poll() > 0
    tail.close()
    assert seen == [
        b"[rank1]: ValueError: bad batch\n",
        b"[rank0]: RuntimeError: Connection closed by peer\n",
        b"torch.distributed.elastic...ChildFailedError\n",
    ]
    assert tail.tail_text().endswith("ChildFailedError")
    assert (log_dir / "output.log").read_bytes() == b"".join(seen)


def test_files_written_within_one_clock_tick_put_children_before_parents(tmp_path):
    log_dir, tail, seen = _tail_of_a_watch_folder(tmp_path)
    procs = log_dir / "procs"
    for name in ["100", "120"]:
        (procs / f"{name}.out").write_text("")
        (procs / f"{name}.err").write_text(f"from {name}\n")
    (log_dir / "launch.out").write_text("")
    (log_dir / "launch.err").write_text("from the launch\n")
    for path in [*procs.iterdir(), log_dir / "launch.out", log_dir / "launch.err"]:
        os.utime(path, ns=(10**9, 10**9))
    tail.poll()
    tail.close()
    assert seen == [b"from 120\n", b"from 100\n", b"from the launch\n"]


def test_a_log_dir_in_use_is_refused(tmp_path):
    from assistant.errors import UserError

    (tmp_path / "old.txt").write_text("x")
    with pytest.raises(UserError, match="not empty"):
        prepare_log_dir(tmp_path)
    shutil.rmtree(tmp_path)


def test_flight_recorders_compared_show_a_mismatch_and_a_rank_behind():
    from assistant.watch.flight import LastCollective, compare, last_collective, with_buffer

    dump = {
        "available": True,
        "entries": [
            {
                "collective_seq_id": 3,
                "profiling_name": "nccl:all_reduce",
                "state": "completed",
                "process_group": ["0", "default_pg"],
                "is_p2p": False,
            },
            {
                "collective_seq_id": 0,
                "profiling_name": "nccl:send",
                "state": "started",
                "process_group": ["0", "default_pg"],
                "is_p2p": True,
            },
        ],
    }
    assert last_collective(dump) == LastCollective(3, "nccl:all_reduce", "completed")
    assert last_collective({"available": True, "entries": []}).seq == 0
    assert last_collective({"available": False, "why": "old torch"}) is None
    lines = compare(
        {
            0: LastCollective(4, "nccl:all_reduce", "started"),
            1: LastCollective(4, "nccl:barrier", "started"),
            2: LastCollective(3, "nccl:all_reduce", "completed"),
        }
    )
    assert "collective #4 is nccl:all_reduce vs nccl:barrier on different ranks" in lines[3]
    assert lines[4] == "flight recorder: rank(s) 2 never issued collective #4"
    assert with_buffer({})["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert with_buffer({"TORCH_NCCL_TRACE_BUFFER_SIZE": "10"}) == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "10"
    }


def test_an_nccl_collective_in_flight_is_where_a_rank_waits_though_its_stack_moved_on():
    from assistant.watch.flight import last_collective

    def dump(state, retired):
        entry = {
            "collective_seq_id": 7,
            "profiling_name": "nccl:all_reduce",
            "state": state,
            "retired": retired,
            "process_group": ["0", "default_pg"],
            "is_p2p": False,
        }
        return {"available": True, "entries": [entry]}

    assert last_collective(dump("started", False)).pending() == "all_reduce"
    assert last_collective(dump("scheduled", False)).pending() == "all_reduce"
    assert last_collective(dump("completed", True)).pending() is None
    gloo = {
        "available": True,
        "entries": [
            {
                "collective_seq_id": 1,
                "profiling_name": "gloo:barrier",
                "state": "scheduled",
                "retired": True,
                "process_group": ["0", ""],
                "is_p2p": False,
            }
        ],
    }
    assert last_collective(gloo).pending() is None  # gloo entries never reach "completed"
