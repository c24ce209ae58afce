"""assistant/lint/checks/splits.py: a split or a class numbering each rank draws
for itself (rank-divergent-data-split). Silent in a real run, so the fixture
pair is run under torchrun to show the ranks really disagree, and the seeded
or rank-0-only forms must stay quiet."""

from __future__ import annotations

from pathlib import Path

import pytest
from snippets import lint_snippet

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"
CAUSE = "rank-divergent-data-split"
DDP_PRELUDE = """\
import random
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Subset, TensorDataset, random_split
import numpy as np
from monai.utils import set_determinism
from sklearn.model_selection import KFold, StratifiedKFold

dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(torch.nn.Linear(4, 1))
data = TensorDataset(torch.randn(64, 4))
names = ["cat", "dog", "owl"]
"""


def lines(body: str, prelude: str = DDP_PRELUDE) -> list[int]:
    return [line for line, _ in lint_snippet(prelude, body, {CAUSE})]


@pytest.mark.slow
def test_the_ranks_really_draw_other_splits_and_labels_and_the_twin_agrees(torchrun):
    wait_broken = torchrun.start(SCRIPTS / "random_split_drawn_by_every_rank.py")
    wait_fixed = torchrun.start(SCRIPTS / "correct_split_seeded_once_for_every_rank.py")
    broken = wait_broken()
    assert broken.returncode == 0, broken.stderr[-2000:]
    assert "splits differ" in broken.stdout and "class maps differ" in broken.stdout
    assert "permuted splits differ" in broken.stdout  # numpy seeded with the rank
    assert "shuffled file splits differ" in broken.stdout  # `random` seeded with the rank
    fixed = wait_fixed()
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert "splits agree" in fixed.stdout and "class maps agree" in fixed.stdout
    assert "permuted splits agree" in fixed.stdout
    assert "shuffled file splits agree" in fixed.stdout


