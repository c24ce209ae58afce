"""assistant/lint/checks/gather_sizes.py: rows all_gathered into buffers shaped like
the local tensor, from a loader whose collate_fn drops samples (collective-mismatch).
A DistributedSampler gives every rank the same number of samples, but a collate
that filters its batch (junk pairs, items the dataset returned as None) leaves each
rank's batch its own size. The fixture pair runs under torchrun: the filtered
batches abort gloo, the twin exchanges the sizes, pads and trains on both ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from snippets import assert_broken_fails_and_twin_runs, lint_snippet

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"
CAUSE = "collective-mismatch"
PRELUDE = """\
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

dist.init_process_group("gloo")
world = dist.get_world_size()
model = torch.nn.Linear(8, 4)
"""
GATHER = """
def gather_rows(x):
    bufs = [torch.zeros_like(x) for _ in range(world)]
    dist.all_gather(bufs, x.detach().contiguous())
    return torch.cat(bufs, dim=0)


def train(ds):
    loader = DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds), collate_fn=COLLATE)
    for x in loader:
        gather_rows(model(x))
"""


def findings(collate: str, gather: str = GATHER, name: str = "collate") -> list[int]:
    return [
        line
        for line, _ in lint_snippet(PRELUDE, collate + gather.replace("COLLATE", name), {CAUSE})
    ]


@pytest.mark.slow
def test_batches_a_collate_filtered_abort_the_gather_and_the_padded_twin_trains(torchrun):
    assert_broken_fails_and_twin_runs(
        torchrun,
        SCRIPTS / "contrastive_gather_after_a_collate_that_drops_pairs.py",
        "Received data size doesn't match expected size",
        SCRIPTS / "correct_contrastive_gather_padded_after_a_collate_that_drops_pairs.py",
        "trained 2 steps",
    )


DROPPING = {
    "a condition in a comprehension": (
        (
            "def collate(batch):\n"
            "    batch = [b for b in batch if b is not None]\n"
            "    return torch.stack(batch)\n"
        ),
        "collate",
    ),
    "filter()": (
        "def collate(batch):\n    return torch.stack(list(filter(None, batch)))\n",
        "collate",
    ),
    "a collator class": (
        (
            "class Collator:\n"
            "    def __call__(self, batch):\n"
            "        kept = [b for b in batch if b.sum() > 0]\n"
            "        return torch.stack(kept)\n"
        ),
        "Collator()",
    ),
}


@pytest.mark.parametrize("case", DROPPING)
def test_a_collate_that_drops_samples_makes_the_gathered_rows_rank_sized(case):
    collate, name = DROPPING[case]
    gather_line = (collate + GATHER).splitlines().index(
        "    dist.all_gather(bufs, x.detach().contiguous())"
    ) + 1
    assert findings(collate, name=name) == [gather_line]


def test_the_message_names_the_collate_that_drops():
    collate, name = DROPPING["a collator class"]
    source = collate + GATHER.replace("COLLATE", name)
    [(_, finding)] = lint_snippet(PRELUDE, source, {CAUSE})
    assert "collate_fn `Collator.__call__` (line" in finding.message
    assert "drops samples" in finding.message


KEEPING = "def collate(batch):\n    return torch.stack([b.float() for b in batch])\n"
SIZES_FIRST = GATHER.replace(
    "    bufs = [torch.zeros_like(x) for _ in range(world)]\n",
    "    size = torch.tensor([x.shape[0]])\n"
    "    sizes = [torch.zeros_like(size) for _ in range(world)]\n"
    "    dist.all_gather(sizes, size)\n"
    "    bufs = [torch.zeros_like(x) for _ in range(world)]\n",
)
STACKED_LOSS = GATHER.replace("torch.cat(bufs, dim=0)", "torch.stack(bufs).mean()").replace(
    "gather_rows(model(x))", "gather_rows(model(x).pow(2).mean())"
)


@pytest.mark.parametrize(
    "collate, gather",
    [
        (KEEPING, GATHER),  # every sample kept: the sampler's equal shares stay equal
        (DROPPING["a condition in a comprehension"][0], SIZES_FIRST),  # a padded gather starts so
        (DROPPING["a condition in a comprehension"][0], STACKED_LOSS),  # one scalar per rank
    ],
    ids=["keeps every sample", "sizes exchanged first", "a scalar gathered and stacked"],
)
def test_quiet_when_the_rows_agree_or_the_sizes_are_exchanged(collate, gather):
    assert findings(collate, gather) == []


PADDED_QA = """
from transformers import AutoModelForQuestionAnswering, DataCollatorWithPadding


