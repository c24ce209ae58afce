"""model-differs-across-ranks: layers added or resized on some ranks only before DDP wraps the model."""

from __future__ import annotations

from pathlib import Path

import pytest
from snippets import assert_broken_fails_and_twin_runs, lint_snippet

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"
BROKEN = SCRIPTS / "layer_added_on_rank_zero_only.py"
FIXED = SCRIPTS / "correct_layer_added_on_every_rank.py"
TOKENS_BROKEN = SCRIPTS / "tokens_added_on_rank_zero_only.py"
TOKENS_FIXED = SCRIPTS / "correct_tokens_added_on_every_rank.py"

HEADER = """
import os
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
"""


def reported_lines(body: str) -> list[int]:
    return [line for line, _ in lint_snippet(HEADER, body, ["model-differs-across-ranks"])]


@pytest.mark.slow
def test_the_fixture_fails_as_linted_under_torchrun_and_its_twin_runs(torchrun):
    assert_broken_fails_and_twin_runs(
        torchrun, BROKEN, "DDP expects same model across all ranks", FIXED, "trained"
    )


@pytest.mark.slow
def test_tokens_added_on_rank_zero_only_fail_under_torchrun_and_the_twin_runs(torchrun):
    assert_broken_fails_and_twin_runs(
        torchrun,
        TOKENS_BROKEN,
        "appears not to match sizes of the same param in process 0",
        TOKENS_FIXED,
        "trained",
    )


def test_tokens_added_on_some_ranks_are_reported_where_they_are_added():
    lines = reported_lines(
        """
        def tokenizer_for(rank, tokenizer):
            if rank != 0:
                return tokenizer
            tokenizer.add_tokens(["<x>"])
            return tokenizer

        def main(tokenizer):
            dist.init_process_group("nccl")
            tokenizer = tokenizer_for(dist.get_rank(), tokenizer)
            if dist.get_rank() == 0:
                tokenizer.save_pretrained("out")
        """
    )
    assert lines == [5]


def test_tokens_added_on_every_rank_or_without_a_process_group_are_not():
    lines = reported_lines(
        """
        def main(tokenizer, model, local_rank):
            tokenizer.add_special_tokens({"pad_token": "<pad>"})
            if local_rank == -1:
                tokenizer.add_tokens(["<single>"])  # one process: nothing to disagree with
            else:
                dist.init_process_group("nccl")
            model.resize_token_embeddings(len(tokenizer))
        """
    )
    assert lines == []


def test_a_resize_on_rank_zero_before_ddp_of_a_moved_model_is_reported():
    lines = reported_lines(
        """
        def main(model, tokenizer):
            dist.init_process_group("nccl")
            rank = dist.get_rank()
            if rank == 0:
                tokenizer.add_tokens(["<x>"])
                model.resize_token_embeddings(len(tokenizer))
            model = DDP(model.to(rank), device_ids=[rank])
        """
    )
    assert lines == [6, 7]  # the vocabulary, then the embedding resized to it


def test_a_layer_added_on_the_other_ranks_is_reported_too():
    lines = reported_lines(
        """
        dist.init_process_group("gloo")
        model = nn.Linear(2, 2)
        if dist.get_rank() != 0:
            model.add_module("extra", nn.Linear(2, 2))
        model = DDP(model)
        """
    )
    assert lines == [5]


def test_the_single_process_path_and_changes_after_wrapping_are_not():
    lines = reported_lines(
        """
        local_rank = int(os.environ.get("LOCAL_RANK", -1))
        model = nn.Linear(2, 2)
        if local_rank == -1:
            model.head = nn.Linear(2, 2)  # no DDP on this path
        else:
            dist.init_process_group("gloo")
            model = DDP(model)
            if local_rank == 0:
                model.module.add_module("probe", nn.Identity())
        """
    )
    assert lines == []


def test_a_rank_zero_change_to_another_object_is_not():
    lines = reported_lines(
        """
        dist.init_process_group("gloo")
        model = nn.Linear(2, 2)
        ema = nn.Linear(2, 2)
        if dist.get_rank() == 0:
            ema.head = nn.Linear(2, 2)
            model.tag = str(dist.get_rank())
        model = DDP(model)
        """
    )
    assert lines == []


