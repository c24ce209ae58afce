"""Jersey number recognition on player tracklets (SoccerNet jersey-2023 layout).

Training is frame-level: every crop of a tracklet inherits the tracklet's
number (or -1 = illegible / not visible). A ViT-S/16 predicts the number (100
classes) and a legibility score. At test time the frame predictions of a
tracklet are combined, weighted by legibility, into one tracklet-level answer.

    torchrun --nproc_per_node=4 12_jersey_number_tracklets.py --root /data/jersey-2023
"""
import argparse
import json
import math
import os
import random
import time
from pathlib import Path

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

ILLEGIBLE = -1


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--lr", type=float, default=5e-4, help="base lr per 512 crops")
    p.add_argument("--max-frames", type=int, default=48, help="frames per tracklet at test time")
    p.add_argument("--save-dir", type=Path, default=Path("exp/jersey_vits16"))
    return p.parse_args()


def build_transform(size, train):
    norm = T.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    if train:
        return T.Compose([T.Resize((size, size)), T.RandomAffine(8, translate=(0.05, 0.05), scale=(0.9, 1.1)),
                          T.ColorJitter(0.3, 0.3, 0.3, 0.05), T.ToTensor(), norm])
    return T.Compose([T.Resize((size, size)), T.ToTensor(), norm])


class CropFrames(Dataset):
    def __init__(self, root, split, size):
        gt = json.loads((root / split / f"{split}_gt.json").read_text())
        self.samples = []
        for tid, number in sorted(gt.items(), key=lambda kv: int(kv[0])):
            for img in sorted((root / split / "images" / tid).glob("*.jpg")):
                self.samples.append((img, int(number)))
        self.tf = build_transform(size, True)

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, number = self.samples[i]
        x = self.tf(Image.open(path).convert("RGB"))
        return x, max(number, 0), float(number != ILLEGIBLE)


class Tracklets(Dataset):
    def __init__(self, root, split, size, max_frames):
        gt = json.loads((root / split / f"{split}_gt.json").read_text())
        self.items = sorted(gt.items(), key=lambda kv: int(kv[0]))
        self.dir = root / split / "images"
        self.tf = build_transform(size, False)
        self.max_frames = max_frames

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        tid, number = self.items[i]
        imgs = sorted((self.dir / tid).glob("*.jpg"))
        if len(imgs) > self.max_frames:
            step = len(imgs) / self.max_frames
            imgs = [imgs[int(k * step)] for k in range(self.max_frames)]
        return torch.stack([self.tf(Image.open(p).convert("RGB")) for p in imgs]), int(number)


class JerseyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = timm.create_model("vit_small_patch16_224.augreg_in21k_ft_in1k", pretrained=True, num_classes=0)
        d = self.backbone.num_features
        self.number_head = nn.Linear(d, 100)
        self.legible_head = nn.Linear(d, 1)

    def forward(self, x):
        f = self.backbone(x)
        return self.number_head(f), self.legible_head(f).squeeze(-1)

    @torch.no_grad()
    def predict_tracklet(self, frames, legible_thr=0.5):
        logits, leg = self(frames)
        w = leg.sigmoid()
        if w.max() < legible_thr:
            return ILLEGIBLE
        score = (F.log_softmax(logits, -1) * w[:, None]).sum(0)
        return int(score.argmax())


def evaluate(model, loader, device):
    model.eval()
    hit = torch.zeros(2, device=device)
    for frames, number in loader:
        pred = model.predict_tracklet(frames[0].to(device, non_blocking=True))
        hit[0] += float(pred == int(number))
        hit[1] += 1
    dist.all_reduce(hit)
    model.train()
    return (hit[0] / hit[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(1000 + rank)

    train_ds = CropFrames(args.root, "train", args.img_size)
    test_ds = Tracklets(args.root, "test", args.img_size, args.max_frames)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=10,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    test_dl = DataLoader(torch.utils.data.Subset(test_ds, range(rank, len(test_ds), world)),
                         batch_size=1, num_workers=4)

    model = JerseyNet().to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 512
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and "pos_embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1 or "pos_embed" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}], lr=lr)
    total, warm = args.epochs * len(train_dl), len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    if rank == 0:
        args.save_dir.mkdir(parents=True, exist_ok=True)
        print(f"{len(train_ds)} training crops, {len(test_ds)} test tracklets, lr {lr:.2e}")
    best, step = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for x, number, legible in train_dl:
            x = x.to(device, non_blocking=True)
            number, legible = number.to(device), legible.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                num_logits, leg_logits = model(x)
            loss_leg = F.binary_cross_entropy_with_logits(leg_logits.float(), legible)
            loss_num = (F.cross_entropy(num_logits.float(), number, reduction="none") * legible).sum() / legible.sum().clamp(min=1)
            loss = loss_num + 0.5 * loss_leg
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            sched.step()
            if rank == 0 and step % 200 == 0:
                print(f"step {step} loss {loss.item():.4f} (num {loss_num.item():.3f} leg {loss_leg.item():.3f})",
                      flush=True)

        acc = evaluate(model, test_dl, device)
        if rank == 0:
            print(f"epoch {epoch} tracklet acc {acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": acc}, args.save_dir / "last.pt")
            if acc > best:
                best = acc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": acc}, args.save_dir / "best.pt")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