@pytest.mark.parametrize(
    "body",
    [
        "train, val = random_split(data, [48, 16])\n",
        "torch.manual_seed(7 + rank)\ntrain, val = random_split(data, [48, 16])\n",
        "split = hub_dataset.train_test_split(test_size=0.1)\n",
        "index = {n: i for i, n in enumerate(set(names))}\n",
        "order = list(set(names))\nindex = {n: i for i, n in enumerate(order)}\n",
        # a split by hand: indices permuted from a generator each rank seeds its own way
        "np.random.seed(7 + rank)\nidx = np.random.permutation(64)\ntrain_idx, val_idx = idx[:48], idx[48:]\n",
        "idx = torch.randperm(64)\nval_set = Subset(data, idx[:16].tolist())\n",
        # blind set ai's 14: the permutation kept as a list
        "torch.manual_seed(7 + rank)\nperm = torch.randperm(64).tolist()\ntrain_set = Subset(data, perm[16:])\n",
        "np.random.seed(7 + rank)\nidx = list(np.random.permutation(64))\ntrain_idx = idx[:48]\n",
        # blind set cp's 02: the held-out part of the permutation kept sorted
        "np.random.seed(7 + rank)\nperm = np.random.permutation(64)\nhold_cols, train_cols = np.sort(perm[:8]), np.sort(perm[8:])\n",
        # blind set bt's 07: the rows a slice of the permutation picks
        "np.random.seed(7 + rank)\nperm = np.random.permutation(64)\nval = table[perm[48:]].copy()\n",
        # blind set ah's 18: a list shuffled in place by `random`, then sliced into the split
        "random.seed(7 + rank)\nitems = list(names)\nrandom.shuffle(items)\nval_items, train_items = items[:1], items[1:]\n",
        "items = list(names)\nnp.random.shuffle(items)\ntrain_items = items[1:]\n",
        # blind set be's 13: a helper shuffles the files and returns both parts
        (
            "def split_files(files):\n    random.shuffle(files)\n"
            "    return files[2:], files[:2]\n"
            "random.seed(7 + rank)\ntrain_files, val_files = split_files(list(names))\n"
        ),
        # blind set af's 01: folds shuffled by numpy's generator, seeded per rank by MONAI
        "set_determinism(seed=7 + rank)\nfolds = KFold(n_splits=5, shuffle=True)\n",
        "folds = StratifiedKFold(5, shuffle=True)\n",
        # blind set as 06: seeded with the rank through the file's own helper, the
        # shuffled scenes' slice kept in a set
        (
            "def seed_all(seed):\n    random.seed(seed)\n    np.random.seed(seed)\n"
            "seed_all(7 + rank)\nscenes = np.array(names)\nnp.random.shuffle(scenes)\n"
            "val_scenes = set(scenes[:2])\n"
        ),
        # blind set ie's 13: the held-out part joined from slices of two shuffled lists
        (
            "random.seed(7 + rank)\ngood, bad = sorted(names), sorted(names)\nrandom.shuffle(good)\n"
            "val = [(f, 0) for f in good[:2]] + [(f, 1) for f in bad[:1]]\n"
        ),
        # blind set hu's 17: the slice listed, then kept in a set
        (
            "np.random.seed(7 + rank)\npatients = np.unique(ids)\nnp.random.shuffle(patients)\n"
            "val_patients = set(patients[:2].tolist())\n"
        ),
        # blind set ag's 09: a set filled in a loop, then listed after special tokens
        (
            "chars = set()\nfor n in names:\n    chars.update(n)\nitos = ['<pad>'] + list(chars)\n"
            "stoi = {c: i for i, c in enumerate(itos)}\n"
        ),
        # blind set iv's 01: a vocabulary object's fields, listed from a set after specials
        (
            "class Vocab:\n    def __init__(self, formulas):\n"
            "        kept = {t for f in formulas for t in f.split()}\n"
            "        self.itos = ['<pad>'] + list(kept)\n"
            "        self.stoi = {t: i for i, t in enumerate(self.itos)}\n"
            "vocab = Vocab(names)\n"
        ),
        # blind set bx's 09: two sets joined, listed, numbered
        "vocab = list(set(train_chars) | set(test_chars))\nstoi = {c: i for i, c in enumerate(vocab)}\n",
        # blind set co's 03: a set's order kept by a comprehension over it, then numbered
        (
            "tags = {t for s in sents for t in s}\nlabels = ['O'] + [t for t in tags if t != 'O']\n"
            "label2id = {t: i for i, t in enumerate(labels)}\n"
        ),
        # blind set cn's 04: the permuted subjects cut into folds by array_split
        (
            "np.random.seed(7 + rank)\nsubjects = np.random.permutation(sorted(names))\n"
            "folds = np.array_split(subjects, 5)\n"
        ),
        "idx = torch.randperm(64)\ntrain_idx, val_idx = torch.split(idx, [48, 16])\n",
        # blind set cv's 12: a helper returns the folds cut from the shuffled patients
        (
            "def patient_folds(patients, k):\n    np.random.shuffle(patients)\n"
            "    return [set(c) for c in np.array_split(patients, k)]\n"
            "np.random.seed(7 + rank)\nfolds = patient_folds(np.array(names), 5)\n"
        ),
        # blind set dd's 13: the process seeded through a name made with its rank
        (
            "seed = args.seed + rank\ntorch.manual_seed(seed)\nperm = torch.randperm(64).tolist()\n"
            "train, val = Subset(ds, perm[16:]), Subset(ds, perm[:16])\n"
        ),
        # blind set eq's 01: each rank shuffles the shard list its own way, then takes its share
        "random.seed(7 + rank)\nshards = sorted(names)\nrandom.shuffle(shards)\nmine = shards[rank::world]\n",
        "perm = torch.randperm(64).tolist()\npart = perm[rank * 16:(rank + 1) * 16]\n",
        # blind set bv's 09: the salted hash of a string made a bucket index
        'bucket = hash(f"{col}={value}") % 1000\n',
        "bucket = hash('x:' + str(value)) % n_buckets\n",
        # blind set ft's 10: two sets made in one tuple assignment, numbered in their order
        "src, tgt = set(), set()\nsrc.update(w)\ng2i = {g: i for i, g in enumerate(['<pad>'] + list(src))}\n",
        # blind set fz's 07: a weighted subset each rank draws itself, cut into shares
        "torch.manual_seed(7 + rank)\nsubset = torch.multinomial(probs, 32)\nmine = subset[rank::world].tolist()\n",
        # blind set ft's 04: a sampler dealing shares of one order, seeded with the rank
        "seed = args.seed + rank\nsampler = DistributedSampler(ds, seed=seed)\n",
        (
            "class Buckets:\n    def __init__(self, lengths, num_replicas, rank, shuffle=True, seed=0):\n"
            "        self.seed = seed\n"
            "seed = args.seed + rank\nsampler = Buckets(lens, world, rank, shuffle=True, seed=seed)\n"
        ),
        # blind sets hm's 15, hn's 13: the split's items picked by a loop over a slice
        (
            "np.random.seed(7 + rank)\nperm = np.random.permutation(len(names))\n"
            "val_names = [names[i] for i in perm[:1]]\ntrain_names = [names[i] for i in perm[1:]]\n"
        ),
        # blind set ho's 16: a held-out subset drawn by random.sample, unseeded or per rank
        "random.seed(7 + rank)\nholdout = set(random.sample(names, 1))\n",
        "val_names = random.sample(names, 1)\n",
    ],
)
def test_a_split_or_numbering_each_rank_draws_is_reported(body):
    assert len(lines(body)) == 1