def test_a_model_sized_by_a_constant_is_not_sized_by_the_data_the_device_carries():
    """The rank that picks a GPU (`x.to(device)`, device from LOCAL_RANK) does not
    cut the data: a model sized by a fixed vocabulary, whose names the file's
    tensors reuse (`c` a channel count there), is the same on every rank."""
    body = """
    VOCAB = ["<blank>", " "] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    class Net(nn.Module):
        def __init__(self, vocab, hidden):
            super().__init__()
            self.proj = nn.Linear(hidden, vocab)
        def forward(self, x):
            b, c, t = x.shape
            return self.proj(x.reshape(b, t, c))
    def main():
        local_rank = int(os.environ["LOCAL_RANK"])
        dist.init_process_group("nccl")
        device = torch.device("cuda", local_rank)
        x = torch.randn(2, 3, 4).to(device)
        model = Net(len(VOCAB), 3).to(device)
        model = DDP(model, device_ids=[local_rank])
        model(x)
    """
    assert reported_lines(body) == []


def test_the_gpu_a_spawned_worker_wraps_its_model_on_does_not_cut_its_data():
    """Blind set c's 04: the worker's GPU index is the rank it hands
    init_process_group, and DDP(model, device_ids=[gpu]) reads it; the classes
    are counted from every item, so every rank builds the same model."""
    body = """
    class Net(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.fc = nn.Linear(4, n)
    def main_worker(gpu, ngpus, table):
        dist.init_process_group("gloo", world_size=ngpus, rank=gpu)
        items = table.items
        model = Net(len({pid for _, pid in items}))
        model = DDP(model, device_ids=[gpu])
        table = summarise(model)
    """
    assert reported_lines(body) == []
    # the same names, with the items cut by that rank: each rank counts its own classes
    cut = body.replace("items = table.items", "items = table.items[gpu::ngpus]")
    assert reported_lines(cut) == [9]


SIZED_BY_A_NAME = """
class Tabular(nn.Module):
    def __init__(self, cardinalities, dim):
        super().__init__()
        self.embeds = nn.ModuleList(nn.Embedding(c, dim) for c in cardinalities)
def main(files, columns):
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    frame = pd.concat(pd.read_parquet(f) for f in files[rank::world])
    cardinalities = [int(frame[c].max()) + 1 for c in columns]
    model = Tabular(cardinalities, 32)
    model = DDP(model)
"""


def test_embedding_sizes_measured_from_the_ranks_own_shard_through_a_name():
    """Blind set ae's 11: the sizes are a name assigned from this rank's shard."""
    assert reported_lines(SIZED_BY_A_NAME) == [11]
    # measured from the whole table (read on every rank alike): the same sizes everywhere
    whole = SIZED_BY_A_NAME.replace("files[rank::world]", "files")
    assert reported_lines(whole) == []


# Blind set ho's 05: the dataset class keeps its whole annotation file's categories
# and videos as fields; an evaluation elsewhere cuts a local of the field's name.
FIELD_AND_A_LOCAL = """
class Clips(Dataset):
    def __init__(self, ann_file):
        self.api = VideoAPI(ann_file)
        self.vids = sorted(self.api.getVidIds())
        self.cat_ids = sorted(self.api.getCatIds())
        self.items = [v for v in self.vids for _ in range(8)]
def evaluate(model, api, rank, world):
    vids = sorted(api.getVidIds())[rank::world]
    return len(vids)
def main(ann_file):
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    train_set = Clips(ann_file)
    num_classes = len(train_set.cat_ids)
    model = nn.Linear(4, num_classes)
    model = DDP(model)
    evaluate(model, VideoAPI(ann_file), rank, world)
"""


def test_a_field_is_the_classs_not_another_functions_local_of_its_name():
    assert reported_lines(FIELD_AND_A_LOCAL) == []
    # the class's own field cut by the rank: every rank counts its own categories
    cut = (
        FIELD_AND_A_LOCAL.replace("(self, ann_file)", "(self, ann_file, rank, world)")
        .replace("sorted(self.api.getVidIds())", "sorted(self.api.getVidIds())[rank::world]")
        .replace("Clips(ann_file)", "Clips(ann_file, rank, world)")
        .replace("len(train_set.cat_ids)", "len(train_set.vids)")
    )
    assert reported_lines(cut) == [16]


# Blind set bg's 13: every rank runs its own Optuna study, whose trials build the model.
OPTUNA_SEARCH = """
import optuna

def train_one(cfg, rank):
    model = DDP(nn.Sequential(*[nn.Linear(cfg["d"], cfg["d"]) for _ in range(cfg["n_blocks"])]))
    return 0.5

def main():
    dist.init_process_group("nccl")
    rank = dist.get_rank()

    def objective(trial):
        cfg = {
            "d": trial.suggest_int("d", 64, 512, log=True),
            "n_blocks": trial.suggest_int("n_blocks", 1, 8),
        }
        return train_one(cfg, rank)

    study = optuna.create_study(direction="maximize")
    study.optimize(objective, n_trials=20)

main()
"""


