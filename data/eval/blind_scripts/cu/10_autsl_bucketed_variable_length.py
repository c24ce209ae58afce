"""AUTSL isolated sign recognition on variable-length keypoint sequences.

Sequences are NOT resampled: batches are built from clips of similar length and
padded to the longest clip in the batch, with a frame budget per batch
(--max-frames), and the GCN pools only over valid frames.
"""
import argparse
import logging
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler

log = logging.getLogger(__name__)

V = 27
EDGES = [(0, 1), (0, 2), (1, 3), (3, 5), (2, 4), (4, 6), (5, 7), (6, 17)] + \
        [(7 + a, 7 + b) for a, b in [(0, 1), (1, 2), (0, 3), (3, 4), (0, 5), (5, 6), (0, 7), (7, 8), (0, 9)]] + \
        [(17 + a, 17 + b) for a, b in [(0, 1), (1, 2), (0, 3), (3, 4), (0, 5), (5, 6), (0, 7), (7, 8), (0, 9)]]


class AUTSLKeypoints(Dataset):
    def __init__(self, root, split, max_len=160):
        blob = np.load(os.path.join(root, f"{split}.npz"), allow_pickle=True)
        self.seqs = list(blob["keypoints"])        # each (T_i, 27, 3)
        self.labels = blob["labels"].astype(np.int64)
        self.max_len = max_len
        self.lengths = [min(len(s), max_len) for s in self.seqs]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        s = self.seqs[i]
        if len(s) > self.max_len:
            idx = np.linspace(0, len(s) - 1, self.max_len).round().astype(np.int64)
            s = s[idx]
        s = s.astype(np.float32)
        ref = s[:, [1, 2], :2].mean(1, keepdims=True)
        s[..., :2] = (s[..., :2] - ref) / (np.abs(s[:, 1, :2] - s[:, 2, :2]).sum(-1).mean() + 1e-3)
        return torch.from_numpy(s), self.labels[i]


def pad_collate(batch):
    lens = torch.tensor([b[0].shape[0] for b in batch])
    T = int(lens.max())
    x = torch.zeros(len(batch), 3, T, V)
    for k, (s, _) in enumerate(batch):
        x[k, :, :s.shape[0]] = s.permute(2, 0, 1)
    mask = torch.arange(T)[None, :] < lens[:, None]
    y = torch.tensor([b[1] for b in batch])
    return x, mask, y


class FrameBudgetSampler(Sampler):
    """Rank-sharded, length-bucketed batches under a padded-frame budget."""

    def __init__(self, lengths, max_frames, rank, world, shuffle=True, seed=0):
        self.lengths = lengths
        self.max_frames = max_frames
        self.rank, self.world = rank, world
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        g = random.Random(self.seed + self.epoch)
        order = list(range(len(self.lengths)))
        if self.shuffle:
            g.shuffle(order)
        mine = order[self.rank::self.world]
        # sort inside chunks of 100 so padding stays small but order stays random
        chunk = 100
        batches = []
        for c in range(0, len(mine), chunk):
            part = sorted(mine[c:c + chunk], key=lambda i: self.lengths[i])
            cur, longest = [], 0
            for i in part:
                longest_new = max(longest, self.lengths[i])
                if cur and longest_new * (len(cur) + 1) > self.max_frames:
                    batches.append(cur)
                    cur, longest_new = [], self.lengths[i]
                cur.append(i)
                longest = longest_new
            if cur:
                batches.append(cur)
        if self.shuffle:
            g.shuffle(batches)
        return batches

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return len(self._batches())


def adjacency():
    A = np.eye(V, dtype=np.float32)
    for a, b in EDGES:
        A[a, b] = A[b, a] = 1
    d = A.sum(1) ** -0.5
    return d[:, None] * A * d[None]