def evaluate(model, ds, tokenizer):
    collator = DataCollatorWithPadding(tokenizer)
    loader = DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds), collate_fn=collator)
    for batch in loader:
        out = model(**batch)
        start = out.OUTPUT.contiguous()
        bufs = [torch.zeros_like(start) for _ in range(world)]
        dist.all_gather(bufs, start)
"""


@pytest.mark.parametrize(
    "output, gathered, reported",
    [
        # blind set co's 01: per-token logits of a batch padded to its own longest
        # sequence: each rank's batch has its own length
        ("start_logits", "start", [12]),
        ("end_logits", "start", [12]),
        ("last_hidden_state", "start", [12]),
        # one value per sample: the same shape on every rank
        ("start_logits.argmax(-1)", "start", []),
        ("pooler_output", "start", []),
    ],
)
def test_per_token_outputs_of_a_batch_padded_to_its_longest_differ_in_length(
    output, gathered, reported
):
    body = PADDED_QA.replace("OUTPUT", output)
    assert [line for line, _ in lint_snippet(PRELUDE, body, {CAUSE})] == reported


FRAME_FEATURES = """
def crop_to_shortest(batch):
    n = min(len(w) for w in batch)
    return torch.stack([w[:n] for w in batch])


@torch.no_grad()
def features(encoder, ds):
    loader = DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds), collate_fn=COLLATE)
    chunks = []
    for i, wav in enumerate(loader):
        h = encoder(wav)
        chunks.append(ROWS)
    feats = torch.cat(chunks)
    bufs = [torch.empty_like(feats) for _ in range(world)]
    dist.all_gather(bufs, feats)
"""


@pytest.mark.parametrize(
    "collate, rows, reported",
    [
        # blind set ht's 14: every waveform cropped to the batch's shortest, and the
        # frames of each batch flattened into rows: as many as this rank's batches are long
        ("crop_to_shortest", "h[:, ::2].reshape(-1, h.size(-1))", [16]),
        ("crop_to_shortest", "h.flatten(0, 1)", [16]),
        ("crop_to_shortest", "h.view(-1, 256)", [16]),
        # one row per waveform: the same count on every rank
        ("crop_to_shortest", "h.mean(1)", []),
        # a collate that does not measure its items: batches of one fixed length
        ("None", "h.reshape(-1, h.size(-1))", []),
    ],
    ids=["strided frames reshaped", "flatten(0, 1)", "view(-1, d)", "pooled", "fixed length"],
)
def test_frames_of_batches_of_their_own_length_flattened_into_rows_differ_in_count(
    collate, rows, reported
):
    body = FRAME_FEATURES.replace("COLLATE", collate).replace("ROWS", rows)
    assert [line for line, _ in lint_snippet(PRELUDE, body, {CAUSE})] == reported


PADDING_COLLATOR = """
class HeadTail:
    def __call__(self, rows):
        longest = max(len(r) for r in rows)
        return {"ids": torch.stack([pad(r, longest) for r in rows]), "labels": labels_of(rows)}


def evaluate(model, ds):
    loader = DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds), collate_fn=HeadTail())
    golds = []
    for batch in loader:
        GATHER_OR_KEEP
    golds = torch.cat(golds)
    bufs = [torch.empty_like(golds) for _ in range(world)]
    dist.all_gather(bufs, golds)
