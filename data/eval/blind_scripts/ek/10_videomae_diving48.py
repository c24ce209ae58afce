# VideoMAE ViT-S fine-tuning on our fine-grained diving clips (Diving48 classes + in-house recordings).
# One annotation json for everything; 10% is held out for validation.
#   torchrun --nproc_per_node=8 10_videomae_diving48.py --anno /data/dive/annotations.json \
#       --video_root /data/dive/videos --pretrained ckpts/videomae_vits_k400_pt.pth
import argparse
import json
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--anno", required=True)
    ap.add_argument("--video_root", required=True)
    ap.add_argument("--pretrained", default="")
    ap.add_argument("--out", default="exps/dive_vits")
    ap.add_argument("--val_ratio", type=float, default=0.1)
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--blr", type=float, default=1e-3)
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


class Block(nn.Module):
    def __init__(self, dim=384, heads=6):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * 4), nn.GELU(), nn.Linear(dim * 4, dim))

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(B, N, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C)
        x = x + self.proj(a)
        return x + self.mlp(self.norm2(x))


class VideoViTS(nn.Module):
    def __init__(self, num_classes, frames=16, dim=384, depth=12):
        super().__init__()
        self.patch_embed = nn.Conv3d(3, dim, (2, 16, 16), (2, 16, 16))
        n = frames // 2 * 14 * 14
        angle = np.arange(n)[:, None] / np.power(10000, 2 * (np.arange(dim) // 2) / dim)
        pe = np.where(np.arange(dim) % 2 == 0, np.sin(angle), np.cos(angle))
        self.register_buffer("pos_embed", torch.from_numpy(pe).float().unsqueeze(0), persistent=False)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])
        self.fc_norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2) + self.pos_embed
        for b in self.blocks:
            x = b(x)
        return self.head(self.fc_norm(x.mean(1)))


def split_annotations(items, val_ratio):
    items = list(items)
    random.shuffle(items)
    n_val = int(len(items) * val_ratio)
    return items[n_val:], items[:n_val]


class DiveClips(Dataset):
    def __init__(self, root, items, class_to_idx, frames, train):
        self.root, self.items, self.class_to_idx = root, items, class_to_idx
        self.frames, self.train = frames, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        item = self.items[i]
        vr = VideoReader(os.path.join(self.root, item["video"]), ctx=cpu(0), num_threads=1)
        n = len(vr)
        seg = n / self.frames
        off = np.random.uniform(0, seg, self.frames) if self.train else np.full(self.frames, seg / 2)
        idx = np.minimum((np.arange(self.frames) * seg + off).astype(int), n - 1)
        x = torch.from_numpy(vr.get_batch(idx).asnumpy()).permute(3, 0, 1, 2).float() / 255.0
        x = F.interpolate(x, size=(256, 256 * x.shape[-1] // x.shape[-2]), mode="bilinear", align_corners=False)
        h, w = x.shape[-2:]
        if self.train:
            t, l = random.randint(0, h - 224), random.randint(0, w - 224)
        else:
            t, l = (h - 224) // 2, (w - 224) // 2
        x = x[..., t:t + 224, l:l + 224]
        x = (x - torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1, 1)) / torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1, 1)
        return x, self.class_to_idx[item["label"]]


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    acc = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        top5 = logits.topk(5, 1).indices
        acc += torch.stack([(top5[:, 0] == y).sum(), (top5 == y[:, None]).any(1).sum(),
                            torch.tensor(y.numel(), device=device)]).float()
    dist.all_reduce(acc)
    return (acc[0] / acc[2]).item() * 100, (acc[1] / acc[2]).item() * 100


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    seed = args.seed + rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    with open(args.anno) as f:
        anno = json.load(f)
    classes = sorted({a["label"] for a in anno})
    class_to_idx = {c: i for i, c in enumerate(classes)}
    train_items, val_items = split_annotations(anno, args.val_ratio)

    train_set = DiveClips(args.video_root, train_items, class_to_idx, args.frames, True)
    val_set = DiveClips(args.video_root, val_items, class_to_idx, args.frames, False)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)),
                            batch_size=args.batch_size, num_workers=args.workers)

    model = VideoViTS(len(classes), args.frames)
    if args.pretrained:
        sd = torch.load(args.pretrained, map_location="cpu")["model"]
        sd = {k[len("encoder."):]: v for k, v in sd.items() if k.startswith("encoder.") and not k.startswith("encoder.norm.")}
        info = model.load_state_dict(sd, strict=False)
        if rank == 0:
            print(info)
    model = DDP(model.to(device), device_ids=[local_rank])

    lr = args.blr * args.batch_size * world / 256
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.wd)
    iters = len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: s / (args.warmup * iters) if s < args.warmup * iters
        else 0.5 * (1 + math.cos(math.pi * (s - args.warmup * iters) / ((args.epochs - args.warmup) * iters))))
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    writer = SummaryWriter(args.out) if rank == 0 else None
    if rank == 0:
        print(f"{len(classes)} classes, {len(train_items)} train / {len(val_items)} val clips")

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sched.step()
            if rank == 0 and it % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), epoch * iters + it)
        top1, top5 = validate(model.module, val_loader, device)
        if rank == 0:
            writer.add_scalar("val/top1", top1, epoch)
            writer.add_scalar("val/top5", top5, epoch)
            print(f"epoch {epoch}: top1 {top1:.2f} top5 {top5:.2f} ({time.time() - t0:.0f}s)", flush=True)
            state = {"model": model.module.state_dict(), "classes": classes, "epoch": epoch}
            torch.save(state, os.path.join(args.out, "last.pth"))
            if top1 > best:
                best = top1
                torch.save(state, os.path.join(args.out, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
