"""CTC line recognizer for the LAM dataset with length-bucketed batches and weight EMA.

* Line images are resized to a fixed height once; the resized arrays are stored in a single
  .npz cache written by rank 0 (the other ranks wait and then read it).
* Batches are packed by width up to a pixel budget; the list of batches is built identically
  on every rank and dealt out round-robin, so all ranks run the same number of training steps.
* Transformer blocks use non-reentrant activation checkpointing.

    torchrun --nproc_per_node=4 19_lam_bucketed_ctc_ema.py --lam /data/LAM --out runs/lam
"""
import argparse
import copy
import json
import math
import os
import random
import time
from datetime import timedelta

import editdistance
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Sampler

H = 64


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lam", required=True, help="LAM root: lines/img, lines/split/basic/{train,val}.json")
    ap.add_argument("--out", default="runs/lam")
    ap.add_argument("--budget", type=int, default=40000, help="sum of padded widths per GPU batch")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--lr", type=float, default=4e-4, help="for 4 GPUs")
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--seed", type=int, default=123)
    return ap.parse_args()


def build_cache(lam_root, split, path):
    with open(os.path.join(lam_root, "lines", "split", "basic", f"{split}.json"), encoding="utf-8") as f:
        items = json.load(f)
    arrays, texts = [], []
    for it in items:
        im = Image.open(os.path.join(lam_root, "lines", "img", it["img"])).convert("L")
        w = max(H // 2, round(im.width * H / im.height))
        arrays.append(255 - np.asarray(im.resize((w, H), Image.BILINEAR), dtype=np.uint8))
        texts.append(it["text"])
    widths = np.array([a.shape[1] for a in arrays])
    tmp = path + ".tmp.npz"
    np.savez(tmp, pixels=np.concatenate(arrays, axis=1), widths=widths, texts=np.array(texts, dtype=object))
    os.replace(tmp, path)


class CachedLines(Dataset):
    def __init__(self, path, charset=None):
        z = np.load(path, allow_pickle=True)
        self.pixels, self.widths, self.texts = z["pixels"], z["widths"], list(z["texts"])
        self.offsets = np.concatenate([[0], np.cumsum(self.widths)])
        self.charset = charset or sorted(set("".join(self.texts)))
        self.c2i = {c: i + 1 for i, c in enumerate(self.charset)}

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        a = self.pixels[:, self.offsets[i]: self.offsets[i + 1]].astype(np.float32) / 255.0
        y = [self.c2i[c] for c in self.texts[i] if c in self.c2i]
        return torch.from_numpy(a)[None], torch.tensor(y, dtype=torch.long), self.texts[i]


def collate(batch):
    xs, ys, ts = zip(*batch)
    W = max(x.shape[-1] for x in xs)
    W += (-W) % 8
    img = torch.zeros(len(xs), 1, H, W)
    for i, x in enumerate(xs):
        img[i, ..., : x.shape[-1]] = x
    return img, torch.tensor([x.shape[-1] for x in xs]), torch.cat(ys), torch.tensor([len(y) for y in ys]), ts


class GlobalBucketBatchSampler(Sampler):
    """Same global batch list on all ranks (seeded by epoch); rank r takes batches r, r+world, ..."""

    def __init__(self, widths, budget, rank, world, shuffle, seed=0):
        self.widths, self.budget = list(widths), budget
        self.rank, self.world, self.shuffle, self.seed = rank, world, shuffle, seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _global_batches(self):
        rng = random.Random(self.seed + self.epoch)
        order = list(range(len(self.widths)))
        if self.shuffle:
            rng.shuffle(order)
        order = [i for s in range(0, len(order), 4096)
                 for i in sorted(order[s:s + 4096], key=self.widths.__getitem__)]
        batches, cur, cur_max = [], [], 0
        for i in order:
            m = max(cur_max, self.widths[i])
            if cur and m * (len(cur) + 1) > self.budget:
                batches.append(cur)
                cur, m = [], self.widths[i]
            cur.append(i)
            cur_max = m
        if cur:
            batches.append(cur)
        if self.shuffle:
            rng.shuffle(batches)
            # training: drop the tail so every rank runs the same number of DDP steps
            batches = batches[: len(batches) - len(batches) % self.world]
        return batches

    def __iter__(self):
        return iter(self._global_batches()[self.rank::self.world])

    def __len__(self):
        return len(range(self.rank, len(self._global_batches()), self.world))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.1, batch_first=True, norm_first=True)

    def forward(self, x, mask):
        return self.layer(x, src_key_padding_mask=mask)


