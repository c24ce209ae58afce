"""assistant/lint/checks/gather_sizes.py: where the rows of an all_gathered tensor come
from. Only what the scope assigns before the gather counts, and a model's call takes
its rows from its input, not from how the model was built (blind set ap: out-of-fold
predictions gathered under a DistributedSampler were read as rank-sized twice)."""

from __future__ import annotations

import pytest
from snippets import lint_snippet

PRELUDE = """\
import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler
"""
SCORES = """
def scores(model, loader, world):
    keys, probs = [], []
    for k, x in loader:
        keys.append(k)
        probs.append(model(x))
    keys, probs = torch.cat(keys), torch.cat(probs)
    all_keys = [torch.empty_like(keys) for _ in range(world)]
    dist.all_gather(all_keys, keys)
    keys = torch.cat(all_keys).numpy()
    keys, first = np.unique(keys, return_index=True)
    return keys


def main(frame, test_ds):
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    vocab = {v: i for i, v in enumerate(sorted(frame["merchant"].unique()))}
    model = torch.nn.Embedding(len(vocab) + 1, 8)
    loader = DataLoader(test_ds, batch_size=256, sampler=DistributedSampler(test_ds))
    return scores(model, loader, world)
"""


def reported(body: str) -> list[int]:
    return [line for line, _ in lint_snippet(PRELUDE, body, {"collective-mismatch"})]


def test_a_name_made_unique_after_the_gather_and_a_model_sized_by_a_vocabulary_are_quiet():
    assert reported(SCORES) == []


def test_rows_made_unique_before_the_gather_are_still_rank_sized():
    unique_first = SCORES.replace(
        "    keys, probs = torch.cat(keys), torch.cat(probs)\n",
        "    keys, probs = torch.cat(keys), torch.cat(probs)\n    keys = torch.unique(keys)\n",
    )
    assert reported(unique_first) == [10]


MASKED = """
def pseudo_labels(probs, world):
    confidence, labels = probs.max(1)
    keep = MASK
    kept = labels[keep]
    out = [torch.zeros_like(kept) for _ in range(world)]
    dist.all_gather(out, kept)
    return torch.cat(out)
"""


def test_rows_a_mask_made_first_selects_are_rank_sized():
    # blind set ax: confident pseudo-labels kept through a mask named before its use
    for mask in ("confidence >= 0.9", "~(confidence < 0.9)", "confidence.ge(0.9) & (labels > 0)"):
        assert reported(MASKED.replace("MASK", mask)) == [7], mask


def test_rows_a_mask_the_files_function_returns_selects_are_rank_sized():
    # blind set ie's 12: the foreground patches a helper's threshold keeps
    helper = "def foreground(x, thr):\n    return x.mean(1) > thr\n\n"
    body = helper + MASKED.replace("MASK", "foreground(probs, 0.5)")
    assert reported(body) == [10]
    index_helper = "def foreground(x, thr):\n    return torch.arange(len(x))\n\n"
    assert reported(index_helper + MASKED.replace("MASK", "foreground(probs, 0.5)")) == []


def test_rows_an_index_tensor_selects_are_not_read_as_a_mask():
    assert reported(MASKED.replace("MASK", "torch.arange(len(labels))")) == []


SAMPLER_POSITIONS = """
def soft_labels(model, dataset, indices, world):
    sampler = DistributedSampler(Subset(dataset, indices), shuffle=False)
    pos = POSITIONS
    out = [torch.empty_like(pos) for _ in range(world)]
    dist.all_gather(out, pos)
    return torch.cat(out)


def main(dataset, labels, world):
    kept = np.where(labels == 3)[0]
    return soft_labels(None, dataset, kept, world)
"""


def test_a_distributed_samplers_own_indices_are_the_same_count_on_every_rank():
    # blind set ax: the positions a DistributedSampler hands this rank, gathered
    # with the probabilities, read as rank-sized through the subset it samples
    body = "from torch.utils.data import Subset\n" + SAMPLER_POSITIONS
    assert reported(body.replace("POSITIONS", "torch.tensor(list(sampler))")) == []
    assert reported(body.replace("POSITIONS", "torch.as_tensor(indices)")) == [7]


