"""Deal-point extraction from merger agreements (MAUD-style annotations) as
token tagging with Longformer. Agreements are split on section boundaries into
chunks of up to --max_len tokens; batches are length-grouped and padded
dynamically, so batch shapes vary a lot from step to step.

    torchrun --nproc_per_node=4 19_chunked_clause_extraction.py --data data/maud_sections \
        --out runs/maud_lf --max_len 4096
"""
import argparse
import json
import logging
import math
import os
import random

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from transformers import AutoTokenizer, LongformerForTokenClassification, get_linear_schedule_with_warmup

logger = logging.getLogger("maud")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="allenai/longformer-base-4096")
    ap.add_argument("--max_len", type=int, default=4096)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=8)
    return ap.parse_args()


class SectionChunks(Dataset):
    def __init__(self, path, labels):
        self.rows = [json.loads(l) for l in open(path)]  # pre-tokenised: input_ids, tag ids
        self.lengths = [len(r["input_ids"]) for r in self.rows]
        self.num_labels = len(labels)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class DistributedLengthGroupedSampler(Sampler):
    """Shuffle with a shared seed, cut into length-sorted mega-batches, deal batches
    round-robin so that every rank gets the same number of batches."""

    def __init__(self, lengths, batch_size, rank, world, seed=0, mega=50):
        self.lengths, self.bs, self.rank, self.world = lengths, batch_size, rank, world
        self.seed, self.mega, self.epoch = seed, mega, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        rng = random.Random(self.seed + self.epoch)
        idx = list(range(len(self.lengths)))
        rng.shuffle(idx)
        step = self.bs * self.mega
        batches = []
        for s in range(0, len(idx), step):
            mb = sorted(idx[s:s + step], key=lambda i: -self.lengths[i])
            batches.extend(mb[j:j + self.bs] for j in range(0, len(mb), self.bs))
        rng.shuffle(batches)
        n = (len(batches) // self.world) * self.world
        return batches[:n][self.rank::self.world]

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return len(self._batches())


class EvalShardSampler(Sampler):
    """Every dev chunk exactly once: strided shard per rank, batched longest-first."""

    def __init__(self, lengths, batch_size, rank, world):
        mine = sorted(range(rank, len(lengths), world), key=lambda i: -lengths[i])
        self.batches = [mine[j:j + batch_size] for j in range(0, len(mine), batch_size)]

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


def make_collate(pad_id, max_len):
    def collate(rows):
        L = min(max_len, max(len(r["input_ids"]) for r in rows))
        L = int(math.ceil(L / 512) * 512)
        ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
        tags = torch.full((len(rows), L), -100, dtype=torch.long)
        for i, r in enumerate(rows):
            n = min(L, len(r["input_ids"]))
            ids[i, :n] = torch.tensor(r["input_ids"][:n])
            tags[i, :n] = torch.tensor(r["tags"][:n])
        att = (ids != pad_id).long()
        glob = torch.zeros_like(ids)
        glob[:, 0] = 1
        return {"input_ids": ids, "attention_mask": att, "global_attention_mask": glob, "labels": tags}
    return collate


@torch.no_grad()
def token_f1(model, loader, device):
    model.eval()
    s = torch.zeros(3, device=device)
    for b in loader:
        b = {k: v.to(device) for k, v in b.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                         global_attention_mask=b["global_attention_mask"]).logits.argmax(-1)
        gold, valid = b["labels"], b["labels"] != -100
        s[0] += ((pred == gold) & (gold > 0) & valid).sum()
        s[1] += ((pred > 0) & valid).sum()
        s[2] += ((gold > 0) & valid).sum()
    dist.all_reduce(s)
    p, r = (s[0] / s[1].clamp(min=1)).item(), (s[0] / s[2].clamp(min=1)).item()
    model.train()
    return {"p": p, "r": r, "f1": 2 * p * r / max(p + r, 1e-9)}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(args.seed)

    with open(os.path.join(args.data, "labels.json")) as f:
        labels = json.load(f)
    tok = AutoTokenizer.from_pretrained(args.model)
    train_ds = SectionChunks(os.path.join(args.data, "train.jsonl"), labels)
    dev_ds = SectionChunks(os.path.join(args.data, "dev.jsonl"), labels)
    collate = make_collate(tok.pad_token_id, args.max_len)

    train_sampler = DistributedLengthGroupedSampler(train_ds.lengths, args.batch_size, rank, world, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_sampler=train_sampler, collate_fn=collate, num_workers=4, pin_memory=True)
    dev_dl = DataLoader(dev_ds, batch_sampler=EvalShardSampler(dev_ds.lengths, args.batch_size, rank, world),
                        collate_fn=collate, num_workers=4)

    model = LongformerForTokenClassification.from_pretrained(args.model, num_labels=len(labels))
    if args.max_len > model.config.max_position_embeddings - 2:
        raise ValueError("max_len exceeds the model's position embeddings")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = DDP(model.to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_sampler) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, total // 10, total)

    best, skipped = 0.0, 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, b in enumerate(train_dl):
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            try:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(**b).loss
                loss.backward()
            except torch.cuda.OutOfMemoryError:
                skipped += 1
                logger.warning("OOM at step %d with batch %s, skipping (%d so far)", step,
                               tuple(b["input_ids"].shape), skipped)
                del b
                optimizer.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 100 == 0:
                logger.info("epoch %d step %d/%d loss %.4f", epoch, step, len(train_sampler), loss.item())

        metrics = token_f1(model.module, dev_dl, device)
        logger.info("epoch %d dev %s", epoch, metrics)
        if rank == 0 and metrics["f1"] > best:
            best = metrics["f1"]
            model.module.save_pretrained(os.path.join(args.out, "best"))
            tok.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
