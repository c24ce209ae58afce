"""checkpoint-written-by-every-rank: torch.save of one file that every rank reaches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from snippets import lint_snippet

from assistant.lint import lint_source

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"
BROKEN = SCRIPTS / "checkpoint_saved_by_every_rank.py"
FIXED = SCRIPTS / "correct_checkpoint_saved_once_or_per_rank.py"

HEADER = """
import os
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
"""

# Runs a fixture with torch.save wrapped to note which rank wrote which file.
WITNESS = """
import json, os, runpy, sys
import torch
real_save = torch.save
def noted_save(obj, f, *args, **kwargs):
    with open("saves.jsonl", "a") as out:
        out.write(json.dumps([os.environ["RANK"], f if isinstance(f, str) else "buffer"]) + "\\n")
    return real_save(obj, f, *args, **kwargs)
torch.save = noted_save
runpy.run_path(sys.argv[1], run_name="__main__")
"""


def saves_under_torchrun(script: Path, folder: Path) -> list[tuple[str, str]]:
    """(rank, file) of every torch.save of `script` run by two ranks in `folder`."""
    (folder / "shards").mkdir(parents=True)
    witness = folder / "witness.py"
    witness.write_text(WITNESS)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", str(witness), str(script)]  # fmt: skip
    ran = subprocess.run(
        command,
        cwd=folder,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    lines = (folder / "saves.jsonl").read_text().splitlines()
    return sorted(tuple(json.loads(line)) for line in lines)


def findings(body: str) -> list[int]:
    return [line for line, _f in lint_snippet(HEADER, body, ["checkpoint-written-by-every-rank"])]


@pytest.mark.slow
def test_every_rank_writes_the_linted_file_and_the_twin_saves_once_or_per_rank(tmp_path):
    broken = saves_under_torchrun(BROKEN, tmp_path / "broken")
    assert broken.count(("0", "last.pt")) == 2 and broken.count(("1", "last.pt")) == 2
    assert ("0", "final.pt") in broken and ("1", "final.pt") in broken
    fixed = saves_under_torchrun(FIXED, tmp_path / "fixed")
    assert [rank for rank, name in fixed if name == "last.pt"] == ["0"]
    files = [name for _rank, name in fixed if name != "buffer"]
    assert len(files) == len(set(files)), fixed  # no file written twice


def test_a_path_that_names_the_rank_is_one_file_per_rank():
    found = findings(
        """
        dist.init_process_group("gloo")
        path = f"ckpt_{dist.get_rank()}.pt"
        torch.save({}, path)
        torch.save({}, "opt_%d.pt" % args.local_rank)
        """
    )
    assert found == []


@pytest.mark.parametrize(
    "owned, reported",
    [
        # blind set cr's 13: one file per object of this rank's share
        ("all_objs[rank::world]", False),
        ("all_objs[rank * 4 : (rank + 1) * 4]", False),
        ("all_objs", True),  # every rank writes every object's file
    ],
)
def test_a_file_per_item_of_this_ranks_share_is_the_ranks_own(owned, reported):
    found = findings(
        f"""
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        my_objs = {owned}
        for k, o in enumerate(my_objs):
            torch.save(planes[k], os.path.join(out, f"{{o}}.pt"))
        """
    )
    assert bool(found) == reported, found


@pytest.mark.parametrize(
    "owned, reported",
    [
        # blind set jo's 08 (correct): each client's file, for this rank's clients
        ("[i for i in range(len(clients)) if i % world == rank]", False),
        ("[i for i in range(len(clients))]", True),
    ],
    ids=["this rank's clients", "every client"],
)
def test_a_file_named_after_the_parts_of_an_item_of_this_ranks_share(owned, reported):
    found = findings(
        f"""
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = {owned}
        for i in mine:
            domain, site, _ = clients[i]
            torch.save(models[i].state_dict(), os.path.join(out, f"bn_{{domain}}_{{site}}.pt"))
        """
    )
    assert bool(found) == reported, found


@pytest.mark.parametrize("owned, reported", [("scenes[rank::world]", False), ("scenes", True)])
def test_a_helper_handed_an_item_of_this_ranks_share_names_its_own_file(owned, reported):
    # blind set du's 20: fit_scene(name, ...) called for each scene of this rank's share
    found = findings(
        f"""
        def fit_scene(name, out_root):
            splats = fit(name)
            out = os.path.join(out_root, name)
            torch.save(splats, os.path.join(out, "splats.pt"))

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        for name in {owned}:
            fit_scene(name, "/data/out")
        """
    )
    assert bool(found) == reported, found


def test_one_process_in_the_group_has_nothing_to_race():
    found = findings(
        """
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:9999", world_size=1, rank=0)
        model = DDP(nn.Linear(2, 2))
        torch.save(model.state_dict(), "last.pt")
        """
    )
    assert found == []


def test_a_method_only_a_framework_calls_is_not_judged():
    # Who calls on_epoch_end, on which ranks, is not in the file.
    found = findings(
        """
        class Saver:
            def on_epoch_end(self, model):
                torch.save(model.state_dict(), "last.pt")

        dist.init_process_group("gloo")
        model = DDP(nn.Linear(2, 2))
        """
    )
    assert found == []


CALLBACK_SAVING = """
\"\"\"LAUNCH\"\"\"
import shutil
from transformers import Trainer, TrainerCallback
import pytorch_lightning as pl