def test_a_numpy_arange_strided_by_rank_is_a_share_of_its_own_size():
    # blind set ds's 20: validation series dealt out with np.arange(rank, n, world)
    body = """
def validate(y, rank, world):
    rows = np.arange(rank, len(y), world)
    local = torch.from_numpy(y[rows].sum(1))
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    return torch.cat(gathered)
"""
    assert reported(body) == [6]
    assert reported(body.replace("np.arange(rank, len(y), world)", "np.arange(len(y))")) == []


FINISHED = """
def gather_returns(returns, world):
    t = torch.tensor(returns)
    buckets = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(buckets, t)
    return torch.cat(buckets)


def main(envs, policy, steps):
    dist.init_process_group("nccl")
    obs = envs.reset()
    for update in range(100):
        finished = []
        for t in range(steps):
            obs, reward, done, info = envs.step(policy(obs))
            KEPT
        gather_returns(finished, dist.get_world_size())
"""


@pytest.mark.parametrize(
    "kept, reported_lines",
    [
        # blind set dx's 03: the episodes that finished on this rank in this rollout
        ('if "episode" in info:\n                finished.append(info["episode"]["r"])', [5]),
        (
            (
                "for item in info:\n                if item is not None:\n"
                "                    finished.append(item)"
            ),
            [5],
        ),
        ("if t % 10 == 0:\n                finished.append(reward.mean())", []),  # a count
        ("finished.append(reward.mean())", []),  # every step, on every rank
    ],
)
def test_a_list_appended_to_when_the_data_says_has_each_ranks_length(kept, reported_lines):
    assert reported(FINISHED.replace("KEPT", kept)) == reported_lines


def test_a_tensor_of_listed_scalars_picked_from_such_a_list_is_one_size():
    # blind set dm's 05: the last score of a curve only surviving trials extend
    body = FINISHED.replace(
        "        gather_returns(finished, dist.get_world_size())",
        "        score = torch.tensor([finished[-1] if finished else -1.0])\n"
        "        scores = [torch.zeros_like(score) for _ in range(dist.get_world_size())]\n"
        "        dist.all_gather(scores, score)",
    ).replace("KEPT", 'if "episode" in info:\n                finished.append(info["r"])')
    assert reported(body) == []


def test_a_gather_two_checks_reach_is_reported_once():
    # blind set ba's 20: the shape read from the rank (rank_dependent) and the rows
    # read from the data (gather_sizes) are one mistake on one line
    body = """
def predict(X, rank, world):
    local_idx = torch.arange(rank, X.shape[0], world)
    all_idx = [torch.zeros_like(local_idx) for _ in range(world)]
    dist.all_gather(all_idx, local_idx)
    return torch.cat(all_idx)
"""
    assert reported(body) == [5]


@pytest.mark.parametrize(
    "rows, reported_lines",
    [
        ("math.ceil(n_total / world)", []),  # blind set ee's 10: padded to a common size
        # blind set ic's 04 (correct): the block of the whole list's length, rounded up
        ("math.ceil(len(feats_all) / world)", []),
        ("(len(feats_all) + world - 1) // world", []),
        ("x.size(0)", [6]),  # this rank's own rows, filled in place: its own size
        ("len(x)", [6]),
    ],
)
def test_a_buffer_allocated_at_a_common_size_then_filled_in_place(rows, reported_lines):
    body = f"""
def pad_gather(x, n_total, world):
    padded = torch.zeros({rows}, x.size(1))
    padded[: x.size(0)] = x
    bufs = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(bufs, padded)
    return torch.cat(bufs)


def main(feats, rank, world):
    dist.init_process_group("nccl")
    mine = feats[rank::world]
    pad_gather(mine, len(feats), world)
"""
    assert reported(body) == reported_lines


@pytest.mark.parametrize(
    "picked, reported_lines",
    [
        # blind set em's 08: the k highest negatives of a mask's selection, k on every rank
        ("neg.topk(k).values", []),
        ("neg", [6]),  # the selection itself: each rank's own count
    ],
)
def test_the_top_k_of_a_selection_has_k_rows_on_every_rank(picked, reported_lines):
    body = f"""
def hits(scores, labels, k, world):
    neg = scores[labels == 0]
    top = {picked}
    tops = [torch.empty_like(top) for _ in range(world)]
    dist.all_gather(tops, top)
    return torch.cat(tops).topk(k).values[-1]
"""
    assert reported(body) == reported_lines


