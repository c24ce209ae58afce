"""Pfam family classification from single domain sequences.

Each rank takes its share of the shuffled sequences and packs it into token-budget
batches locally, so ranks can end an epoch with different numbers of batches; DDP's
Join context manager shadows the missing all-reduces of the ranks that finish first.

    torchrun --nproc_per_node=8 18_protein_family_cls.py --train data/pfam_train.tsv \
        --dev data/pfam_dev.tsv --out runs/pfam_tf
"""
import argparse
import csv
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler

AMINO = "ACDEFGHIKLMNPQRSTVWYXBZUO"
A2I = {a: i + 1 for i, a in enumerate(AMINO)}


def read_tsv(path):
    with open(path) as f:
        return [(row["sequence"], row["family_accession"]) for row in csv.DictReader(f, delimiter="\t")]


class DomainDataset(Dataset):
    def __init__(self, rows, fam2id, max_len):
        self.seqs = [s[:max_len] for s, _ in rows]
        self.labels = [fam2id.get(f, -100) for _, f in rows]
        self.lengths = np.array([len(s) for s in self.seqs])

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        return torch.tensor([A2I.get(a, A2I["X"]) for a in self.seqs[i]]), self.labels[i]


def collate(batch):
    seqs, labels = zip(*batch)
    return nn.utils.rnn.pad_sequence(seqs, batch_first=True), torch.tensor([len(s) for s in seqs]), torch.tensor(labels)


class ShardThenBatchSampler(Sampler):
    """Shuffle all indices with a seed shared by the ranks, keep this rank's share, then
    sort it by length and cut token-budget batches. Batch counts differ between ranks."""

    def __init__(self, lengths, max_tokens, num_replicas, rank, shuffle=True, seed=0):
        self.lengths, self.max_tokens = lengths, max_tokens
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        rng = np.random.default_rng(self.seed + self.epoch)
        idx = rng.permutation(len(self.lengths)) if self.shuffle else np.arange(len(self.lengths))
        idx = idx[self.rank::self.num_replicas]
        idx = idx[np.argsort(self.lengths[idx], kind="stable")]
        batches, cur = [], []
        for i in idx:
            if cur and self.lengths[i] * (len(cur) + 1) > self.max_tokens:
                batches.append(cur)
                cur = []
            cur.append(int(i))
        if cur:
            batches.append(cur)
        if self.shuffle:
            batches = [batches[j] for j in rng.permutation(len(batches))]
        return batches

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return len(self._batches())


class FamilyClassifier(nn.Module):
    def __init__(self, n_fam, d=256, layers=4, heads=8, max_len=512):
        super().__init__()
        self.emb = nn.Embedding(len(AMINO) + 1, d, padding_idx=0)
        self.pos = nn.Parameter(torch.randn(max_len, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, 0.1, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, layers)
        self.norm = nn.LayerNorm(d)
        self.cls = nn.Linear(d, n_fam)

    def forward(self, x, lens):
        pad = torch.arange(x.size(1), device=x.device)[None] >= lens[:, None]
        h = self.enc(self.emb(x) + self.pos[: x.size(1)], src_key_padding_mask=pad)
        h = self.norm(h).masked_fill(pad[..., None], 0.0)
        return self.cls(h.sum(1) / lens[:, None].clamp(min=1))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    c = torch.zeros(3, device=device, dtype=torch.float64)
    for x, lens, y in loader:
        x, lens, y = x.to(device), lens.to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x, lens).float()
        known = y != -100
        c[0] += F.cross_entropy(logits[known], y[known], reduction="sum") if known.any() else 0.0
        c[1] += (logits.argmax(-1)[known] == y[known]).sum()
        c[2] += known.sum()
    dist.all_reduce(c)
    model.train()
    return (c[0] / c[2]).item(), (c[1] / c[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=32768)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=4)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_rows, dev_rows = read_tsv(args.train), read_tsv(args.dev)
    families = sorted({f for _, f in train_rows})
    fam2id = {f: i for i, f in enumerate(families)}
    train_ds = DomainDataset(train_rows, fam2id, args.max_len)
    dev_ds = DomainDataset(dev_rows, fam2id, args.max_len)
    train_sampler = ShardThenBatchSampler(train_ds.lengths, args.max_tokens, world, rank, seed=args.seed)
    dev_sampler = ShardThenBatchSampler(dev_ds.lengths, args.max_tokens, world, rank, shuffle=False)
    train_loader = DataLoader(train_ds, batch_sampler=train_sampler, collate_fn=collate, num_workers=4, pin_memory=True)
    dev_loader = DataLoader(dev_ds, batch_sampler=dev_sampler, collate_fn=collate, num_workers=2)

    model = FamilyClassifier(len(families), max_len=args.max_len).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
    model = DDP(model, device_ids=[local_rank])

    best_acc = 0.0
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, n_batches = time.time(), 0
        with Join([model]):
            for x, lens, y in train_loader:
                x, lens, y = x.to(device, non_blocking=True), lens.to(device, non_blocking=True), y.to(device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(x, lens)
                loss = F.cross_entropy(logits.float(), y, label_smoothing=0.05)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                n_batches += 1
                if rank == 0 and n_batches % 200 == 0:
                    print(f"epoch {epoch} batch {n_batches} loss {loss.item():.4f}", flush=True)
        scheduler.step()

        dev_loss, dev_acc = evaluate(model.module, dev_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: {n_batches} batches on rank 0 in {time.time() - t0:.0f}s, "
                  f"dev loss {dev_loss:.4f} acc {dev_acc:.4f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "families": families}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if dev_acc > best_acc:
                best_acc = dev_acc
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