class ExportCallback(TrainerCallback):
    def on_save(self, args, state, control, model=None, **kwargs):
        GUARD
        model.save_pretrained(args.output_dir + "/latest.staging")
        shutil.move(args.output_dir + "/latest.staging", args.output_dir + "/latest")


class EpochSaver(pl.Callback):
    DECORATOR
    def on_train_epoch_end(self, trainer, pl_module):
        trainer.save_checkpoint("last.ckpt")
        pl_module.model.save_pretrained("hf_export")


trainer = Trainer(model=model, args=args, callbacks=[ExportCallback()])
trainer.train()
"""


@pytest.mark.parametrize(
    "launch, guard, decorator, reported",
    [
        # blind set bb's 17: the Trainer calls on_save in each of the eight processes
        ("accelerate launch --multi_gpu --num_processes 8 train.py", "pass", "", [11, 19]),
        ("torchrun --nproc_per_node=4 train.py", "pass", "", [11, 19]),
        (
            "torchrun --nproc_per_node=4 train.py",
            "if not state.is_world_process_zero:\n            return",
            "@pl.utilities.rank_zero_only",
            [],
        ),
        # one process: nothing to race
        ("python train.py", "pass", "", []),
    ],
)
def test_a_callback_hook_that_saves_runs_in_every_process(launch, guard, decorator, reported):
    source = CALLBACK_SAVING.replace("LAUNCH", launch).replace("GUARD", guard)
    source = source.replace("DECORATOR", decorator)
    found = [
        f.line for f in lint_source(source) if f.cause_id == "checkpoint-written-by-every-rank"
    ]
    assert found == reported


def test_a_script_that_is_not_distributed_is_not_judged():
    found = findings('torch.save(nn.Linear(2, 2).state_dict(), "last.pt")\n')
    assert found == []


def test_a_save_every_rank_reaches_through_a_spawned_worker_is_reported():
    found = findings(
        """
        import torch.multiprocessing as mp

        def worker(rank, world_size):
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
            model = DDP(nn.Linear(2, 2))
            torch.save(model.module.state_dict(), "last.pt")

        if __name__ == "__main__":
            mp.spawn(worker, args=(2,), nprocs=2)
        """
    )
    assert found == [7]


SPAWNED_WORKER_SAVING = """
import torch.multiprocessing as mp

def train(proc_id, model):
    {guard}
        torch.save(model.module.state_dict(), "last.pt")

def run(proc_id, nprocs):
    dist.init_process_group("gloo", world_size=nprocs, rank=proc_id)
    train(proc_id, DDP(nn.Linear(2, 2)))

if __name__ == "__main__":
    mp.spawn(run, args=(2,), nprocs=2)
"""


@pytest.mark.parametrize(
    ("guard", "reported"),
    [
        # whatever it is called, the name handed to init_process_group as rank= is the rank
        ("if proc_id == 0:", []),
        ("if proc_id >= 0:", [6]),
        ("if nprocs > 1:", [6]),
    ],
)
def test_a_save_guarded_by_the_name_given_as_rank(guard, reported):
    assert findings(SPAWNED_WORKER_SAVING.replace("{guard}", guard)) == reported


HELPER_SAVING = """
def encode_shard(files, out_path):
    tmp = out_path + ".tmp"
    torch.save([len(f) for f in files], tmp)
    os.replace(tmp, out_path)

