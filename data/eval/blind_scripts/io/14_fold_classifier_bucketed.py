"""SCOPe fold classification from precomputed per-residue ESM-2 embeddings (light attention).

Embeddings live in one .pt file per domain ({"emb": L x 1280 fp16}). Domains are
length-bucketed so that padding stays small; the batch list is built identically
on all ranks from (seed, epoch) and then dealt out, so every rank runs the same
number of steps.

    torchrun --nproc_per_node=4 14_fold_classifier_bucketed.py --emb_dir /data/scope/esm2_emb \
        --train data/scope/train.tsv --valid data/scope/valid_fold.tsv
"""
import argparse
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--emb_dir", required=True)
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--emb_dim", type=int, default=1280)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--ckpt", default="runs/scope_la/checkpoint.pt")
    return ap.parse_args()


def read_tsv(path):
    rows = [line.rstrip("\n").split("\t") for line in open(path) if line.strip()]
    return [(r[0], r[1], int(r[2])) for r in rows]     # domain id, fold (e.g. "b.1"), length


class EmbeddingSet(Dataset):
    def __init__(self, rows, emb_dir, fold_index):
        self.rows, self.emb_dir, self.fold_index = rows, emb_dir, fold_index

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        dom, fold, _ = self.rows[i]
        emb = torch.load(os.path.join(self.emb_dir, dom + ".pt"), map_location="cpu")["emb"].float()
        return emb, self.fold_index.get(fold, -100)


def pad_collate(batch):
    embs, ys = zip(*batch)
    L = max(e.shape[0] for e in embs)
    x = torch.zeros(len(embs), L, embs[0].shape[1])
    mask = torch.zeros(len(embs), L, dtype=torch.bool)
    for b, e in enumerate(embs):
        x[b, :e.shape[0]] = e
        mask[b, :e.shape[0]] = True
    return x, mask, torch.tensor(ys)


class GlobalBucketBatchSampler(Sampler):
    """Sort by length inside large random chunks, cut into batches, shuffle batches, then deal
    batches round-robin. The number of batches is padded up to a multiple of the world size by
    repeating the first batches, so all ranks run the same number of steps."""

    def __init__(self, lengths, batch_size, rank, world, seed, chunk=100):
        self.lengths, self.bs, self.rank, self.world, self.seed = np.asarray(lengths), batch_size, rank, world, seed
        self.chunk = chunk * batch_size
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _all_batches(self):
        rng = np.random.default_rng(self.seed + self.epoch)
        perm = rng.permutation(len(self.lengths))
        batches = []
        for c in range(0, len(perm), self.chunk):
            chunk = perm[c:c + self.chunk]
            chunk = chunk[np.argsort(self.lengths[chunk], kind="stable")]
            batches += [chunk[i:i + self.bs].tolist() for i in range(0, len(chunk), self.bs)]
        order = rng.permutation(len(batches))
        batches = [batches[i] for i in order]
        pad = (-len(batches)) % self.world
        return batches + batches[:pad]

    def __iter__(self):
        return iter(self._all_batches()[self.rank::self.world])

    def __len__(self):
        return math.ceil(math.ceil(len(self.lengths) / self.bs) / self.world)


class LightAttention(nn.Module):
    def __init__(self, d_in, n_classes, d_hidden=32 * 16, kernel=9, dropout=0.25):
        super().__init__()
        self.feat = nn.Conv1d(d_in, d_in, kernel, padding=kernel // 2)
        self.attn = nn.Conv1d(d_in, d_in, kernel, padding=kernel // 2)
        self.drop = nn.Dropout(dropout)
        self.mlp = nn.Sequential(nn.Linear(2 * d_in, d_hidden), nn.Dropout(dropout), nn.ReLU(),
                                 nn.BatchNorm1d(d_hidden))
        self.out = nn.Linear(d_hidden, n_classes)

    def forward(self, x, mask):
        x = x.transpose(1, 2)
        v = self.drop(self.feat(x))
        a = self.attn(x).masked_fill(~mask[:, None], -1e4)
        o1 = (v * a.softmax(-1)).sum(-1)
        o2 = v.masked_fill(~mask[:, None], -1e4).max(-1).values
        return self.out(self.mlp(torch.cat([o1, o2], -1)))


@torch.no_grad()
def evaluate(net, loader, device, n_classes):
    net.eval()
    correct_top1 = torch.zeros(2, device=device, dtype=torch.long)
    per_class = torch.zeros(2, n_classes, device=device, dtype=torch.long)
    for x, mask, y in loader:
        x, mask, y = x.to(device), mask.to(device), y.to(device)
        keep = y != -100
        pred = net(x, mask).argmax(-1)
        hit = (pred == y) & keep
        correct_top1[0] += hit.sum()
        correct_top1[1] += keep.sum()
        per_class[0].index_add_(0, y[keep], hit[keep].long())
        per_class[1].index_add_(0, y[keep], torch.ones_like(y[keep]))
    dist.all_reduce(correct_top1)
    dist.all_reduce(per_class)
    seen = per_class[1] > 0
    bal = (per_class[0][seen].double() / per_class[1][seen]).mean().item()
    net.train()
    return correct_top1[0].item() / max(1, correct_top1[1].item()), bal


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_rows, valid_rows = read_tsv(args.train), read_tsv(args.valid)
    folds = sorted({fold for _, fold, _ in train_rows})      # same file, same order on every rank
    fold_index = {f: i for i, f in enumerate(folds)}
    train_set = EmbeddingSet(train_rows, args.emb_dir, fold_index)
    valid_set = EmbeddingSet(valid_rows, args.emb_dir, fold_index)

    batch_sampler = GlobalBucketBatchSampler([r[2] for r in train_rows], args.batch_size, rank, world, args.seed)
    loader = DataLoader(train_set, batch_sampler=batch_sampler, collate_fn=pad_collate, num_workers=6,
                        pin_memory=True, persistent_workers=True)
    valid_shard = torch.utils.data.Subset(valid_set, list(range(rank, len(valid_set), world)))
    valid_loader = DataLoader(valid_shard, batch_size=128, collate_fn=pad_collate, num_workers=2)

    model = LightAttention(args.emb_dim, len(folds)).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    start_epoch, best = 0, 0.0
    if os.path.exists(args.ckpt):
        state = torch.load(args.ckpt, map_location="cpu")
        model.load_state_dict(state["model"])
        start_epoch, best = state["epoch"] + 1, state["best"]
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    if os.path.exists(args.ckpt):
        optimizer.load_state_dict(state["optimizer"])

    for epoch in range(start_epoch, args.epochs):
        batch_sampler.set_epoch(epoch)
        model.train()
        optimizer.zero_grad(set_to_none=True)
        n_batches = len(loader)
        for i, (x, mask, y) in enumerate(loader):
            x, mask, y = x.to(device, non_blocking=True), mask.to(device, non_blocking=True), y.to(device)
            last_micro = (i + 1) % args.accum == 0 or i + 1 == n_batches
            if last_micro:
                loss = F.cross_entropy(model(x, mask), y, ignore_index=-100) / args.accum
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            else:
                with model.no_sync():
                    loss = F.cross_entropy(model(x, mask), y, ignore_index=-100) / args.accum
                    loss.backward()

        # unwrapped module: the validation shards are not the same size on every rank
        acc, bal = evaluate(model.module, valid_loader, device, len(folds))
        if rank == 0:
            print(f"epoch {epoch}: fold acc {acc:.4f}  balanced {bal:.4f}  loss {loss.item() * args.accum:.4f}",
                  flush=True)
            best = max(best, acc)
            os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch, "best": best}, args.ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
