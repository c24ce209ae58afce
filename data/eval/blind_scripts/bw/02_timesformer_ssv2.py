"""TimeSformer (divided space-time attention) on Something-Something V2.

SSv2 ships JSON annotations:
  something-something-v2-labels.json      {"Approaching something with your camera": "0", ...}
  something-something-v2-train.json       [{"id": "78687", "template": "Holding [something] ...", ...}]
  something-something-v2-validation.json
The .webm videos are decoded with PyAV.

torchrun --nproc_per_node=8 02_timesformer_ssv2.py --root /datasets/ssv2 --out /checkpoints/tsf_ssv2
"""
import argparse
import json
import math
import os
import random

import av
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from timm.models.layers import DropPath, Mlp, trunc_normal_
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler

IMAGENET_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1, 1)
IMAGENET_STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1, 1)


# ----------------------------------------------------------------------------- model
class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(b, n, c))


class DividedBlock(nn.Module):
    def __init__(self, dim, heads, drop_path):
        super().__init__()
        self.norm_t = nn.LayerNorm(dim)
        self.attn_t = Attention(dim, heads)
        self.temporal_fc = nn.Linear(dim, dim)
        self.norm_s = nn.LayerNorm(dim)
        self.attn_s = Attention(dim, heads)
        self.norm_mlp = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, dim * 4)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x, t):
        # x: (B, 1 + T*N, C) with the cls token first
        cls, tokens = x[:, :1], x[:, 1:]
        b, tn, c = tokens.shape
        n = tn // t
        xt = tokens.reshape(b, t, n, c).transpose(1, 2).reshape(b * n, t, c)
        xt = self.temporal_fc(self.attn_t(self.norm_t(xt)))
        tokens = tokens + self.drop_path(xt.reshape(b, n, t, c).transpose(1, 2).reshape(b, tn, c))

        xs = tokens.reshape(b * t, n, c)
        cls_rep = cls.repeat_interleave(t, dim=0)
        xs = torch.cat([cls_rep, xs], dim=1)
        xs = self.attn_s(self.norm_s(xs))
        cls = cls + self.drop_path(xs[:, :1].reshape(b, t, c).mean(1, keepdim=True))
        tokens = tokens + self.drop_path(xs[:, 1:].reshape(b, tn, c))
        x = torch.cat([cls, tokens], dim=1)
        return x + self.drop_path(self.mlp(self.norm_mlp(x)))