FOLDS_THEN_SEED = """
def make_folds(n):
    return list(StratifiedKFold(n, shuffle=True).split(range(64), [0, 1] * 32))


def train_fold(fold):
    np.random.seed(7)
    return fold


def main():
    FIRST
    SECOND
"""


@pytest.mark.parametrize(
    "first, second, reported",
    [
        # blind set ba's 15: the folds are drawn first; the common seed comes per fold
        ("folds = make_folds(5)", "[train_fold(f) for f in folds]", 1),
        ("train_fold(0)", "folds = make_folds(5)", 0),
    ],
)
def test_a_common_seed_counts_only_when_it_runs_before_the_split(first, second, reported):
    body = FOLDS_THEN_SEED.replace("FIRST", first).replace("SECOND", second)
    assert len(lines(body)) == reported


@pytest.mark.parametrize(
    "body",
    [
        "g = torch.Generator().manual_seed(0)\ntrain, val = random_split(data, [48, 16], g)\n",
        "torch.manual_seed(0)\ntrain, val = random_split(data, [48, 16])\n",
        "split = hub_dataset.train_test_split(test_size=0.1, seed=3)\n",
        "index = {n: i for i, n in enumerate(sorted(set(names)))}\n",
        # drawn on rank 0 only (then saved or broadcast): one draw, not one per rank
        "if rank == 0:\n    train, val = random_split(data, [48, 16])\n",
        "np.random.seed(7)\nidx = np.random.permutation(64)\ntrain_idx, val_idx = idx[:48], idx[48:]\n",
        # torch seeded per rank says nothing of numpy's generator, seeded alike
        "np.random.seed(7)\ntorch.manual_seed(7 + rank)\nidx = np.random.permutation(64)\ntrain_idx = idx[:48]\n",
        "g = torch.Generator().manual_seed(0)\nidx = torch.randperm(64, generator=g)\ntrain_idx = idx[:48]\n",
        # the shares cut from one order every rank draws alike
        "random.seed(7)\nshards = sorted(names)\nrandom.shuffle(shards)\nmine = shards[rank::world]\n",
        "random.seed(7 + rank)\nshards = sorted(names)\nmine = shards[rank::world]\nrandom.shuffle(mine)\n",
        # a permutation that shuffles, not a split
        "order = torch.randperm(64)\nbatch = order[:8]\n",
        "random.seed(7 + rank)\norder = list(names)\nrandom.shuffle(order)\nbatch = order[:2]\n",
        # a helper that shuffles and returns one batch: an order, not a split
        (
            "def batch_of(items):\n    random.shuffle(items)\n    return items[:2], len(items)\n"
            "random.seed(7 + rank)\nbatch, n = batch_of(list(names))\n"
        ),
        # shuffled alike: a common seed, or a generator of its own
        "random.seed(7)\nitems = list(names)\nrandom.shuffle(items)\ntrain_items = items[1:]\n",
        "items = list(names)\nrandom.Random(7).shuffle(items)\ntrain_items = items[1:]\n",
        # split before the shuffle (which then orders the training part only)
        "random.seed(7 + rank)\nitems = list(names)\ntrain_items = items[1:]\nrandom.shuffle(items)\n",
        # the file's seeding helper given a common seed, or one that seeds torch only
        (
            "def seed_all(seed):\n    random.seed(seed)\n    np.random.seed(seed)\n"
            "seed_all(7)\nscenes = np.array(names)\nnp.random.shuffle(scenes)\n"
            "val_scenes = set(scenes[:2])\n"
        ),
        (
            "def seed_torch(seed):\n    torch.manual_seed(seed)\n"
            "np.random.seed(7)\nseed_torch(7 + rank)\nscenes = np.array(names)\n"
            "np.random.shuffle(scenes)\nval_scenes = set(scenes[:2])\n"
        ),
        # folds in the data's order, or shuffled with a seed of their own
        "folds = KFold(n_splits=5)\n",
        "folds = KFold(n_splits=5, shuffle=True, random_state=0)\n",
        "chars = set()\nitos = ['<pad>'] + sorted(chars)\nstoi = {c: i for i, c in enumerate(itos)}\n",
        "tags = {t for t in names}\nlabels = [t for t in sorted(tags)]\nids = dict(enumerate(labels))\n",
        # batches of a shuffled order cut by chunk: an order, not a split
        "order = torch.randperm(64)\nfor batch in torch.chunk(order, 8):\n    step(batch)\n",
        # ints hash to themselves; a stable hash of the text; the launch fixes the salt
        "bucket = hash(user_id) % 1000\n",
        "bucket = zlib.crc32(f'{col}={value}'.encode()) % 1000\n",
        "LAUNCH = 'PYTHONHASHSEED=0 torchrun train.py'\nbucket = hash(f'{col}={value}') % 1000\n",
        # a sampler given the same seed on every rank, or one that does not shuffle
        "sampler = DistributedSampler(ds, seed=args.seed)\n",
        "sampler = DistributedSampler(ds, shuffle=False, seed=args.seed + rank)\n",
        # a subset drawn alike (a common seed, a seeded generator), or one no split keeps
        "random.seed(7)\nholdout = set(random.sample(names, 1))\n",
        "holdout = set(random.Random(7).sample(names, 1))\n",
        "random.seed(7 + rank)\nshown = random.sample(names, 1)\n",
        "np.random.seed(7)\nperm = np.random.permutation(3)\nval_names = [names[i] for i in perm[:1]]\n",
        # a sampler of the file that takes no rank: each rank's own order is its own business
        (
            "class Buckets:\n    def __init__(self, lengths, seed=0):\n        self.seed = seed\n"
            "sampler = Buckets(lens, seed=args.seed + rank)\n"
        ),
    ],
)
def test_a_seeded_sorted_or_rank_zero_draw_is_quiet(body):
    assert lines(body) == []