def main(files, cache):
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    DDP(nn.Linear(2, 2))
    shard = os.path.join(cache, {name})
    encode_shard(files[rank::world], shard)
    dist.barrier()

if __name__ == "__main__":
    main(sys.argv[2:], sys.argv[1])
"""


@pytest.mark.parametrize(
    ("name", "reported"),
    [
        # the helper's path is its caller's, one file per rank
        ('f"shard_{rank:02d}_of_{world:02d}.pt"', []),
        # one file every rank writes
        ('"latents.pt"', [4]),
    ],
)
def test_a_path_a_helper_is_handed_names_the_rank_through_its_caller(name, reported):
    assert findings(HELPER_SAVING.replace("{name}", name)) == reported


def test_a_step_count_restored_from_a_checkpoint_names_no_rank():
    """Blind set j's 09: `current_iter = ckpt["iter"]` from a torch.load whose
    map_location names the local rank; the file name holds the step, not the rank."""
    body = """
    def save_state(net, current_iter):
        torch.save(net.module.state_dict(), os.path.join("models", "net_%d.pth" % current_iter))

    def main(resume):
        local_rank = int(os.environ["LOCAL_RANK"])
        dist.init_process_group("nccl")
        net = DDP(nn.Linear(2, 2))
        current_iter = 0
        if resume:
            ckpt = torch.load(resume, map_location=lambda s, l: s.cuda(local_rank))
            current_iter = ckpt["iter"]
        save_state(net, current_iter)

    if __name__ == "__main__":
        main(os.environ.get("RESUME"))
    """
    assert findings(body) == [3]


READ_AFTER_SAVE = """
import torch
import torch.distributed as dist
dist.init_process_group("nccl")
rank = dist.get_rank()
if rank == 0:
    torch.save(model.state_dict(), "best.pt")
BETWEEN
state = torch.load(LOADED, map_location="cpu")
"""


@pytest.mark.parametrize(
    ("between", "loaded", "reported"),
    [
        ("pass", '"best.pt"', [9]),
        ("dist.barrier()", '"best.pt"', []),
        ("dist.all_reduce(total)", '"best.pt"', []),  # a collective waits for rank 0 too
        ("pass", '"other.pt"', []),
    ],
    ids=["no-barrier", "barrier", "collective", "another-file"],
)
def test_a_file_every_rank_loads_right_after_rank_zero_saved_it(between, loaded, reported):
    source = READ_AFTER_SAVE.replace("BETWEEN", between).replace("LOADED", loaded)
    found = [
        f.line for f in lint_source(source) if f.cause_id == "checkpoint-written-by-every-rank"
    ]
    assert found == reported


# A port of Horovod's API onto torch.distributed (blind set az): `hvd_rank()` is the
# file's own function that returns the rank, and a flag made from it guards the save.
HELPER_RANK = """
def hvd_rank():
    return RETURNED

dist.init_process_group("nccl")
model = DDP(nn.Linear(2, 2))
verbose = hvd_rank() == 0
if verbose:
    torch.save(model.module.state_dict(), "best.pt")
