"""MViTv2-S fine-tuning on Kinetics subsets / Diving48, decord loader, torch.amp, wandb.

torchrun --standalone --nproc_per_node=8 16_mvit_wandb.py --root /data/diving48 --num-classes 48
"""
import argparse
import math
import os
import random
import time

import decord
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.video import MViT_V2_S_Weights, mvit_v2_s


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--num-classes", type=int, default=48)
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--label-smoothing", type=float, default=0.1)
    ap.add_argument("--project", default="video-mvit")
    ap.add_argument("--run-name", default=None)
    ap.add_argument("--out", default="work_dirs/mvit_diving48")
    return ap.parse_args()


class DivingClips(Dataset):
    def __init__(self, root, split, frames, train):
        self.root, self.frames, self.train = root, frames, train
        self.samples = []
        with open(os.path.join(root, f"{split}.txt")) as f:
            for line in f:
                name, label = line.split()
                self.samples.append((os.path.join(root, "rgb", name + ".mp4"), int(label)))
        self.mean = torch.tensor([0.45, 0.45, 0.45]).view(3, 1, 1, 1)
        self.std = torch.tensor([0.225, 0.225, 0.225]).view(3, 1, 1, 1)

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, y = self.samples[i]
        vr = decord.VideoReader(path, width=256, height=256, num_threads=1)
        n = len(vr)
        # segment-based sampling, one frame per segment
        edges = np.linspace(0, n, self.frames + 1)
        if self.train:
            idx = [random.randint(int(edges[k]), max(int(edges[k]), int(edges[k + 1]) - 1)) for k in range(self.frames)]
        else:
            idx = [int((edges[k] + edges[k + 1]) / 2) for k in range(self.frames)]
        x = torch.from_numpy(vr.get_batch(np.clip(idx, 0, n - 1)).asnumpy()).permute(3, 0, 1, 2).float() / 255
        if self.train:
            s = random.randint(180, 256)
            t, l = random.randint(0, 256 - s), random.randint(0, 256 - s)
            x = F.interpolate(x[:, :, t:t + s, l:l + s], size=(224, 224), mode="bilinear", align_corners=False)
        else:
            x = x[:, :, 16:240, 16:240]
        return (x - self.mean) / self.std, y


def build_model(num_classes):
    m = mvit_v2_s(weights=MViT_V2_S_Weights.KINETICS400_V1)
    m.head[1] = nn.Linear(m.head[1].in_features, num_classes)
    return m


def lr_lambda(step, warmup, total):
    if step < warmup:
        return step / max(1, warmup)
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        acc += torch.tensor([(out.argmax(1) == y).sum().item(), y.numel()], device=device, dtype=torch.float)
    dist.all_reduce(acc)
    return (acc[0] / acc[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    if rank == 0:
        wandb.init(project=args.project, name=args.run_name, config=vars(args) | {"world_size": world})

    train_ds = DivingClips(args.root, "train", args.frames, True)
    val_ds = DivingClips(args.root, "test", args.frames, False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=8, pin_memory=True,
                              drop_last=True, persistent_workers=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)), args.batch_size,
                            num_workers=8, pin_memory=True)

    model = DDP(build_model(args.num_classes).to(device), device_ids=[local_rank])
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim <= 1 or "pos" in n else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr * args.batch_size * args.accum * world / 64)
    total = args.epochs * len(train_loader) // args.accum
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, total // 10, total))

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            sync = (i + 1) % args.accum == 0
            ctx = model.no_sync() if not sync else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x), y, label_smoothing=args.label_smoothing) / args.accum
                loss.backward()
            if sync:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                sched.step()
                step += 1
                wandb.log({"train/loss": loss.item() * args.accum, "train/lr": sched.get_last_lr()[0],
                           "epoch": epoch}, step=step)
        val_acc = evaluate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} val acc {val_acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            wandb.log({"val/acc": val_acc}, step=step)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pt"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