def test_an_optuna_study_every_rank_runs_for_its_model_is_reported():
    assert reported_lines(OPTUNA_SEARCH) == [19]


@pytest.mark.parametrize(
    "old, new",
    [
        # the trial's draws shared by rank 0 (Optuna's own wrapper for torch.distributed)
        (
            "        cfg = {",
            "        trial = optuna.integration.TorchDistributedTrial(trial)\n        cfg = {",
        ),
        # every rank's sampler seeded alike draws the same values
        (
            'optuna.create_study(direction="maximize")',
            'optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=0))',
        ),
        # the objective trains nothing under DDP
        ("        return train_one(cfg, rank)", "        return cfg['d'] / 512"),
        # rank 0 alone searches
        ("    study = optuna", "    if rank != 0:\n        return\n    study = optuna"),
    ],
    ids=["distributed-trial", "seeded-sampler", "no-ddp", "rank-zero-only"],
)
def test_an_optuna_study_whose_draws_agree_or_build_nothing_is_quiet(old, new):
    assert old in OPTUNA_SEARCH
    assert reported_lines(OPTUNA_SEARCH.replace(old, new)) == []


@pytest.mark.slow
def test_a_head_sharded_by_the_rank_inside_ddp_fails_under_torchrun_and_its_twin_runs(torchrun):
    # blind set bm's 05: a class-parallel margin head (partial FC) built into the wrapped model
    assert_broken_fails_and_twin_runs(
        torchrun,
        SCRIPTS / "class_sharded_head_inside_ddp.py",
        "appears not to match sizes of the same param in process 0",
        SCRIPTS / "correct_class_sharded_head_outside_ddp.py",
        "trained",
    )


SHARDED_HEAD = """
class Head(nn.Module):
    def __init__(self, d, classes):
        super().__init__()
        rank, world = dist.get_rank(), dist.get_world_size()
        self.num_local = classes // world + (1 if rank < classes % world else 0)
        self.weight = nn.Parameter(torch.empty(self.num_local, d))
        self.bias = nn.Linear(d, {out})

    def forward(self, x):
        return self.bias(x) + x @ self.weight.t()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = Head(8, 10)

    def forward(self, x):
        return self.head(x)


{wrap}
"""


@pytest.mark.parametrize(
    "out, wrap, reported",
    [
        ("8", "model = DDP(Net())", [7]),
        ("self.num_local", "model = DDP(Net())", [7, 8]),
        # kept outside DDP (partial FC), or sized alike on every rank
        ("8", "backbone = DDP(nn.Linear(8, 8))\nhead = Head(8, 10)", []),
    ],
    ids=["parameter", "and-a-layer", "outside-ddp"],
)
def test_a_parameter_sized_by_the_rank_in_a_module_ddp_wraps(out, wrap, reported):
    assert reported_lines(SHARDED_HEAD.format(out=out, wrap=wrap)) == reported


def test_a_parameter_sized_alike_on_every_rank_is_quiet():
    body = SHARDED_HEAD.format(out="8", wrap="model = DDP(Net())").replace(
        "classes // world + (1 if rank < classes % world else 0)", "classes"
    )
    assert reported_lines(body) == []


def test_a_low_rank_layers_rank_is_a_size_not_a_process():
    # blind set ae's 20: DCN-v2's cross layer factorised through `rank=64`
    body = """
class CrossLayer(nn.Module):
    def __init__(self, d, rank=64):
        super().__init__()
        self.U = nn.Linear(d, rank, bias=False)
        self.V = nn.Linear(rank, d)

    def forward(self, x):
        return self.V(self.U(x))


model = DDP(CrossLayer(32))
"""
    assert reported_lines(body) == []


FACTORISED = """
from dataclasses import dataclass


@dataclass
class Config:
    rank: int = 1000


class ComplEx(nn.Module):
    def __init__(self, n_ent, rank):
        super().__init__()
        self.ent = nn.Embedding(n_ent, 2 * rank)

    def forward(self, h):
        return self.ent(h)


dist.init_process_group("nccl")
cfg = Config()
model = DDP(ComplEx(40943, RANK_GIVEN))
"""


@pytest.mark.parametrize(
    "given, reported",
    [
        ("cfg.rank", []),  # blind set ca's 03: a knowledge-graph embedding's rank, 1000
        ("500", []),
        ("dist.get_rank()", [13]),  # the process's rank after all
    ],
)
def test_a_rank_every_construction_gives_a_size_is_a_size(given, reported):
    assert reported_lines(FACTORISED.replace("RANK_GIVEN", given)) == reported


