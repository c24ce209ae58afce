"""Fragment-sampling VQA on LSVQ.

Videos are turned into "fragments": a 7x7 grid of 32x32 raw-resolution patches
per frame, spliced into 224x224 frames, and scored by a Video Swin-T. Trained
with PLCC loss + in-batch rank loss.

Launch (2 nodes x 8 GPUs):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=$MASTER:29500 03_lsvq_fragment_vqa.py --cfg cfg/lsvq_frag.yaml
"""
import argparse
import os
import random
import time

import decord
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from scipy.stats import pearsonr, spearmanr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision.models.video import Swin3D_T_Weights, swin3d_t

decord.bridge.set_bridge("torch")
MEAN = torch.tensor([123.675, 116.28, 103.53]).view(3, 1, 1, 1)
STD = torch.tensor([58.395, 57.12, 57.375]).view(3, 1, 1, 1)


def get_fragments(video, grid=7, patch=32, random_offset=True):
    """video: T,H,W,C uint8 -> C,T,grid*patch,grid*patch float."""
    t, h, w, _ = video.shape
    if min(h, w) < grid * patch:
        scale = grid * patch / min(h, w)
        video = F.interpolate(video.permute(0, 3, 1, 2).float(), scale_factor=scale,
                              mode="bilinear", align_corners=False).permute(0, 2, 3, 1)
        t, h, w, _ = video.shape
    gh, gw = h // grid, w // grid
    out = torch.zeros(t, grid * patch, grid * patch, 3, dtype=video.dtype)
    for i in range(grid):
        for j in range(grid):
            oy = random.randint(0, gh - patch) if random_offset else (gh - patch) // 2
            ox = random.randint(0, gw - patch) if random_offset else (gw - patch) // 2
            y, x = i * gh + oy, j * gw + ox
            out[:, i * patch:(i + 1) * patch, j * patch:(j + 1) * patch] = video[:, y:y + patch, x:x + patch]
    return out.permute(3, 0, 1, 2).float()


class LSVQ(Dataset):
    def __init__(self, root, list_file, clip_len=32, frame_interval=2, train=True):
        self.root = root
        self.items = []
        with open(list_file) as f:
            for line in f:
                name, _, _, mos = line.strip().split(",")[:4]
                self.items.append((name, float(mos)))
        self.clip_len, self.interval, self.train = clip_len, frame_interval, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        name, mos = self.items[i]
        vr = decord.VideoReader(os.path.join(self.root, name + ".mp4"))
        n = len(vr)
        span = self.clip_len * self.interval
        start = random.randint(0, max(0, n - span)) if self.train else max(0, (n - span) // 2)
        idx = [min(start + k * self.interval, n - 1) for k in range(self.clip_len)]
        frames = vr.get_batch(idx)
        clip = get_fragments(frames, random_offset=self.train)
        clip = (clip - MEAN) / STD
        return clip, torch.tensor(mos / 20.0, dtype=torch.float32)


class FragmentVQA(nn.Module):
    def __init__(self):
        super().__init__()
        net = swin3d_t(weights=Swin3D_T_Weights.KINETICS400_V1)
        net.head = nn.Identity()
        self.backbone = net
        self.head = nn.Sequential(nn.Linear(768, 64), nn.GELU(), nn.Linear(64, 1))

    def forward(self, x):
        return self.head(self.backbone(x)).squeeze(-1)


def plcc_loss(pred, mos):
    p = (pred - pred.mean()) / (pred.std() + 1e-8)
    m = (mos - mos.mean()) / (mos.std() + 1e-8)
    return ((1 - (p * m).mean()) / 2).clamp(min=0)


def rank_loss(pred, mos):
    dp = pred[:, None] - pred[None, :]
    dm = mos[:, None] - mos[None, :]
    return F.relu(-dp * torch.sign(dm)).sum() / (dm.ne(0).sum() + 1)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    preds, gts = [], []
    for clip, mos in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(clip.to(device, non_blocking=True))
        preds.append(out.float().cpu())
        gts.append(mos)
    preds = torch.cat(preds).numpy()
    gts = torch.cat(gts).numpy()
    model.train()
    return spearmanr(preds, gts)[0], pearsonr(preds, gts)[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    args = ap.parse_args()
    with open(args.cfg) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    random.seed(cfg["seed"] + rank)
    torch.manual_seed(cfg["seed"])

    train_ds = LSVQ(cfg["root"], cfg["train_list"], train=True)
    val_ds = LSVQ(cfg["root"], cfg["val_list"], train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=cfg["batch_size"], sampler=val_sampler,
                            num_workers=cfg["workers"], pin_memory=True)

    model = FragmentVQA().to(device)
    model = DDP(model, device_ids=[local_rank])
    param_groups = [
        {"params": model.module.backbone.parameters(), "lr": cfg["lr"] * cfg.get("backbone_lr_mult", 0.1)},
        {"params": model.module.head.parameters(), "lr": cfg["lr"]},
    ]
    optimizer = torch.optim.AdamW(param_groups, weight_decay=cfg.get("weight_decay", 0.05))
    total = cfg["epochs"] * len(train_loader)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total, eta_min=1e-7)
    scaler = torch.cuda.amp.GradScaler()

    writer = SummaryWriter(cfg["log_dir"]) if rank == 0 else None
    if rank == 0:
        os.makedirs(cfg["ckpt_dir"], exist_ok=True)

    best_srcc, step = -1.0, 0
    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        epoch_loss = torch.zeros((), device=device)
        for clip, mos in train_loader:
            clip = clip.to(device, non_blocking=True)
            mos = mos.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                pred = model(clip)
            pred = pred.float()
            loss = plcc_loss(pred, mos) + cfg.get("rank_weight", 0.3) * rank_loss(pred, mos)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            epoch_loss += loss.detach()
            step += 1
            if writer is not None and step % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), step)

        dist.all_reduce(epoch_loss, op=dist.ReduceOp.AVG)
        srcc, plcc = evaluate(model, val_loader, device)
        if rank == 0:
            mean_loss = epoch_loss.item() / len(train_loader)
            writer.add_scalar("train/epoch_loss", mean_loss, epoch)
            writer.add_scalar("val/srcc", srcc, epoch)
            writer.add_scalar("val/plcc", plcc, epoch)
            print(f"[{epoch}] loss={mean_loss:.4f} SRCC={srcc:.4f} PLCC={plcc:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch},
                       os.path.join(cfg["ckpt_dir"], "latest.pth"))
            if srcc > best_srcc:
                best_srcc = srcc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "srcc": srcc},
                           os.path.join(cfg["ckpt_dir"], "best.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