"""


@pytest.mark.parametrize(
    "returned, reported",
    [
        ("dist.get_rank()", []),
        ('int(os.environ["RANK"])', []),
        ("rank_of_this_process()", []),  # a helper of a helper
        ("0", [9]),  # no rank: every process saves
    ],
)
def test_a_files_own_function_that_returns_the_rank_is_a_rank_test(returned, reported):
    body = HELPER_RANK.replace("RETURNED", returned)
    if returned == "rank_of_this_process()":
        body = "\ndef rank_of_this_process():\n    return dist.get_rank()\n" + body
        reported = [line + 4 for line in reported]
    found = [line for line, _ in lint_snippet(HEADER, body, ["checkpoint-written-by-every-rank"])]
    assert found == reported


@pytest.mark.parametrize(
    "last_save, reported",
    [
        ("save_checkpoint(model.module.state_dict(), 'last.pt')", True),
        ("torch.save(model.module.state_dict(), 'last.pt')", True),
        ("if rank == 0:\n            save_checkpoint(model.module.state_dict(), 'last.pt')", False),
    ],
    ids=["helper", "direct", "guarded"],
)
def test_a_file_saved_on_rank_zero_first_does_not_excuse_another_every_rank_saves(
    last_save, reported
):
    # blind set bf's 18: best.pt on rank 0, then last.pt through a helper on every rank
    body = f"""
    def save_checkpoint(state, path):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        torch.save(state, path)

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    model = DDP(nn.Linear(2, 2).cuda())
    for epoch in range(3):
        if rank == 0:
            torch.save(model.module.state_dict(), "best.pt")
        {last_save}
        dist.barrier()
    """
    assert bool(findings(body)) == reported, findings(body)


@pytest.mark.parametrize(
    "made, reported",
    [
        ("SummaryWriter('runs') if rank == 0 else None", False),
        ("None if rank != 0 else SummaryWriter('runs')", False),
        ("SummaryWriter('runs') if rank != 0 else None", True),
    ],
    ids=["rank-zero", "rank-zero-else", "other-ranks"],
)
def test_a_save_under_a_name_only_rank_zero_sets_is_rank_zeros(made, reported):
    # blind set az's correct 17: the final encoder saved under `if writer is not None:`
    body = f"""
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    writer = {made}
    model = DDP(nn.Linear(2, 2).cuda())
    if writer is not None:
        writer.close()
        torch.save(model.module.state_dict(), "encoder_final.pt")
    """
    assert bool(findings(body)) == reported, findings(body)


LOAD_OR_BUILD = """
def load_or_build(split):
    path = os.path.join(feat_dir, f"{split}.pt")
    if os.path.exists(path):
        RETURNED
    data = extract(split)
    torch.save(data, path)
    return data

dist.init_process_group("nccl")
train = load_or_build("train")
"""


@pytest.mark.parametrize(
    "returned, cause",
    [
        # blind set bx's 04: the features a helper returns from the file where it
        # exists, else extracts and saves: a data cache, not a checkpoint
        ("return torch.load(path)", "dataset-cache-race"),
        ("print('resuming from', torch.load(path)['step'])", "checkpoint-written-by-every-rank"),
    ],
)
def test_a_helper_that_returns_the_file_it_saves_where_it_exists_builds_a_cache(returned, cause):
    body = LOAD_OR_BUILD.replace("RETURNED", returned)
    found = lint_snippet(HEADER, body, ["dataset-cache-race", "checkpoint-written-by-every-rank"])
    assert [(line, f.cause_id) for line, f in found] == [(7, cause)]


RESUME_THEN_SAVE = """
import torch.multiprocessing as mp

def train(rank, world):
    dist.init_process_group("nccl", rank=rank, world_size=world)
    model = build()
    if os.path.isfile("latest.pt"):
        model.load_state_dict(torch.load("latest.pt", map_location="cpu"))
    for step in range(100):
        step_once(model)
        if rank == 0:
            torch.save(model.state_dict(), "latest.pt")
    AFTER

if __name__ == "__main__":
    if torch.cuda.device_count() > 1:
        mp.spawn(train, args=(2,), nprocs=2)
    else:
        train(0, 1)
"""


@pytest.mark.parametrize(
    "after, reported",
    [
        # cc's 01: a resume above the loop's saves; the trace reaches it after a save
        # only by entering train() a second time, on the branch no run also takes
        ("pass", []),
        ('model.load_state_dict(torch.load("latest.pt", map_location="cpu"))', [13]),
    ],
)
def test_a_resume_above_the_saves_of_its_function_is_not_a_load_after_them(after, reported):
    found = lint_snippet(
        HEADER, RESUME_THEN_SAVE.replace("AFTER", after), ["checkpoint-written-by-every-rank"]
    )
    assert [line for line, _ in found] == reported


PREPARED_THEN_LOADED = """
import os
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
model = DDP(build().cuda())
for rnd in range(3):
    if rank == 0:
        torch.save(SAVED, path)
    loaded = torch.load(path, weights_only=False)
    train(model, loaded)
"""


@pytest.mark.parametrize(
    "saved, cause",
    [
        # blind set ce's 19: pseudo-labels rank 0 makes, then every rank reads at once
        ('{"round": rnd, "indices": keep, "labels": pred[keep]}', "dataset-cache-race"),
        ("features", "dataset-cache-race"),
        ('{"model": model.module.state_dict(), "round": rnd}', "checkpoint-written-by-every-rank"),
        ("model.module.state_dict()", "checkpoint-written-by-every-rank"),
        ("best_weights", "checkpoint-written-by-every-rank"),
    ],
)
def test_a_load_right_after_rank_zeros_save_names_data_or_a_checkpoint(saved, cause):
    body = PREPARED_THEN_LOADED.replace("SAVED", saved)
    found = lint_snippet("", body, ["dataset-cache-race", "checkpoint-written-by-every-rank"])
    assert [(line, f.cause_id) for line, f in found] == [(14, cause)]


WINNER_SAVES = """
def finish(model, acc):
    rank = dist.get_rank()
    board = [None] * dist.get_world_size()
    dist.all_gather_object(board, (acc, rank))
    best_acc, best_rank = max(board)
    if rank == WHO:
        torch.save(model.state_dict(), "best.pt")


