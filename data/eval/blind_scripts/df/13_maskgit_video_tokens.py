"""MaskGIT-style class-conditional video generation on pre-tokenised Kinetics-600 clips.

Videos are tokenised once with the 3D VQ tokenizer (4x temporal, 8x spatial); clips keep their own length
(2..8 latent frames of 16x16 tokens), so batches are built from clips of the same length.

    torchrun --nproc_per_node=8 13_maskgit_video_tokens.py --tokens /data/k600_tokens --out runs/maskgit_k600
"""
import argparse
import json
import math
import os
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CODEBOOK = 8192
MASK_ID = CODEBOOK
NUM_CLASSES = 600
MAX_T, GRID = 8, 16


class TokenClips(Dataset):
    def __init__(self, root, split):
        with open(os.path.join(root, f"{split}.jsonl")) as f:
            self.items = [json.loads(l) for l in f]
        self.root = root
        self.lengths = [min(it["t"], MAX_T) for it in self.items]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        tok = np.load(os.path.join(self.root, it["file"]))[:MAX_T].astype(np.int64)  # t x 16 x 16
        return torch.from_numpy(tok), it["label"]


class LengthBucketBatchSampler:
    """Batches of clips with the same number of latent frames, drawn from this rank's shard."""

    def __init__(self, lengths, batch_size, num_replicas, rank, seed=0):
        self.lengths, self.batch_size = lengths, batch_size
        self.sampler = DistributedSampler(range(len(lengths)), num_replicas=num_replicas, rank=rank,
                                          shuffle=True, seed=seed, drop_last=True)

    def set_epoch(self, epoch):
        self.sampler.set_epoch(epoch)

    def __iter__(self):
        buckets = defaultdict(list)
        for idx in self.sampler:
            t = self.lengths[idx]
            buckets[t].append(idx)
            if len(buckets[t]) == self.batch_size:
                yield buckets.pop(t)

    def __len__(self):
        return len(self.sampler) // self.batch_size


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.n1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.n2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.n1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.n2(x))


class VideoMaskGIT(nn.Module):
    def __init__(self, dim=768, depth=16, heads=12):
        super().__init__()
        self.tok = nn.Embedding(CODEBOOK + 1, dim)
        self.cls = nn.Embedding(NUM_CLASSES + 1, dim)  # + null class for guidance
        self.pos_t = nn.Parameter(torch.zeros(MAX_T, 1, dim))
        self.pos_s = nn.Parameter(torch.zeros(1, GRID * GRID, dim))
        nn.init.trunc_normal_(self.pos_t, std=0.02)
        nn.init.trunc_normal_(self.pos_s, std=0.02)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, CODEBOOK)

    def forward(self, tokens, labels):
        b, t, h, w = tokens.shape
        x = self.tok(tokens.view(b, t, h * w)) + self.pos_t[:t] + self.pos_s
        x = torch.cat([self.cls(labels)[:, None], x.view(b, t * h * w, -1)], 1)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x[:, 1:])).view(b, t, h, w, CODEBOOK)


def random_mask(tokens):
    b = tokens.shape[0]
    n = tokens[0].numel()
    r = torch.rand(b, device=tokens.device)
    ratio = torch.cos(r * math.pi / 2)  # cosine schedule
    num = (ratio * n).clamp(min=1).long()
    scores = torch.rand(b, n, device=tokens.device)
    thresh = scores.sort(1).values.gather(1, (num - 1)[:, None])
    mask = (scores <= thresh).view_as(tokens)
    return torch.where(mask, torch.full_like(tokens, MASK_ID), tokens), mask


@torch.no_grad()
def validate(net, val_set, device, rank, world):
    net.eval()
    g = torch.Generator(device=device).manual_seed(1234 + rank)
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    for i in range(rank, len(val_set), world):
        tok, label = val_set[i]
        tok = tok.unsqueeze(0).to(device)
        scores = torch.rand(tok.numel(), device=device, generator=g).view_as(tok)
        mask = scores < 0.5
        inp = torch.where(mask, torch.full_like(tok, MASK_ID), tok)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(inp, torch.tensor([label], device=device))
        logits = logits.float()
        acc[0] += F.cross_entropy(logits[mask], tok[mask], reduction="sum")
        acc[1] += (logits[mask].argmax(-1) == tok[mask]).sum()
        acc[2] += mask.sum()
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch_size", type=int, default=16, help="per GPU")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--warmup", type=int, default=5000)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--label_drop", type=float, default=0.1)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_set, val_set = TokenClips(args.tokens, "train"), TokenClips(args.tokens, "val")
    batch_sampler = LengthBucketBatchSampler(train_set.lengths, args.batch_size, world, rank)
    loader = DataLoader(train_set, batch_sampler=batch_sampler, num_workers=6, pin_memory=True)

    net = VideoMaskGIT().to(device)
    model = DDP(net, device_ids=[local_rank])
    decay = [p for n, p in net.named_parameters() if p.ndim >= 2 and "pos_" not in n]
    no_decay = [p for n, p in net.named_parameters() if p.ndim < 2 or "pos_" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.96))
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    torch.manual_seed(rank + 1)

    step = 0
    for epoch in range(args.epochs):
        batch_sampler.set_epoch(epoch)
        model.train()
        for tokens, labels in loader:
            tokens, labels = tokens.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            labels = torch.where(torch.rand(labels.shape, device=device) < args.label_drop,
                                 torch.full_like(labels, NUM_CLASSES), labels)
            inp, mask = random_mask(tokens)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(inp, labels)
            loss = F.cross_entropy(logits.float()[mask], tokens[mask], label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step} T={tokens.shape[1]} loss {loss.item():.4f} "
                      f"lr {sched.get_last_lr()[0]:.2e}", flush=True)

        vloss, vacc = validate(net, val_set, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} val loss {vloss:.4f} masked-token acc {vacc:.4f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(args.out, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