class MaskedGCNBlock(nn.Module):
    def __init__(self, cin, cout, A, stride=1):
        super().__init__()
        self.A = nn.Parameter(torch.from_numpy(A).clone())
        self.gc = nn.Conv2d(cin, cout, 1)
        self.bn1 = nn.BatchNorm2d(cout)
        self.tc = nn.Conv2d(cout, cout, (9, 1), (stride, 1), (4, 0))
        self.bn2 = nn.BatchNorm2d(cout)
        self.stride = stride
        self.res = (nn.Identity() if cin == cout and stride == 1
                    else nn.Sequential(nn.Conv2d(cin, cout, 1, (stride, 1)), nn.BatchNorm2d(cout)))

    def forward(self, x, mask):
        x = x * mask[:, None, :, None]
        y = F.relu(self.bn1(torch.einsum("nctv,vw->nctw", self.gc(x), self.A)))
        y = self.bn2(self.tc(y))
        if self.stride > 1:
            mask = mask[:, ::self.stride]
        return F.relu(y + self.res(x)), mask


class SignGCN(nn.Module):
    def __init__(self, num_class=226):
        super().__init__()
        A = adjacency()
        plan = [(3, 64, 1), (64, 64, 1), (64, 128, 2), (128, 128, 1), (128, 256, 2), (256, 256, 1)]
        self.blocks = nn.ModuleList([MaskedGCNBlock(a, b, A, s) for a, b, s in plan])
        self.in_norm = nn.LayerNorm([3, V])
        self.head = nn.Linear(256, num_class)

    def forward(self, x, mask):
        x = self.in_norm(x.permute(0, 2, 1, 3)).permute(0, 2, 1, 3)
        for blk in self.blocks:
            x, mask = blk(x, mask)
        m = mask[:, None, :, None].float()
        pooled = (x * m).sum((2, 3)) / (m.sum((2, 3)) * x.shape[-1]).clamp(min=1)
        return self.head(pooled)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(3, device=device)
    for x, mask, y in loader:
        x, mask, y = x.to(device), mask.to(device), y.to(device)
        top5 = model(x, mask).topk(5, 1).indices
        acc += torch.stack([(top5[:, 0] == y).sum(), (top5 == y[:, None]).any(1).sum(),
                            torch.tensor(len(y), device=device)]).float()
    dist.all_reduce(acc)
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/datasets/AUTSL/kp27")
    ap.add_argument("--out", default="runs/autsl_gcn")
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--max-frames", type=int, default=4096, help="padded frames per GPU batch")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="%(asctime)s %(message)s")
    torch.manual_seed(args.seed)

    train_set = AUTSLKeypoints(args.root, "train")
    val_set = AUTSLKeypoints(args.root, "val")
    train_sampler = FrameBudgetSampler(train_set.lengths, args.max_frames, rank, world, shuffle=True, seed=args.seed)
    val_sampler = FrameBudgetSampler(val_set.lengths, args.max_frames, rank, world, shuffle=False)
    train_loader = DataLoader(train_set, batch_sampler=train_sampler, collate_fn=pad_collate,
                              num_workers=6, pin_memory=True)
    val_loader = DataLoader(val_set, batch_sampler=val_sampler, collate_fn=pad_collate, num_workers=6)

    model = SignGCN().to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_sampler)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 500) * 0.5 * (1 + math.cos(math.pi * min(s / total, 1.0))))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, seen = time.time(), 0
        for x, mask, y in train_loader:
            x, mask, y = x.to(device, non_blocking=True), mask.to(device, non_blocking=True), y.to(device)
            loss = F.cross_entropy(model(x, mask), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            seen += len(y)
        top1, top5 = evaluate(model.module, val_loader, device)
        log.info("epoch %d: loss %.4f  val top1 %.4f top5 %.4f  (%d clips on rank0, %.0fs)",
                 epoch + 1, loss.item(), top1, top5, seen, time.time() - t0)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "epoch": epoch + 1}, os.path.join(args.out, "last.pt"))
            if top1 > best:
                best = top1
                torch.save({"model": model.module.state_dict(), "epoch": epoch + 1},
                           os.path.join(args.out, "best.pt"))

    log.info("best val top1 %.4f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