FOLD_VALIDATION = """
def gather_cat(t, world):
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    return torch.cat(out)


def run(model, loader, world, epochs):
    for epoch in range(epochs):
        rows, inter = validate(model, loader)
        rows, inter = gather_cat(rows, world), gather_cat(inter, world)
        _, keep = np.unique(rows.cpu().numpy(), return_index=True)
        inter = inter[torch.from_numpy(keep)]
    REVALIDATE
    inter = gather_cat(inter, world)
"""


@pytest.mark.parametrize(
    ("revalidate", "reported_lines"),
    [
        # blind set fu's 02: the rows made unique inside the epoch loop are replaced by a
        # new validation before the last gather
        ("rows, inter = validate(model, loader)", []),
        # nothing replaces them: the last gather takes the deduplicated, rank-sized rows
        ("pass", [4]),
        # blind set am's 06: a statement that reads the name keeps what it held
        ("inter = torch.cat([inter])", [4]),
    ],
    ids=["replaced", "not-replaced", "self-reference"],
)
def test_rows_a_later_statement_replaces_are_not_the_gathered_ones(revalidate, reported_lines):
    body = FOLD_VALIDATION.replace("REVALIDATE", revalidate)
    assert reported(body) == reported_lines


def test_a_strided_share_named_at_each_step_is_followed_to_its_stride():
    # blind set fz's 08: shard -> loader -> batch -> named logits -> list -> cat -> gather
    body = """
def gold(model, dataset, rank, world):
    n = len(dataset)
    shard = list(range(rank, n, world))
    loader = DataLoader(torch.utils.data.Subset(dataset, shard), batch_size=256)
    out = []
    for batch in loader:
        logits = model(**batch).logits.float()
        out.append(logits)
    local = torch.cat(out)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
"""
    assert reported(body) == [12]


MATCH_ERRORS = """
@torch.no_grad()
def match_errors(net, loader):
    errs = []
    for d in loader:
        best = net(d).argmax(2)
        for b in range(best.size(0)):
            j = best[b]
            keep = KEEP
            errs.append((d["kpts0"][b][keep] - d["kpts1"][b][j[keep]]).norm(dim=-1))
    return torch.cat(errs)


def main(net, val_ds, world):
    loader = DataLoader(val_ds, 8, sampler=DistributedSampler(val_ds, shuffle=False))
    local = match_errors(net, loader)
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
"""


@pytest.mark.parametrize(
    "keep, reported_lines",
    [
        # blind set hw's 09: the errors of the matches a mask keeps, per pair,
        # returned by the file's own function and gathered by its caller
        ("j < d['n1'][b]", [18]),
        # every keypoint's error: one row per keypoint of a fixed-size batch
        ("slice(None)", []),
    ],
    ids=["masked matches", "every keypoint"],
)
def test_rows_a_function_of_the_file_keeps_by_a_mask_and_returns_are_rank_sized(
    keep, reported_lines
):
    assert reported(MATCH_ERRORS.replace("KEEP", keep)) == reported_lines


PEAKS = """
def peak_pick(scores, thr):
    keep = scores > thr
    f, c = keep.nonzero(as_tuple=True)
    return RETURNED


def validate(net, halves, world):
    local = []
    for h in halves:
        d = peak_pick(net(h), 0.1)
        local.append(torch.cat([torch.full((len(d), 1), 1.0), d], 1))
    local = torch.cat(local)
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
"""


@pytest.mark.parametrize(
    "returned, reported_lines",
    [
        # blind set ii's 10: each half's peaks, a helper's selection, joined then gathered
        ("torch.stack([f.float(), c.float()], 1) if len(f) else torch.zeros(0, 2)", [15]),
        # the helper hands back a record built from the selection, not a tensor it makes
        ("Peaks(frames=f, classes=c)", []),
        ("f, c", []),  # a tuple: its parts' rows, not one tensor
    ],
    ids=["joined peaks", "a record", "a tuple"],
)
def test_rows_a_helper_selects_joined_along_the_way_are_rank_sized(returned, reported_lines):
    assert reported(PEAKS.replace("RETURNED", returned)) == reported_lines