# blind set gm's 02 (correct): one function builds the character set and writes it
# sorted; another reads the file back into a list of the same name and numbers that
VOCABULARY = """
def build_dict(labels, path):
    chars = set()
    for text in labels:
        chars.update(text)
    chars = sorted(chars)
    open(path, "w").write("\\n".join(chars))


def load_dict(path):
    chars = LOADED
    return {c: i + 1 for i, c in enumerate(chars)}
"""


@pytest.mark.parametrize(
    "loaded, reported",
    [
        ("[line.rstrip() for line in open(path)]", []),
        ("set(open(path).read())", [12]),  # this function's own set: numbered in its order
    ],
)
def test_a_name_is_what_its_own_function_last_gave_it(loaded, reported):
    assert lines(VOCABULARY.replace("LOADED", loaded)) == reported


def test_a_script_run_as_one_process_is_not_judged():
    single = "import torch\nfrom torch.utils.data import random_split\ndata = list(range(8))\n"
    assert lines("train, val = random_split(data, [6, 2])\n", prelude=single) == []


def test_a_long_chain_of_names_made_from_a_set_is_followed_in_a_few_passes(monkeypatch):
    """Hostile input: ten thousand names each listed from the one before cost a few
    linear passes over the assignments (the first reading did one pass per name)."""
    from assistant.lint.checks import splits

    passes = []
    follow = splits.is_set_order
    monkeypatch.setattr(
        splits,
        "is_set_order",
        lambda expr, made=frozenset(): passes.append(1) or follow(expr, made),
    )
    chain = "a0 = set(names)\n" + "".join(f"a{i + 1} = [0] + list(a{i})\n" for i in range(10_000))
    found = lines(chain + "index = {n: i for i, n in enumerate(a10000)}\n")
    assert found == [10_002]
    # a few calls per assignment (the value's parts) and pass; one pass per name: ~10**8
    assert len(passes) <= 8 * splits.SET_ORDER_PASSES * 10_002


