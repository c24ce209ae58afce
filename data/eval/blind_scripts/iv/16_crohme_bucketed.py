"""CROHME HMER with a DenseNet-lite encoder + Transformer decoder (BTTR-like, L2R only),
area-bucketed batches and an auxiliary symbol-counting loss during the first epochs.

    torchrun --nproc_per_node=4 16_crohme_bucketed.py --root data/crohme --max_pixels 320000
"""
import argparse
import json
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="data/crohme")
    p.add_argument("--out", default="runs/crohme_bucketed")
    p.add_argument("--epochs", type=int, default=160)
    p.add_argument("--max_pixels", type=int, default=320_000, help="padded pixels per batch per GPU")
    p.add_argument("--max_batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.08)
    p.add_argument("--count_epochs", type=int, default=20, help="epochs with the auxiliary counting loss")
    p.add_argument("--beam", type=int, default=10)
    p.add_argument("--wandb", action="store_true")
    return p.parse_args()


class Crohme(Dataset):
    def __init__(self, root, split, w2i):
        meta = json.load(open(os.path.join(root, f"{split}.json")))    # [{"img", "h", "w", "tokens"}]
        self.meta, self.root, self.w2i = meta, root, w2i

    def __len__(self):
        return len(self.meta)

    def __getitem__(self, i):
        m = self.meta[i]
        a = np.asarray(Image.open(os.path.join(self.root, "img", m["img"])).convert("L"), np.float32)
        return torch.from_numpy(a / 255.0)[None], torch.tensor([self.w2i[t] for t in m["tokens"]])


class BucketBatchSampler:
    """Sorts by padded area, packs batches under a pixel budget, shuffles batches and gives every
    rank a strided share. Ranks may end up with a different number of batches; the training loop
    runs under DDP's join() for that."""

    def __init__(self, meta, max_pixels, max_batch, rank, world, seed=0):
        order = sorted(range(len(meta)), key=lambda i: (meta[i]["h"], meta[i]["w"]))
        self.batches, cur, ch, cw = [], [], 0, 0
        for i in order:
            h, w = max(ch, meta[i]["h"]), max(cw, meta[i]["w"])
            if cur and (h * w * (len(cur) + 1) > max_pixels or len(cur) == max_batch):
                self.batches.append(cur)
                cur, h, w = [], meta[i]["h"], meta[i]["w"]
            cur.append(i)
            ch, cw = h, w
        if cur:
            self.batches.append(cur)
        self.rank, self.world, self.seed, self.epoch = rank, world, seed, 0

    def set_epoch(self, e):
        self.epoch = e

    def __iter__(self):
        b = list(self.batches)
        random.Random(self.seed + self.epoch).shuffle(b)
        return iter(b[self.rank::self.world])

    def __len__(self):
        return len(self.batches[self.rank::self.world])


def collate(batch):
    xs, ys = zip(*batch)
    H, W = max(x.shape[1] for x in xs), max(x.shape[2] for x in xs)
    img, mask = torch.zeros(len(xs), 1, H, W), torch.zeros(len(xs), H, W, dtype=torch.bool)
    for i, x in enumerate(xs):
        img[i, :, : x.shape[1], : x.shape[2]] = x
        mask[i, : x.shape[1], : x.shape[2]] = True
    L = max(len(y) for y in ys) + 2
    tgt = torch.zeros(len(ys), L, dtype=torch.long)
    for i, y in enumerate(ys):
        tgt[i, : len(y) + 2] = torch.cat([torch.tensor([1]), y, torch.tensor([2])])
    return img, mask, tgt


class DenseLayer(nn.Module):
    def __init__(self, cin, growth):
        super().__init__()
        self.body = nn.Sequential(nn.GroupNorm(4, cin), nn.ReLU(), nn.Conv2d(cin, 4 * growth, 1, bias=False),
                                  nn.GroupNorm(4, 4 * growth), nn.ReLU(), nn.Conv2d(4 * growth, growth, 3, 1, 1))

    def forward(self, x):
        return torch.cat([x, self.body(x)], 1)


class DenseLite(nn.Module):
    def __init__(self, growth=24, layers=(8, 8, 8), d=256):
        super().__init__()
        ch = 48
        mods = [nn.Conv2d(1, ch, 7, 2, 3, bias=False), nn.GroupNorm(4, ch), nn.ReLU(),
                nn.MaxPool2d(2, ceil_mode=True)]
        for bi, n in enumerate(layers):
            for _ in range(n):
                mods.append(DenseLayer(ch, growth))
                ch += growth
            if bi < len(layers) - 1:
                mods += [nn.GroupNorm(4, ch), nn.Conv2d(ch, ch // 2, 1), nn.AvgPool2d(2, ceil_mode=True)]
                ch //= 2
        self.body = nn.Sequential(*mods)
        self.proj = nn.Conv2d(ch, d, 1)

    def forward(self, x):
        return self.proj(self.body(x))     # stride 16


class HMER(nn.Module):
    def __init__(self, vocab, d=256):
        super().__init__()
        self.enc = DenseLite(d=d)
        self.emb = nn.Embedding(vocab, d)
        self.dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 8, 1024, 0.3, batch_first=True), 3)
        self.head = nn.Linear(d, vocab)
        self.count_head = nn.Sequential(nn.Conv2d(d, 128, 3, padding=1), nn.ReLU(), nn.Conv2d(128, vocab, 1))
        self.d = d

    @staticmethod
    def pos2d(H, W, d, device):
        half = d // 2
        f = torch.exp(torch.arange(0, half, 2, device=device) * (-math.log(1e4) / half))
        y = torch.arange(H, device=device)[:, None] * f
        x = torch.arange(W, device=device)[:, None] * f
        py = torch.cat([y.sin(), y.cos()], -1)[:, None].expand(H, W, half)
        px = torch.cat([x.sin(), x.cos()], -1)[None].expand(H, W, half)
        return torch.cat([py, px], -1)

    def encode(self, img, mask):
        f = self.enc(img)
        m = F.max_pool2d(mask[:, None].float(), 16, ceil_mode=True)[:, 0, : f.shape[2], : f.shape[3]] > 0
        mem = f.permute(0, 2, 3, 1) + self.pos2d(f.shape[2], f.shape[3], self.d, f.device)
        return f, mem.flatten(1, 2), ~m.flatten(1)

    def decode(self, mem, mem_pad, y):
        L = y.shape[1]
        causal = torch.ones(L, L, dtype=torch.bool, device=y.device).triu(1)
        pe = self.pos2d(L, 1, self.d, y.device)[:, 0]
        h = self.dec(self.emb(y) * math.sqrt(self.d) + pe, mem, tgt_mask=causal,
                     tgt_key_padding_mask=y.eq(0), memory_key_padding_mask=mem_pad)
        return self.head(h)

    def forward(self, img, mask, y_in, with_count=False):
        f, mem, mem_pad = self.encode(img, mask)
        logits = self.decode(mem, mem_pad, y_in)
        counts = self.count_head(f).relu().sum((2, 3)) if with_count else None
        return logits, counts

    @torch.no_grad()
    def beam_search(self, img, mask, k, max_len=200):
        _, mem, mem_pad = self.encode(img, mask)
        hyps, fin = [([1], 0.0)], []
        for _ in range(max_len):
            y = torch.tensor([h[0] for h in hyps], device=img.device)
            lp = self.decode(mem.expand(len(hyps), -1, -1), mem_pad.expand(len(hyps), -1), y)[:, -1].log_softmax(-1)
            cand = []
            for (seq, s), row in zip(hyps, lp):
                v, ix = row.topk(k)
                cand += [(seq + [t], s + l) for l, t in zip(v.tolist(), ix.tolist())]
            cand.sort(key=lambda c: c[1], reverse=True)
            hyps = []
            for seq, s in cand[:k]:
                (fin if seq[-1] == 2 else hyps).append((seq, s))
            if not hyps or len(fin) >= k:
                break
        best = max(fin or hyps, key=lambda c: c[1] / len(c[0]))[0]
        return [t for t in best[1:] if t != 2]


def main():
    a = cli()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    words = json.load(open(os.path.join(a.root, "dictionary.json")))    # 0 pad, 1 sos, 2 eos
    w2i = {w: i for i, w in enumerate(words)}
    train, test = Crohme(a.root, "train", w2i), Crohme(a.root, "2014", w2i)
    bsampler = BucketBatchSampler(train.meta, a.max_pixels, a.max_batch, rank, world)
    loader = DataLoader(train, batch_sampler=bsampler, collate_fn=collate, num_workers=4, pin_memory=True)

    # count_head only gets gradients during the first `count_epochs`, hence find_unused_parameters
    model = DDP(HMER(len(words)).to(device), device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.epochs)
    run = wandb.init(project="crohme", config=vars(a)) if (a.wandb and rank == 0) else None
    os.makedirs(a.out, exist_ok=True)

    best = 0.0
    for epoch in range(a.epochs):
        bsampler.set_epoch(epoch)
        model.train()
        use_count = epoch < a.count_epochs
        with model.join():
            for img, mask, tgt in loader:
                img, mask, tgt = img.to(device), mask.to(device), tgt.to(device)
                logits, counts = model(img, mask, tgt[:, :-1], with_count=use_count)
                loss = F.cross_entropy(logits.transpose(1, 2), tgt[:, 1:], ignore_index=0)
                if use_count:
                    gt = F.one_hot(tgt, len(words)).sum(1).float()
                    gt[:, :3] = 0
                    loss = loss + 0.01 * F.smooth_l1_loss(counts, gt)
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                opt.step()
        sched.step()
        if run:
            run.log({"loss": loss.item(), "lr": sched.get_last_lr()[0]}, step=epoch)

        if (epoch + 1) % 10 == 0:
            model.eval()
            local = []
            for i in range(rank, len(test), world):
                x, y = test[i]
                x = x[None].to(device)
                m = torch.ones(1, x.shape[2], x.shape[3], dtype=torch.bool, device=device)
                local.append(model.module.beam_search(x, m, a.beam) == y.tolist())
            parts = [None] * world
            dist.all_gather_object(parts, local)
            exprate = sum(sum(p) for p in parts) / len(test)
            if rank == 0:
                print(f"epoch {epoch}: ExpRate {exprate:.4f}", flush=True)
                if run:
                    run.log({"exprate": exprate}, step=epoch)
                if exprate > best:
                    best = exprate
                    torch.save(model.module.state_dict(), os.path.join(a.out, "best.pt"))
    if run:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