class Recognizer(nn.Module):
    def __init__(self, n_out, d=256, heads=8, layers=10):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(1, 64, 3, 2, 1), nn.GroupNorm(8, 64), nn.GELU(),
            nn.Conv2d(64, 128, 3, 2, 1), nn.GroupNorm(8, 128), nn.GELU(),
            nn.Conv2d(128, 256, 3, (2, 2), 1), nn.GroupNorm(16, 256), nn.GELU(),
            nn.Conv2d(256, d, (H // 8, 1)),
        )
        self.pos = nn.Parameter(torch.zeros(1, 1024, d))
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, n_out)

    def forward(self, x, widths):
        f = self.stem(x).squeeze(2).transpose(1, 2)       # B, T, d
        T = f.shape[1]
        lens = torch.div(widths, 8, rounding_mode="floor").clamp(1, T)
        mask = torch.arange(T, device=x.device)[None] >= lens[:, None]
        f = f + self.pos[:, :T]
        for blk in self.blocks:
            f = checkpoint(blk, f, mask, use_reentrant=False) if self.training else blk(f, mask)
        return self.head(self.norm(f)), lens


@torch.no_grad()
def cer_stats(net, loader, charset, device):
    net.eval()
    s = torch.zeros(2, device=device, dtype=torch.float64)
    for x, widths, _, _, texts in loader:
        logits, lens = net(x.to(device), widths.to(device))
        for seq, n, gt in zip(logits.argmax(-1).tolist(), lens.tolist(), texts):
            out, prev = [], 0
            for k in seq[:n]:
                if k and k != prev:
                    out.append(charset[k - 1])
                prev = k
            s[0] += editdistance.eval("".join(out), gt)
            s[1] += len(gt)
    return s


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # long timeout: the first run spends a while building the cache on rank 0 before the barrier
    dist.init_process_group("nccl", timeout=timedelta(minutes=90))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    cache = {s: os.path.join(args.out, f"cache_{s}_h{H}.npz") for s in ("train", "val")}
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        for split, path in cache.items():
            if not os.path.exists(path):
                build_cache(args.lam, split, path)
    dist.barrier()

    train_ds = CachedLines(cache["train"])
    val_ds = CachedLines(cache["val"], charset=train_ds.charset)
    charset = train_ds.charset
    train_bs = GlobalBucketBatchSampler(train_ds.widths, args.budget, rank, world, shuffle=True, seed=args.seed)
    val_bs = GlobalBucketBatchSampler(val_ds.widths, args.budget, rank, world, shuffle=False)
    train_loader = DataLoader(train_ds, batch_sampler=train_bs, collate_fn=collate, num_workers=args.workers,
                              pin_memory=True)
    val_loader = DataLoader(val_ds, batch_sampler=val_bs, collate_fn=collate, num_workers=args.workers)

    net = Recognizer(len(charset) + 1, layers=args.layers).to(device)
    ema = copy.deepcopy(net).eval().requires_grad_(False)
    model = DDP(net, device_ids=[local_rank], static_graph=True)
    lr = args.lr * world / 4
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    total = args.epochs * len(train_bs)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total, pct_start=0.08)
    ctc = nn.CTCLoss(zero_infinity=True)

    best = float("inf")
    for epoch in range(args.epochs):
        train_bs.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, widths, y, ylen, _ in train_loader:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, lens = model(x.to(device, non_blocking=True), widths.to(device))
            lp = logits.float().log_softmax(-1).transpose(0, 1)
            loss = ctc(lp, y.to(device), lens, ylen.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            with torch.no_grad():  # grads are all-reduced, so every rank's EMA stays identical
                for pe, p in zip(ema.parameters(), net.parameters()):
                    pe.lerp_(p, 1 - args.ema)

        s = cer_stats(ema, val_loader, charset, device)
        dist.all_reduce(s)
        cer = (s[0] / s[1]).item()
        if rank == 0:
            print(f"epoch {epoch} {time.time() - t0:.0f}s EMA val CER {cer:.4f}", flush=True)
            ck = {"model": net.state_dict(), "ema": ema.state_dict(), "charset": charset, "epoch": epoch}
            torch.save(ck, os.path.join(args.out, "last.pt"))
            if cer < best:
                best = cer
                torch.save(ck, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
