"""Joint space-time ViT-B on Something-Something V2 (mmaction-style video lists).

Lists look like:  "78687.webm 45"  (video file, label in [0, 174))

    torchrun --nproc_per_node=8 14_vit_st_ssv2.py --video-dir /data/sthv2/videos \
        --train-list /data/sthv2/sthv2_train_list_videos.txt --val-list /data/sthv2/sthv2_val_list_videos.txt \
        --init /ckpt/vit_b_k400_videomae_ft.pth --work-dir /exp/vit_st_ssv2
"""
import argparse
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from timm.models.layers import DropPath, Mlp, trunc_normal_
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--video-dir", required=True)
    ap.add_argument("--train-list", required=True)
    ap.add_argument("--val-list", required=True)
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--init", default="")
    ap.add_argument("--global-pool", default="avg", choices=["avg", "token"])
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=6)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--warmup-epochs", type=int, default=5)
    ap.add_argument("--blr", type=float, default=5e-4)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--drop-path", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=10)
    return ap.parse_args()


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).unbind(2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class Block(nn.Module):
    def __init__(self, dim, heads, dp):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim, eps=1e-6), Attention(dim, heads)
        self.norm2, self.mlp = nn.LayerNorm(dim, eps=1e-6), Mlp(dim, 4 * dim)
        self.drop_path = DropPath(dp) if dp > 0 else nn.Identity()

    def forward(self, x):
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class SpaceTimeViT(nn.Module):
    def __init__(self, num_classes=174, frames=16, img=224, patch=16, tubelet=2, dim=768, depth=12, heads=12,
                 drop_path=0.1, global_pool="avg"):
        super().__init__()
        self.global_pool = global_pool
        self.patch_embed = nn.Conv3d(3, dim, (tubelet, patch, patch), (tubelet, patch, patch))
        self.t, self.hw = frames // tubelet, (img // patch) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed_spatial = nn.Parameter(torch.zeros(1, self.hw, dim))
        self.pos_embed_temporal = nn.Parameter(torch.zeros(1, self.t, dim))
        dpr = torch.linspace(0, drop_path, depth).tolist()
        self.blocks = nn.ModuleList([Block(dim, heads, dpr[i]) for i in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.fc_norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)
        for p in (self.cls_token, self.pos_embed_spatial, self.pos_embed_temporal):
            trunc_normal_(p, std=0.02)
        trunc_normal_(self.head.weight, std=0.02)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # B, t*hw, C
        pos = (self.pos_embed_temporal[:, :, None] + self.pos_embed_spatial[:, None]).flatten(1, 2)
        x = x + pos
        if self.global_pool == "token":
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        for blk in self.blocks:
            x = blk(x)
        if self.global_pool == "avg":
            x = self.fc_norm(x.mean(1))
        else:
            x = self.norm(x)[:, 0]
        return self.head(x)


MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1, 1)


class SthV2(Dataset):
    def __init__(self, list_file, video_dir, frames, train, size=224):
        with open(list_file) as f:
            self.items = [(os.path.join(video_dir, a), int(b)) for a, b in (l.split() for l in f if l.strip())]
        self.frames, self.train, self.size = frames, train, size

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i]
        vr = VideoReader(path, ctx=cpu(0), num_threads=1)
        n = len(vr)
        seg = n / self.frames
        offs = [random.random() for _ in range(self.frames)] if self.train else [0.5] * self.frames
        ids = np.clip([int(seg * (k + o)) for k, o in enumerate(offs)], 0, n - 1)
        x = torch.from_numpy(vr.get_batch(ids).asnumpy()).permute(0, 3, 1, 2).float() / 255.0
        h, w = x.shape[-2:]
        if self.train:
            area = random.uniform(0.25, 1.0) * h * w
            ar = math.exp(random.uniform(math.log(0.75), math.log(1.33)))
            ch, cw = min(h, int(math.sqrt(area / ar))), min(w, int(math.sqrt(area * ar)))
            a, b = random.randint(0, h - ch), random.randint(0, w - cw)
            x = x[..., a:a + ch, b:b + cw]
        else:
            c = min(h, w)
            x = x[..., (h - c) // 2:(h - c) // 2 + c, (w - c) // 2:(w - c) // 2 + c]
        x = F.interpolate(x, size=(self.size, self.size), mode="bilinear", align_corners=False)
        return (x.transpose(0, 1) - MEAN) / STD, label


class ValShard(torch.utils.data.Sampler):
    def __init__(self, n, world, rank):
        self.ids = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.ids)

    def __len__(self):
        return len(self.ids)


@torch.no_grad()
def validate(net, loader, device):
    net.eval()
    s = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(x)
        top5 = logits.topk(5, 1).indices
        s += torch.stack([(top5[:, 0] == y).sum(), (top5 == y[:, None]).any(1).sum(),
                          torch.tensor(y.numel(), device=device)]).float()
    dist.all_reduce(s)
    return (100 * s[0] / s[2]).item(), (100 * s[1] / s[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    random.seed(rank)

    train_ds = SthV2(args.train_list, args.video_dir, args.frames, train=True)
    val_ds = SthV2(args.val_list, args.video_dir, args.frames, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                          num_workers=args.workers, pin_memory=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, sampler=ValShard(len(val_ds), world, rank),
                        num_workers=args.workers, pin_memory=True)

    model = SpaceTimeViT(num_classes=174, frames=args.frames, drop_path=args.drop_path,
                         global_pool=args.global_pool)
    if args.init:
        sd = torch.load(args.init, map_location="cpu")
        sd = {k: v for k, v in sd.get("model", sd).items() if not k.startswith("head.")}
        msg = model.load_state_dict(sd, strict=False)
        if rank == 0:
            print("init:", msg)
    model = DDP(model.to(device), device_ids=[local_rank])

    lr = args.blr * args.batch_size * world / 256
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and "pos_embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1 or "pos_embed" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.999))
    iters = len(train_dl)
    warm, total = args.warmup_epochs * iters, args.epochs * iters

    writer = None
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
        writer = SummaryWriter(args.work_dir)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y) in enumerate(train_dl):
            step = epoch * iters + it
            cur_lr = lr * step / warm if step < warm else lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm)))
            for g in optimizer.param_groups:
                g["lr"] = cur_lr
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if writer is not None and it % 20 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/lr", cur_lr, step)
        top1, top5 = validate(model.module, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s): val top1 {top1:.2f} top5 {top5:.2f}", flush=True)
            writer.add_scalar("val/top1", top1, epoch)
            writer.add_scalar("val/top5", top5, epoch)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
            torch.save(state, os.path.join(args.work_dir, "latest.pth"))
            if top1 > best:
                best = top1
                torch.save(state["model"], os.path.join(args.work_dir, "best.pth"))

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
