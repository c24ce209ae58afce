"""Sim-to-real visual encoder: regress 6D object pose + gripper keypoints from
domain-randomised renders, validate on a small labelled set of real images.

    torchrun --nproc_per_node=8 06_sim2real_pose_encoder.py --sim_root /data/renders/dr_v3 --real_root /data/real_val
"""
import argparse
import json
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms.v2 as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from torch.utils.tensorboard import SummaryWriter


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--sim_root", required=True)
    p.add_argument("--real_root", required=True)
    p.add_argument("--out", default="runs/pose_encoder")
    p.add_argument("--global_batch", type=int, default=64)
    p.add_argument("--img_size", type=int, default=320)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--warmup_epochs", type=int, default=3)
    p.add_argument("--n_kpts", type=int, default=8)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--resume", default="")
    return p.parse_args()


class PoseDataset(Dataset):
    """index.json: list of {"image": rel_path, "rot6d": [6], "trans": [3], "kpts": [[u, v], ...]}"""

    def __init__(self, root, img_size, train):
        with open(os.path.join(root, "index.json")) as f:
            self.items = json.load(f)
        self.root = root
        aug = [T.ColorJitter(0.4, 0.4, 0.4, 0.1), T.RandomGrayscale(0.1),
               T.GaussianBlur(5, sigma=(0.1, 2.0))] if train else []
        self.tf = T.Compose([T.Resize((img_size, img_size)), *aug, T.ToImage(), T.ToDtype(torch.float32, scale=True),
                             T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        img = Image.open(os.path.join(self.root, it["image"])).convert("RGB")
        target = torch.tensor(it["rot6d"] + it["trans"] + sum(it["kpts"], []), dtype=torch.float32)
        return self.tf(img), target


def rot6d_to_matrix(x):
    a1, a2 = x[..., :3], x[..., 3:6]
    b1 = F.normalize(a1, dim=-1)
    b2 = F.normalize(a2 - (b1 * a2).sum(-1, keepdim=True) * b1, dim=-1)
    return torch.stack([b1, b2, torch.cross(b1, b2, dim=-1)], dim=-2)


def geodesic_deg(r1, r2):
    cos = ((r1.transpose(-1, -2) @ r2).diagonal(dim1=-2, dim2=-1).sum(-1) - 1) / 2
    return torch.rad2deg(torch.acos(cos.clamp(-1 + 1e-6, 1 - 1e-6)))


class PoseEncoder(nn.Module):
    def __init__(self, n_kpts):
        super().__init__()
        backbone = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        backbone.fc = nn.Identity()
        self.backbone = backbone
        self.head = nn.Sequential(nn.Linear(2048, 512), nn.GELU(), nn.Linear(512, 9 + 2 * n_kpts))

    def forward(self, x):
        return self.head(self.backbone(x))


def pose_loss(pred, target):
    rot_l = F.mse_loss(rot6d_to_matrix(pred[:, :6]), rot6d_to_matrix(target[:, :6]))
    trans_l = F.smooth_l1_loss(pred[:, 6:9], target[:, 6:9])
    kpt_l = F.smooth_l1_loss(pred[:, 9:], target[:, 9:])
    return rot_l + trans_l + 0.5 * kpt_l


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    sums = torch.zeros(4, device=device)
    for img, tgt in loader:
        img, tgt = img.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
        pred = model(img)
        rot_err = geodesic_deg(rot6d_to_matrix(pred[:, :6]), rot6d_to_matrix(tgt[:, :6]))
        trans_err = (pred[:, 6:9] - tgt[:, 6:9]).norm(dim=-1) * 100.0  # cm
        sums += torch.stack([rot_err.sum(), trans_err.sum(), ((rot_err < 5) & (trans_err < 2)).float().sum(),
                             torch.tensor(float(len(img)), device=device)])
    dist.all_reduce(sums)
    n = sums[3].clamp_min(1)
    return {"rot_deg": (sums[0] / n).item(), "trans_cm": (sums[1] / n).item(), "acc_5deg_2cm": (sums[2] / n).item()}


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    per_gpu = args.global_batch // world
    sim = PoseDataset(args.sim_root, args.img_size, train=True)
    real = PoseDataset(args.real_root, args.img_size, train=False)
    sim_sampler = DistributedSampler(sim, shuffle=True, drop_last=True)
    sim_dl = DataLoader(sim, per_gpu, sampler=sim_sampler, num_workers=args.workers, pin_memory=True,
                        drop_last=True, persistent_workers=True)
    # strided shard without padding so every real image is counted exactly once
    real_dl = DataLoader(Subset(real, range(rank, len(real), world)), per_gpu, shuffle=False, num_workers=4,
                         pin_memory=True)

    model = PoseEncoder(args.n_kpts).to(device)
    model = DDP(model, device_ids=[local_rank])

    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr)
    steps_per_epoch = len(sim_dl)
    total, warm = args.epochs * steps_per_epoch, args.warmup_epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, best = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]

    writer = SummaryWriter(args.out) if rank == 0 else None
    for epoch in range(start_epoch, args.epochs):
        sim_sampler.set_epoch(epoch)
        model.train()
        run = torch.zeros(2, device=device)
        for i, (img, tgt) in enumerate(sim_dl):
            img, tgt = img.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(img)
            loss = pose_loss(pred.float(), tgt)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
            if rank == 0 and i % 100 == 0:
                writer.add_scalar("train/loss_step", loss.item(), epoch * steps_per_epoch + i)

        dist.all_reduce(run)
        metrics = validate(model, real_dl, device)
        if rank == 0:
            writer.add_scalar("train/loss", (run[0] / run[1]).item(), epoch)
            for k, v in metrics.items():
                writer.add_scalar(f"real/{k}", v, epoch)
            print(f"[{epoch}] loss {(run[0] / run[1]).item():.4f} real {metrics}", flush=True)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "scaler": scaler.state_dict(), "epoch": epoch, "best": max(best, metrics["acc_5deg_2cm"])}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if metrics["acc_5deg_2cm"] > best:
                best = metrics["acc_5deg_2cm"]
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