GENERATED = """
@torch.no_grad()
def evaluate(model, loader, world, n):
    ids, hits = [], []
    for idx, src, labels in loader:
        out = model.generate(input_ids=src, num_beams=4, max_new_tokens=n + 1)
        cand = CAND
        hits.append((cand == labels[:, :n]).all(-1).float())
        ids.append(idx)
    ids, hits = torch.cat(ids), torch.cat(hits)
    g = [torch.empty_like(GATHERED) for _ in range(world)]
    dist.all_gather(g, GATHERED)
"""


@pytest.mark.parametrize(
    "cand, gathered, reported_lines",
    [
        # generated sequences as long as this rank's longest answer
        ("out", "hits", [12]),
        # blind set im's 09 (correct): cut to the length every rank shares, then compared
        ("out[:, 1:n + 1]", "hits", []),
        # the loader's ids, paired with their own value in a tuple assignment
        ("out", "ids", []),
    ],
    ids=["whole generation", "cut to a length", "ids beside hits"],
)
def test_generated_sequences_cut_to_a_common_length_or_other_names_are_not(
    cand, gathered, reported_lines
):
    body = GENERATED.replace("CAND", cand).replace("GATHERED", gathered)
    assert reported(body) == reported_lines


# Blind set iz's 12: a helper of the file scores the users it is handed, a row per user
# joined at its end; main's nested function hands it this rank's strided share of users.
SHARE_HANDED_IN = """
def target_ranks(net, seqs, users):
    out = []
    for b in range(0, len(users), 256):
        x = torch.tensor([seqs[u] for u in users[b : b + 256]])
        out.append(net(x).argmax(1))
    return torch.cat(out)


def main(net, seqs):
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    my_users = USERS

    def gather_ranks():
        local = target_ranks(net, seqs, my_users)
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local)
        return torch.cat(parts)

    return gather_ranks()
"""


@pytest.mark.parametrize(
    ("users", "lines"),
    [
        ("list(range(rank, len(seqs), world))", [18]),
        ("list(range(len(seqs)))", []),  # every rank scores every user
    ],
    ids=["strided share", "every user"],
)
def test_rows_a_helper_collects_over_a_share_it_is_handed(users, lines):
    assert reported(SHARE_HANDED_IN.replace("USERS", users)) == lines


# Blind set ix's 03: per-atom force errors of PyTorch Geometric batches, joined over the
# loader and gathered into buffers like the local tensor.
GRAPH_ERRORS = """
from torch_geometric.loader import DataLoader as GraphLoader


def evaluate(model, val_set, world):
    loader = GraphLoader(val_set, batch_size=16, sampler=DistributedSampler(val_set))
    errs = []
    for data in loader:
        energy, forces = model(data.z, data.pos, data.batch)
        errs.append(ERROR)
    local = torch.cat(errs)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    return torch.cat(gathered)
"""


@pytest.mark.parametrize(
    ("error", "lines"),
    [
        ("(forces - data.forces).norm(dim=-1)", [13]),  # one row per atom
        ("(energy - data.y).abs()", []),  # one row per molecule: the same count on every rank
    ],
    ids=["per atom", "per molecule"],
)
def test_rows_per_node_of_graph_batches_are_rank_sized(error, lines):
    assert reported(GRAPH_ERRORS.replace("ERROR", error)) == lines


@pytest.mark.parametrize(
    ("longest", "lines"),
    [
        # blind set ji's 04: each rank pads its predictions to its own longest batch
        ("max_len = max(p.size(1) for p in preds)", [10]),
        # the longest agreed first: every rank pads to the same length
        (
            (
                "max_len = torch.tensor(max(p.size(1) for p in preds))\n"
                "    dist.all_reduce(max_len, op=dist.ReduceOp.MAX)"
            ),
            [],
        ),
        ("max_len = args.max_seq_len", []),  # a length from the run, the same everywhere
    ],
    ids=["its own longest", "agreed longest", "configured length"],
)
def test_a_tensor_padded_to_the_longest_of_this_ranks_own_items(longest, lines):
    body = f"""
def evaluate(model, loader, world, args):
    preds = []
    for batch in loader:
        preds.append(model(batch["input_ids"]).logits.argmax(-1))
    {longest}
    preds = torch.cat([F.pad(p, (0, max_len - p.size(1)), value=-100) for p in preds])
    gathered = [torch.zeros_like(preds) for _ in range(world)]
    dist.all_gather(gathered, preds)
    return gathered
"""
    assert reported("import torch.nn.functional as F\n" + body) == lines