NESTED_LOW_RANK = """
class CrossLayer(nn.Module):
    def __init__(self, d, rank=None):
        super().__init__()
        if rank:
            self.U = nn.Linear(d, rank, bias=False)
            self.V = nn.Linear(rank, d)
        else:
            self.U, self.V = None, nn.Linear(d, d)

    def forward(self, x0, x):
        return x0 * (self.V(self.U(x)) if self.U is not None else self.V(x)) + x


class DCN(nn.Module):
    def __init__(self, d, n_cross=3, low_rank=LOW_RANK):
        super().__init__()
        self.cross = nn.ModuleList([CrossLayer(d, low_rank) for _ in range(n_cross)])

    def forward(self, x0):
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        return x


dist.init_process_group("nccl")
model = DDP(DCN(64))
"""


@pytest.mark.parametrize("default, reported", [("64", []), ("dist.get_rank()", [6, 7])])
def test_a_rank_given_the_outer_modules_parameter_is_that_parameters_size(default, reported):
    # blind set dn's 12: DCN-v2 hands each cross layer its own `low_rank=64`
    assert reported_lines(NESTED_LOW_RANK.replace("LOW_RANK", default)) == reported


def test_a_size_read_where_the_model_is_built_is_not_another_functions_name():
    # blind set ca's 10: an evaluation helper's `rels` (gathered from the ranks' shares)
    # is not main's `rels` (read from a file) that sizes the model
    body = """
class Scorer(nn.Module):
    def __init__(self, n_rel, dim):
        super().__init__()
        self.rel = nn.Embedding(n_rel, dim)
def evaluate(triples):
    rank, world = dist.get_rank(), dist.get_world_size()
    rels = triples[rank::world]
    return rels
def main(path):
    dist.init_process_group("nccl")
    rels = open(path).read().split()
    model = Scorer(len(rels), 32)
    model = DDP(model)
"""
    assert reported_lines(body) == []
    # the same name read from this rank's share where the model is built: reported
    shared = body.replace(
        "    rels = open(path).read().split()",
        "    rels = open(path).read().split()[dist.get_rank()::8]",
    )
    assert reported_lines(shared) == [13]


HELPER_LOADERS = """
class Net(nn.Module):
    def __init__(self, n_classes):
        super().__init__()
        self.fc = nn.Linear(8, n_classes)

    def forward(self, x):
        return self.fc(x)


def build_loaders(root, world, rank):
    train_ds = ImageFolder(root)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank)
    return CUT, DataLoader(train_ds, sampler=sampler)


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    train_ds, loader = build_loaders("/data", world, rank)
    classes = train_ds.classes
    model = timm.create_model("resnet50", num_classes=len(classes))
    model = DDP(model)


main()
"""


@pytest.mark.parametrize(
    "cut, reported",
    [
        ("train_ds", []),  # blind set ec's 06: the rank goes to the sampler only
        ("Subset(train_ds, range(rank, len(train_ds), world))", [23]),
    ],
)
def test_a_helper_that_hands_the_rank_to_a_sampler_returns_the_whole_dataset(cut, reported):
    assert reported_lines(HELPER_LOADERS.replace("CUT", cut)) == reported


SET_BROKEN = SCRIPTS / "modules_registered_in_a_sets_order.py"
SET_FIXED = SCRIPTS / "correct_modules_registered_in_sorted_order.py"


@pytest.mark.slow
def test_modules_registered_in_a_sets_order_fail_under_torchrun_and_sorted_ones_run(torchrun):
    # each process salts string hashes its own way: 7 keys in one order on both ranks
    # has a chance of about 1 in 5,000
    assert_broken_fails_and_twin_runs(
        torchrun, SET_BROKEN, "appears not to match sizes of the same param", SET_FIXED, "trained"
    )


SET_ORDER_MODEL = """
class Heads(nn.Module):
    def __init__(self, tasks, width=8):
        super().__init__()
        REGISTER
    def forward(self, x):
        return x
WALKED
model = DDP(Heads(given))
"""