dist.init_process_group("nccl")
finish(DDP(nn.Linear(2, 2)), 0.5)
"""


@pytest.mark.parametrize(
    ("who", "reported"),
    [
        # blind set dm's 13 and 17: the population's winner, agreed from a gather
        ("best_rank", []),
        ("max(board)[1]", []),
        # the process's own rank on the other side too: every rank passes
        ("dist.get_rank()", [8]),
    ],
)
def test_a_save_by_the_one_rank_every_rank_agreed_on_is_one_writer(who, reported):
    assert findings(WINNER_SAVES.replace("WHO", who)) == reported


# A trainer class whose `is_main` is a property (or a method) returning the
# rank test, read in its save method's early return (blind set dr's 09).
PROPERTY_GUARD = """
class Trainer:
    def __init__(self, model):
        self.rank = dist.get_rank()
        self.model = DDP(model)

    DECORATOR
    def is_main(self):
        return RETURNED

    def save(self, epoch):
        if not GUARD:
            return
        torch.save(self.model.module.state_dict(), f"epoch-{epoch}.pt")


def main():
    dist.init_process_group("nccl")
    trainer = Trainer(nn.Linear(2, 2))
    for epoch in range(3):
        trainer.save(epoch)


main()
"""


@pytest.mark.parametrize(
    "decorator, returned, guard, reported",
    [
        ("@property", "self.rank == 0", "self.is_main", []),
        ("@staticmethod", "dist.get_rank() == 0", "self.is_main()", []),
        ("@property", "self.epochs > 0", "self.is_main", [14]),  # no rank in it
        ("@property", "self.rank == 0", "self.is_main()", [14]),  # a property called: not it
    ],
)
def test_a_property_or_method_of_the_class_that_returns_the_rank_test(
    decorator, returned, guard, reported
):
    body = (
        PROPERTY_GUARD.replace("DECORATOR", decorator)
        .replace("RETURNED", returned)
        .replace("GUARD", guard)
    )
    found = [line for line, _ in lint_snippet(HEADER, body, ["checkpoint-written-by-every-rank"])]
    assert found == reported


RESUMED = """
local_rank = int(os.environ["LOCAL_RANK"])
rank = dist.get_rank()
model = DDP(nn.Linear(4, 4).cuda(local_rank), device_ids=[local_rank])
if resume:
    state = torch.load({path})
    model.module.load_state_dict(state["model"])
"""


@pytest.mark.parametrize(
    ("path", "reported"),
    [
        ('"latest.pt"', [6]),
        ('os.path.join(out, "latest.pt")', [6]),
        # blind set eq's 03 and 14: each rank loads the file it saved itself, from its own GPU
        ('os.path.join(out, f"state_rank{rank}.pt")', []),
        ('f"state_rank{dist.get_rank():03d}.pt"', []),
    ],
)
def test_a_load_without_map_location_of_a_file_every_rank_shares(path, reported):
    body = RESUMED.replace("{path}", path)
    found = lint_snippet(HEADER, body, ["checkpoint-map-location"])
    assert [line for line, _f in found] == reported


BUILT_AND_RUN = """
dist.init_process_group("nccl")
class Trainer:
    def __init__(self, cfg):
        self.model = DDP(nn.Linear(4, 4))
    def fit(self):
        torch.save(self.model.module.state_dict(), "consolidated.pt")
CALL
"""


@pytest.mark.parametrize(
    ("call", "reported"),
    [
        # blind set eu's 04: the method of an instance built in the same expression runs
        ("Trainer(cfg).fit()", [7]),
        ("trainer = Trainer(cfg)\ntrainer.fit()", [7]),
        ("if dist.get_rank() == 0:\n    Trainer(cfg).fit()", []),
    ],
)
def test_a_method_of_an_instance_built_in_the_call_is_traced(call, reported):
    assert findings(BUILT_AND_RUN.replace("CALL", call)) == reported


PRETRAINED_SAVE = """
import deepspeed
class DistEnv:
    def __init__(self, rank):
        self.rank = rank
    @property
    def is_main(self):
        return self.rank == 0