"""


def test_labels_appended_then_joined_under_their_name_are_one_per_sample():
    # blind set ij's 13: a collate of its own pads each batch to its longest row, but
    # the labels are one per sample, appended batch by batch, then joined
    body = PADDING_COLLATOR.replace("GATHER_OR_KEEP", "golds.append(batch['labels'])")
    assert lint_snippet(PRELUDE, body, {CAUSE}) == []
    per_batch = body.replace("    golds = torch.cat(golds)\n", "    golds = batch['labels']\n")
    assert [line for line, _ in lint_snippet(PRELUDE, per_batch, {CAUSE})] == [15]


# Blind set io's 01: a collator class pads each batch's contact maps to its longest
# chain; the validation loop unpacks the batch and gathers a map packed from one
# batch's parts into buffers shaped like its own.
PADDED_FIELD = """
class Collate:
    def __call__(self, batch):
        idxs, seqs, contacts = zip(*batch)
        L = max(len(s) for s in seqs)
        tgt = torch.zeros(len(seqs), L, L)
        for b, c in enumerate(contacts):
            tgt[b, : c.shape[0], : c.shape[0]] = c
        return torch.tensor(idxs), tokenize(seqs), tgt


def evaluate(ds):
    loader = DataLoader(ds, batch_size=1, sampler=DistributedSampler(ds), collate_fn=Collate())
    hits = []
    for idx, tokens, tgt in loader:
        GATHERED
"""


@pytest.mark.parametrize(
    ("gathered", "reported"),
    [
        # the map, padded to this batch's own longest chain
        ("packed = torch.stack([model(tokens), tgt[0]])", True),
        # the index: one per sample, the same size on every rank
        ("packed = idx.float()", False),
        # what a decoder makes of the padded input: its own, fixed shape (blind set iv's 12)
        ("packed = model.greedy_decode(tgt.cuda(), 64)", False),
    ],
    ids=["padded map", "one per sample", "decoded to a fixed length"],
)
def test_a_field_the_collate_pads_to_its_batch_gathered_batch_by_batch(gathered, reported):
    body = PADDED_FIELD.replace(
        "GATHERED",
        gathered
        + "\n        bufs = [torch.empty_like(packed) for _ in range(world)]"
        + "\n        dist.all_gather(bufs, packed)",
    )
    found = lint_snippet(PRELUDE, body, [CAUSE])
    assert bool(found) == reported, found
    if reported:
        assert "pads to the batch's own longest item" in found[0][1].message


def test_a_padded_field_concatenated_over_the_batches_first_is_not_reported():
    # blind sets z's 19, hu's 05, im's 09: model outputs of the padded inputs, one row per
    # sample, joined over the batches before the gather
    body = PADDED_FIELD.replace(
        "GATHERED",
        "hits.append(model(tokens).mean(-1))"
        "\n    hits = torch.cat(hits)"
        "\n    bufs = [torch.empty_like(hits) for _ in range(world)]"
        "\n    dist.all_gather(bufs, hits)",
    )
    assert lint_snippet(PRELUDE, body, [CAUSE]) == []


def test_a_target_a_collate_pads_with_pad_sequence_gathered_batch_by_batch():
    # blind set iv's 15 (and ej's 06): the decoded predictions have a fixed length, the
    # references are as long as this batch's longest formula
    body = """
def collate(batch):
    xs, ys = zip(*batch)
    return torch.stack(xs), torch.nn.utils.rnn.pad_sequence(ys, batch_first=True)


def validate(ds):
    loader = DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds), collate_fn=collate)
    for x, y in loader:
        pred = model.greedy(x, 64)
        y = y.cuda()
        all_pred = [torch.zeros_like(pred) for _ in range(world)]
        all_ref = [torch.zeros_like(y) for _ in range(world)]
        dist.all_gather(all_pred, pred)
        dist.all_gather(all_ref, y)
"""
    assert [line for line, _ in lint_snippet(PRELUDE, body, [CAUSE])] == [15]