class TimeSformer(nn.Module):
    def __init__(self, num_classes, frames=8, img=224, patch=16, dim=768, depth=12, heads=12,
                 drop_path=0.1):
        super().__init__()
        self.frames = frames
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        num_patches = (img // patch) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, dim))
        self.time_embed = nn.Parameter(torch.zeros(1, frames, dim))
        dpr = torch.linspace(0, drop_path, depth).tolist()
        self.blocks = nn.ModuleList([DividedBlock(dim, heads, dpr[i]) for i in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        for p in (self.cls_token, self.pos_embed, self.time_embed):
            trunc_normal_(p, std=0.02)

    def forward(self, x):
        b, c, t, h, w = x.shape
        x = self.patch_embed(x.transpose(1, 2).reshape(b * t, c, h, w)).flatten(2).transpose(1, 2)
        n = x.shape[1]
        x = torch.cat([self.cls_token.expand(b * t, -1, -1), x], dim=1) + self.pos_embed
        cls = x[:b * t:t, :1]  # the cls token of the first frame of every clip
        x = x[:, 1:].reshape(b, t, n, -1) + self.time_embed[:, :t, None]
        x = torch.cat([cls, x.reshape(b, t * n, -1)], dim=1)
        for blk in self.blocks:
            x = blk(x, t)
        return self.head(self.norm(x)[:, 0])


# ----------------------------------------------------------------------------- data
def load_ssv2(root, split):
    with open(os.path.join(root, "something-something-v2-labels.json")) as f:
        label_map = {k: int(v) for k, v in json.load(f).items()}
    with open(os.path.join(root, f"something-something-v2-{split}.json")) as f:
        entries = json.load(f)
    samples = []
    for e in entries:
        template = e["template"].replace("[", "").replace("]", "")
        samples.append((os.path.join(root, "videos", e["id"] + ".webm"), label_map[template]))
    return samples


def decode_all(path):
    with av.open(path) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])


class SSv2(Dataset):
    """Segment-based sampling (TSN style). No horizontal flip: SSv2 has left/right classes."""

    def __init__(self, samples, frames, size, train, clips=1, crops=1):
        self.samples, self.frames, self.size, self.train = samples, frames, size, train
        self.clips, self.crops = clips, crops

    def __len__(self):
        return len(self.samples) * self.clips * self.crops

    def __getitem__(self, idx):
        vid, view = divmod(idx, self.clips * self.crops)
        clip, crop = divmod(view, self.crops)
        path, label = self.samples[vid]
        video = decode_all(path)
        seg = len(video) / self.frames
        if self.train:
            ids = [int(seg * i + random.random() * seg) for i in range(self.frames)]
        else:
            offset = (clip + 0.5) / self.clips
            ids = [int(seg * (i + offset)) for i in range(self.frames)]
        x = torch.from_numpy(video[np.clip(ids, 0, len(video) - 1)]).permute(3, 0, 1, 2).float() / 255
        t = x.shape[1]
        if self.train:
            scale = random.uniform(0.5, 1.0)
            h, w = x.shape[-2:]
            ch, cw = int(h * scale), int(w * scale)
            i, j = random.randint(0, h - ch), random.randint(0, w - cw)
            x = x[..., i:i + ch, j:j + cw]
            x = F.interpolate(x.transpose(0, 1), size=(self.size, self.size), mode="bilinear",
                              align_corners=False).transpose(0, 1)
        else:
            h, w = x.shape[-2:]
            scale = self.size / min(h, w)
            x = F.interpolate(x.transpose(0, 1), scale_factor=scale, mode="bilinear",
                              align_corners=False).transpose(0, 1)
            h, w = x.shape[-2:]
            pos = 1 if self.crops == 1 else crop
            i = (h - self.size) * pos // 2 if h > w else (h - self.size) // 2
            j = (w - self.size) * pos // 2 if w >= h else (w - self.size) // 2
            x = x[..., i:i + self.size, j:j + self.size]
        assert x.shape[1] == t
        return (x - IMAGENET_MEAN) / IMAGENET_STD, label, vid


class StridedShard(Sampler):
    def __init__(self, n, world, rank):
        self.idx = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.idx)

    def __len__(self):
        return len(self.idx)