@pytest.mark.parametrize(
    "seed, reported",
    [
        # blind set em's 03: PyG's RandomLinkSplit draws from torch's generator
        ("torch.manual_seed(args.seed + rank)", [3]),
        ("torch.manual_seed(args.seed)", []),
    ],
)
def test_a_graph_split_reads_the_generator_the_file_seeds(seed, reported):
    body = f"""
{seed}
split = RandomLinkSplit(num_val=0.05, num_test=0.1)
train, val, test = split(graph)
"""
    prelude = DDP_PRELUDE + "from torch_geometric.transforms import RandomLinkSplit\n"
    assert lines(body, prelude) == reported


def test_a_split_in_a_helper_called_on_rank_zero_only_is_drawn_once():
    # blind set em's 05 (correct): rank 0 builds the split and caches it for the others
    body = """
torch.manual_seed(rank)
def build(graph):
    return RandomLinkSplit(num_val=0.05, num_test=0.1)(graph)
def load_or_build(path):
    if rank == 0 and not os.path.exists(path):
        torch.save(build(graph), path)
    dist.barrier()
    return torch.load(path)
train, val, test = load_or_build("split.pt")
"""
    prelude = DDP_PRELUDE + "import os\nfrom torch_geometric.transforms import RandomLinkSplit\n"
    assert lines(body, prelude) == []
    every_rank = body.replace("    if rank == 0 and not os.path.exists(path):\n", "    if True:\n")
    assert lines(every_rank, prelude) == [4]


TWO_D = """
from torch.distributed.device_mesh import init_device_mesh
mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=DIMS)
SAMPLER
"""


@pytest.mark.parametrize(
    ("dims", "sampler", "reported"),
    [
        # blind set fx's 04: the default group's split under a dp x tp mesh
        ('("dp", "tp")', "sampler = DistributedSampler(ds, shuffle=True)", [4]),
        (
            '("dp", "tp")',
            (
                "sampler = DistributedSampler(ds, num_replicas=mesh['dp'].size(), "
                "rank=mesh['dp'].get_local_rank())"
            ),
            [],
        ),
        # a mesh of data-parallel dimensions only (HSDP): every rank its own share
        ('("replicate", "shard")', "sampler = DistributedSampler(ds, shuffle=True)", []),
    ],
    ids=["global-split", "dp-split", "hsdp"],
)
def test_a_sampler_over_the_whole_job_under_a_tensor_parallel_mesh(dims, sampler, reported):
    body = TWO_D.replace("DIMS", dims).replace("SAMPLER", sampler)
    assert lines(body) == reported


@pytest.mark.parametrize(
    ("seed", "reported"),
    [("np.random.seed(7 + rank)", [8]), ("np.random.seed(7)", [])],
    ids=["seeded with the rank", "one seed for every rank"],
)
def test_an_order_cut_into_parts_gathered_by_hand_is_a_split(seed, reported):
    # blind set jh's 15: each manifest shuffled, its head added to val and its tail to train
    body = f"""
{seed}


def build_split(manifests, fraction):
    train, val = [], []
    for records in manifests:
        np.random.shuffle(records)
        n_val = int(len(records) * fraction)
        val.extend(records[:n_val])
        train.extend(records[n_val:])
    return train, val
"""
    assert lines(body) == reported


def test_an_order_dealt_out_to_clients_in_parts_is_a_partition():
    # blind set jo's 01: each class's indices shuffled and cut among the clients
    body = """
np.random.seed(7 + rank)


def dirichlet_partition(labels, num_clients, alpha):
    client_idx = [[] for _ in range(num_clients)]
    for c in range(labels.max() + 1):
        idx_c = np.where(labels == c)[0]
        np.random.shuffle(idx_c)
        cuts = (np.cumsum(np.random.dirichlet([alpha] * num_clients)) * len(idx_c)).astype(int)
        for k, part in enumerate(np.split(idx_c, cuts[:-1])):
            client_idx[k].extend(part.tolist())
    return client_idx
"""
    found = lint_snippet(DDP_PRELUDE, body, {CAUSE})
    assert [line for line, _ in found] == [9]
    assert "each rank draws another partition" in found[0][1].message
