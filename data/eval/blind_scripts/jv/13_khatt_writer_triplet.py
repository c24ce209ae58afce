"""Line-level writer retrieval on KHATT (Arabic) with batch-hard triplet loss.

Each training item is one writer with K random text lines, so every batch has K positives
per writer. Writers are split into disjoint train / validation sets.

    torchrun --nproc_per_node=4 13_khatt_writer_triplet.py --lines-dir /data/KHATT/lines --out runs/khatt_tri
"""
import argparse
import glob
import os
import random
import re
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

LINE_H, LINE_W = 80, 640
FNAME = re.compile(r"AHTD3A(\d{4})_")  # KHATT file names carry the writer number


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines-dir", required=True)
    ap.add_argument("--out", default="runs/khatt_tri")
    ap.add_argument("--val-writers", type=int, default=100)
    ap.add_argument("--k", type=int, default=4, help="lines per writer in a batch")
    ap.add_argument("--writers-per-gpu", type=int, default=24)
    ap.add_argument("--margin", type=float, default=0.3)
    ap.add_argument("--epochs", type=int, default=150)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=11)
    return ap.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def load_line(path, train):
    im = Image.open(path).convert("L")
    w = max(16, int(im.width * LINE_H / im.height))
    im = im.resize((w, LINE_H), Image.BILINEAR)
    a = 1.0 - np.asarray(im, dtype=np.float32) / 255.0
    if w > LINE_W:
        s = random.randint(0, w - LINE_W) if train else (w - LINE_W) // 2
        a = a[:, s:s + LINE_W]
    else:
        a = np.pad(a, ((0, 0), (0, LINE_W - w)))
    return torch.from_numpy(np.ascontiguousarray(a))[None]


class WriterGroups(Dataset):
    def __init__(self, by_writer, writers, k):
        self.by_writer, self.writers, self.k = by_writer, writers, k

    def __len__(self):
        return len(self.writers)

    def __getitem__(self, i):
        lines = self.by_writer[self.writers[i]]
        picks = random.sample(lines, self.k) if len(lines) >= self.k else random.choices(lines, k=self.k)
        return torch.stack([load_line(p, True) for p in picks]), torch.full((self.k,), i, dtype=torch.long)


class Lines(Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        p, lab = self.items[i]
        return load_line(p, False), lab


class LineNet(nn.Module):
    def __init__(self, dim=256):
        super().__init__()

        def blk(i, o, pool):
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.GroupNorm(16, o), nn.SiLU(),
                                 nn.Conv2d(o, o, 3, padding=1), nn.GroupNorm(16, o), nn.SiLU(),
                                 nn.MaxPool2d(pool) if pool else nn.Identity())

        self.body = nn.Sequential(blk(1, 32, 2), blk(32, 64, 2), blk(64, 128, 2), blk(128, 256, (2, 1)),
                                  blk(256, 384, None))
        self.attn = nn.Conv2d(384, 1, 1)
        self.fc = nn.Linear(384, dim)

    def forward(self, x):
        f = self.body(x)
        a = torch.softmax(self.attn(f).flatten(2), dim=-1)           # attention over all positions
        v = (f.flatten(2) * a).sum(-1)
        return F.normalize(self.fc(v), dim=1)


def batch_hard(emb, y, margin):
    d = torch.cdist(emb, emb)
    same = y[:, None] == y[None]
    pos = (d - 1e4 * (~same).float()).max(1).values
    neg = (d + 1e4 * same.float()).min(1).values
    return F.relu(pos - neg + margin).mean(), (pos < neg).float().mean()


@torch.no_grad()
def retrieval(model, loader, device):
    model.eval()
    E, Y = [], []
    for x, y in loader:
        E.append(model(x.to(device)))
        Y.append(y.to(device))
    E, Y = torch.cat(E), torch.cat(Y)
    sim = E @ E.t()
    sim.fill_diagonal_(-5)
    order = sim.argsort(1, descending=True)[:, :-1]
    rel = (Y[order] == Y[:, None]).float()
    prec = rel.cumsum(1) / torch.arange(1, rel.shape[1] + 1, device=device)
    ap = (prec * rel).sum(1) / rel.sum(1).clamp(min=1)
    model.train()
    return ap.mean().item(), rel[:, 0].mean().item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    seed_everything(args.seed + rank)

    by_writer = defaultdict(list)
    for p in sorted(glob.glob(os.path.join(args.lines_dir, "**", "*.tif"), recursive=True)):
        m = FNAME.search(os.path.basename(p))
        if m:
            by_writer[m.group(1)].append(p)
    writers = sorted(w for w, ls in by_writer.items() if len(ls) >= 2)
    random.shuffle(writers)
    val_w, train_w = writers[: args.val_writers], writers[args.val_writers:]
    if rank == 0:
        print(f"{len(train_w)} train writers, {len(val_w)} val writers", flush=True)

    train_ds = WriterGroups(by_writer, train_w, args.k)
    val_ds = Lines([(p, i) for i, w in enumerate(val_w) for p in by_writer[w]])
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.writers_per_gpu, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=64, shuffle=False, num_workers=args.workers)

    model = DDP(LineNet().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world, weight_decay=0.02)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        stats = torch.zeros(3, device=device)
        for x, y in loader:
            x = x.flatten(0, 1).to(device, non_blocking=True)
            y = y.flatten().to(device)
            loss, frac = batch_hard(model(x), y, args.margin)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            stats += torch.stack([loss.detach(), frac, torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(stats)

        if rank == 0:
            m_ap, top1 = retrieval(model.module, val_loader, device)
            print(f"epoch {epoch} {time.time() - t0:.0f}s loss {stats[0] / stats[2]:.4f} "
                  f"triplets ok {stats[1] / stats[2]:.3f} | val mAP {m_ap:.4f} top1 {top1:.4f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "val_writers": val_w},
                       os.path.join(args.out, "last.pt"))
            if m_ap > best:
                best = m_ap
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "val_writers": val_w},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