def all_gather_varlen(t, world):
    """all_gather for tensors whose first dimension differs between ranks."""
    n = torch.tensor([t.shape[0]], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    sizes = [int(s) for s in sizes]
    padded = t.new_zeros((max(sizes),) + t.shape[1:])
    padded[: t.shape[0]] = t
    out = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return torch.cat([o[:s] for o, s in zip(out, sizes)])


@torch.no_grad()
def evaluate(net, loader, n_videos, world, device):
    net.eval()
    probs, vids, labels = [], [], []
    for x, y, v in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(x.to(device, non_blocking=True))
        probs.append(logits.float().softmax(-1))
        vids.append(v.to(device))
        labels.append(y.to(device))
    probs = all_gather_varlen(torch.cat(probs), world)
    vids = all_gather_varlen(torch.cat(vids), world)
    labels = all_gather_varlen(torch.cat(labels), world)
    video_scores = torch.zeros(n_videos, probs.shape[1], device=device).index_add_(0, vids, probs)
    video_labels = torch.zeros(n_videos, dtype=torch.long, device=device)
    video_labels[vids] = labels
    return (video_scores.argmax(1) == video_labels).float().mean().item() * 100


# ----------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--pretrained", default="", help="ImageNet-21k ViT-B/16 weights (.pth)")
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--bs", type=int, default=8, help="per GPU")
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--warmup", type=float, default=1.0, help="epochs")
    ap.add_argument("--lr", type=float, default=5e-3, help="SGD lr for a global batch of 64")
    ap.add_argument("--minival", type=float, default=0.02, help="fraction of train held out")
    ap.add_argument("--split-seed", type=int, default=1234)
    ap.add_argument("--workers", type=int, default=10)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(rank)

    # a small held-out minival from the training set for model selection; the
    # split uses its own generator with a fixed seed, so every rank gets the same one
    train_all = load_ssv2(args.root, "train")
    order = list(range(len(train_all)))
    random.Random(args.split_seed).shuffle(order)
    n_minival = int(len(order) * args.minival)
    minival = [train_all[i] for i in order[:n_minival]]
    train = [train_all[i] for i in order[n_minival:]]
    val = load_ssv2(args.root, "validation")

    train_ds = SSv2(train, args.frames, 224, train=True)
    minival_ds = SSv2(minival, args.frames, 224, train=False)
    test_ds = SSv2(val, args.frames, 224, train=False, clips=2, crops=3)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.split_seed)
    train_dl = DataLoader(train_ds, args.bs, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    minival_dl = DataLoader(minival_ds, args.bs, sampler=StridedShard(len(minival_ds), world, rank),
                            num_workers=args.workers)
    test_dl = DataLoader(test_ds, args.bs, sampler=StridedShard(len(test_ds), world, rank),
                         num_workers=args.workers)

    net = TimeSformer(num_classes=174, frames=args.frames)
    if args.pretrained:
        sd = torch.load(args.pretrained, map_location="cpu")
        missing, unexpected = net.load_state_dict(sd, strict=False)
        if rank == 0:
            print(f"loaded {args.pretrained}: {len(missing)} missing, {len(unexpected)} unexpected")
    net.to(device)
    ddp = DistributedDataParallel(net, device_ids=[local_rank])

    lr = args.lr * args.bs * world / 64
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    steps_per_epoch = len(train_dl)
    total, warm = args.epochs * steps_per_epoch, int(args.warmup * steps_per_epoch)

    def lr_at(step):
        if step < warm:
            return lr * (step + 1) / warm
        return lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm)))

    start, best = 0, 0.0
    last = os.path.join(args.out, "last.pt")
    if os.path.exists(last):
        ck = torch.load(last, map_location="cpu")
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start, best = ck["epoch"] + 1, ck["best"]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        loss_sum = torch.zeros(2, device=device)
        for it, (x, y, _) in enumerate(train_dl):
            cur_lr = lr_at(epoch * steps_per_epoch + it)
            for g in opt.param_groups:
                g["lr"] = cur_lr
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            loss_sum += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} it {it}/{steps_per_epoch} loss {loss.item():.3f} "
                      f"lr {cur_lr:.2e}", flush=True)
        dist.all_reduce(loss_sum)
        acc = evaluate(net, minival_dl, len(minival), world, device)
        if rank == 0:
            print(f"epoch {epoch}: train loss {(loss_sum[0] / loss_sum[1]).item():.4f} "
                  f"minival top1 {acc:.2f}", flush=True)
            ck = {"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "best": max(best, acc)}
            torch.save(ck, last + ".tmp")
            os.replace(last + ".tmp", last)
            if acc > best:
                torch.save(net.state_dict(), os.path.join(args.out, "best.pt"))
        best = max(best, acc)

    dist.barrier()  # best.pt must be fully written before anyone reads it
    net.load_state_dict(torch.load(os.path.join(args.out, "best.pt"), map_location="cpu"))
    acc = evaluate(net, test_dl, len(val), world, device)
    if rank == 0:
        print(f"SSv2 validation, 2 clips x 3 crops: top1 {acc:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