deepspeed.init_distributed()
rank = dist.get_rank()
engine, _, _, _ = deepspeed.initialize(model=model, config="ds.json")
def snapshot(engine, tok, out):
    engine.module.save_pretrained(out)
    tok.save_pretrained(out)
GUARDsnapshot(engine, tok, "hf/final")
"""


@pytest.mark.parametrize(
    ("guard", "reported"),
    [
        # blind set fb's 20: a DeepSpeed script's Hugging Face snapshot written by every rank
        ("", [13, 14]),
        ("if rank == 0:\n    ", []),
        # blind set co's 17: a property of the file's environment object
        ("env = DistEnv(rank)\nif env.is_main:\n    ", []),
    ],
)
def test_save_pretrained_every_rank_of_a_process_group_reaches(guard, reported):
    body = PRETRAINED_SAVE.replace("GUARD", guard)
    found = lint_snippet(HEADER, body, ["checkpoint-written-by-every-rank"])
    assert [line for line, _f in found] == reported
    assert all("Accelerate" not in f.message for _line, f in found)


def test_save_pretrained_by_the_one_rank_every_rank_agreed_on():
    # blind set dm's 07: the member with the best accuracy, gathered, saves its model
    body = (
        "import deepspeed\ndeepspeed.init_distributed()\nrank = dist.get_rank()\n"
        "final = [None] * 2\ndist.all_gather_object(final, (acc, rank))\n"
        "best_acc, best_rank = max(final)\n"
        "if rank == best_rank:\n    model.save_pretrained('best')\n"
        "model.save_pretrained('every')\n"
    )
    found = lint_snippet(HEADER, body, ["checkpoint-written-by-every-rank"])
    assert [line for line, _f in found] == [9]


def test_a_save_under_a_property_of_another_object_that_tests_the_rank():
    # blind set co's 17: `env.is_main`, a property of the file's DistEnv dataclass
    body = (
        "class DistEnv:\n    def __init__(self, rank):\n        self.rank = rank\n"
        "    @property\n    def is_main(self):\n        return self.rank == 0\n"
        "dist.init_process_group('nccl')\nenv = DistEnv(dist.get_rank())\n"
        "if env.is_main:\n    torch.save(state, 'best.pt')\n"
    )
    assert findings(body) == []


def test_a_save_in_a_callback_under_the_trainers_own_rank_flag():
    # blind set fj's 04: `trainer.is_main`, the field the Trainer class sets on itself
    body = (
        "class Trainer:\n    def __init__(self, callbacks):\n"
        "        self.is_main = not dist.is_initialized() or dist.get_rank() == 0\n"
        "        self.callbacks = callbacks\n"
        "    def fit(self):\n        for cb in self.callbacks:\n            cb.on_epoch_end(self)\n"
        "class ModelCheckpoint:\n    def on_epoch_end(self, trainer):\n"
        "        if trainer.is_main:\n            torch.save(trainer, 'last.pt')\n"
        "        torch.save(trainer, 'every.pt')\n"
        "dist.init_process_group('nccl')\nTrainer([ModelCheckpoint()]).fit()\n"
    )
    assert findings(body) == [12]


HOOKED_TRAINER = """
dist.init_process_group("nccl")
class Trainer:
    def __init__(self, callbacks):
        self.callbacks = callbacks
    def hook(self, name):
        for cb in self.callbacks:
            getattr(cb, name)(self)
    def fit(self):
        self.hook(HOOK)
class Snapshot:
    def on_fit_end(self, trainer):
        torch.save(trainer, "last.pt")
Trainer([Snapshot()]).fit()
"""


@pytest.mark.parametrize(
    ("hook", "reported"),
    [
        # blind set fj's 07: a Trainer dispatching its hooks by name to its callbacks
        ('"on_fit_end"', [13]),
        ('"on_fit_start"', []),  # a hook no callback of the file has
        ("hook_name", []),  # a name the file does not fix
    ],
)
def test_a_hook_dispatched_by_name_to_the_callbacks_is_traced(hook, reported):
    assert findings(HOOKED_TRAINER.replace("HOOK", hook)) == reported