@pytest.mark.parametrize(
    ("register", "walked", "given", "reported"),
    [
        # blind set ew's 10: a ModuleDict over a set comprehension of the keys
        ("self.heads = nn.ModuleDict({t: nn.Linear(width, 2) for t in tasks})",
         "keys = {k for k in names if k}", "keys", [5]),
        # blind set e's 12: a list made from a set, then a list of its sizes
        ("self.embs = nn.ModuleList([nn.Embedding(c, 4) for c in tasks])",
         "cols = list(set(columns) - {'target'})\ncards = [len(c) for c in cols]", "cards", [5]),
        # blind set bz's 12: a dict made walking a set, registered in a loop over its items
        (("self.heads = nn.ModuleDict()\n        for t, n in tasks.items():\n"
          "            self.heads[t] = nn.Linear(width, n)"),
         "active = set(requested) & set(REGISTRY)", "{t: REGISTRY[t] for t in active}", [7]),
        # sorted, or a list the file orders itself: every rank walks it alike
        ("self.heads = nn.ModuleDict({t: nn.Linear(width, 2) for t in tasks})",
         "keys = sorted({k for k in names if k})", "keys", []),
        ("self.heads = nn.ModuleDict({t: nn.Linear(width, 2) for t in tasks})",
         "keys = [k for k in names if k]", "keys", []),
        # a set walked only to read, not to register modules
        ("self.count = sum(1 for t in tasks)", "keys = {k for k in names if k}", "keys", []),
        # blind set ix's 06: __init__ walks a set it makes of the list it is given
        (("self.heads = nn.ModuleDict()\n        for t in set(tasks):\n"
          "            self.heads[t] = nn.Linear(width, 1)"),
         "keys = ['U0', 'gap']", "keys", [7]),
        (("self.heads = nn.ModuleDict()\n        for t in sorted(set(tasks)):\n"
          "            self.heads[t] = nn.Linear(width, 1)"),
         "keys = ['U0', 'gap']", "keys", []),
    ],
)  # fmt: skip
def test_modules_registered_walking_a_set_of_strings(register, walked, given, reported):
    body = (
        SET_ORDER_MODEL.replace("REGISTER", register)
        .replace("WALKED", walked)
        .replace("given", given)
    )
    assert reported_lines(body) == reported


def test_a_launch_that_fixes_the_hash_salt_walks_sets_alike():
    body = (
        SET_ORDER_MODEL.replace(
            "REGISTER", "self.heads = nn.ModuleDict({t: nn.Linear(width, 2) for t in tasks})"
        )
        .replace("WALKED", "keys = {k for k in names if k}")
        .replace("given", "keys")
    )
    assert (
        reported_lines('"""PYTHONHASHSEED=0 torchrun --nproc_per_node=8 train.py"""\n' + body) == []
    )


# Blind set hv's 03: a random search whose configuration every rank draws for itself,
# after seeding its generators with its rank for augmentation streams of their own.
RANDOM_SEARCH = """
import random

def sample_config(space):
    return {"depth": random.choice(space["depth"]), "lr": 10 ** random.uniform(-4, -2)}

def run_trial(cfg, rank):
    model = DDP(nn.Sequential(*[nn.Linear(64, 64) for _ in range(cfg["depth"])]))
    return 0.5

def main():
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    random.seed(0 + rank)
    for trial in range(20):
        cfg = sample_config({"depth": [2, 4, 8]})
        run_trial(cfg, rank)

main()
"""


@pytest.mark.slow
def test_ranks_that_draw_their_own_configuration_build_different_models(torchrun):
    # the fixture pair under torchrun: seeded 1 and 2, the ranks draw depths 2 and 1
    assert_broken_fails_and_twin_runs(
        torchrun,
        SCRIPTS / "configuration_drawn_after_seeding_with_the_rank.py",
        "DDP expects same model across all ranks",
        SCRIPTS / "correct_configuration_drawn_on_rank_zero_and_broadcast.py",
        "trained depth 2",
    )


def test_a_configuration_each_rank_draws_for_the_model_ddp_wraps_is_reported():
    assert reported_lines(RANDOM_SEARCH) == [16]
    unseeded = RANDOM_SEARCH.replace("    random.seed(0 + rank)\n", "")
    assert reported_lines(unseeded) == [15]


@pytest.mark.parametrize(
    "old, new",
    [
        # one seed on every rank: the same draws everywhere
        ("random.seed(0 + rank)", "random.seed(0)"),
        # drawn by rank 0 and shared
        (
            "        run_trial(cfg, rank)",
            (
                "        box = [cfg]\n        dist.broadcast_object_list(box, src=0)\n"
                "        run_trial(box[0], rank)"
            ),
        ),
        # numpy seeded with the rank: Python's generator the draws read is not
        ("random.seed(0 + rank)", "np.random.seed(0 + rank)\n    random.seed(0)"),
        # the draw goes to no model
        ("        run_trial(cfg, rank)", "        print(cfg)"),
    ],
    ids=["common seed", "broadcast", "other library seeded", "no model"],
)
def test_a_configuration_drawn_alike_shared_or_building_nothing_is_quiet(old, new):
    assert old in RANDOM_SEARCH
    assert reported_lines(RANDOM_SEARCH.replace(old, new)) == []
