"""IPN Hand gesture classification (14 classes): RGB clip + MediaPipe hand-landmark stream.

Modality dropout on the landmark stream makes the RGB stream usable on its own when the
hand tracker fails at test time.

    torchrun --nproc_per_node=4 17_ipn_hand_rgb_pose_moddrop.py --root /data/IPN_Hand
"""
import argparse
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.video import MC3_18_Weights, mc3_18


class IPNSegments(Dataset):
    """Annotated gesture segments: (video, label, t_start, t_end) from Annot_{split}List.txt."""

    def __init__(self, root, split, clip_len=16, train=True):
        self.frames = os.path.join(root, "frames")
        self.landmarks = os.path.join(root, "hand_landmarks")
        df = pd.read_csv(os.path.join(root, "annotations", f"Annot_{split}List.txt"))
        self.items = list(df[["video", "id", "t_start", "t_end"]].itertuples(index=False, name=None))
        self.clip_len = clip_len
        self.train = train
        self.mean = torch.tensor([0.43216, 0.394666, 0.37645]).view(3, 1, 1, 1)
        self.std = torch.tensor([0.22803, 0.22145, 0.216989]).view(3, 1, 1, 1)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        video, label, t0, t1 = self.items[i]
        n = t1 - t0 + 1
        if self.train:
            idx = np.sort(np.random.randint(0, n, self.clip_len)) + t0
        else:
            idx = np.linspace(t0, t1, self.clip_len).round().astype(int)
        imgs = [np.asarray(Image.open(os.path.join(self.frames, video, f"{video}_{j:06d}.jpg")).resize((171, 128)))
                for j in idx]
        rgb = torch.from_numpy(np.stack(imgs)).permute(3, 0, 1, 2).float() / 255.0
        if self.train:
            y0, x0 = random.randint(0, 16), random.randint(0, 59)
        else:
            y0, x0 = 8, 29
        rgb = (rgb[:, :, y0:y0 + 112, x0:x0 + 112] - self.mean) / self.std
        lm = np.load(os.path.join(self.landmarks, f"{video}.npy"))[idx - 1].astype(np.float32)  # T, 21, 3
        lm = lm - lm[:, :1]  # wrist-relative
        return rgb, torch.from_numpy(lm.reshape(self.clip_len, -1)), label - 1


class LandmarkEncoder(nn.Module):
    def __init__(self, in_dim=63, dim=256):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv1d(in_dim, dim, 3, padding=1), nn.GroupNorm(16, dim), nn.GELU(),
            nn.Conv1d(dim, dim, 3, padding=1), nn.GroupNorm(16, dim), nn.GELU(),
            nn.Conv1d(dim, dim, 3, padding=1), nn.GroupNorm(16, dim), nn.GELU())

    def forward(self, x):  # B T D
        return self.net(x.transpose(1, 2)).mean(-1)


class RGBPoseNet(nn.Module):
    def __init__(self, num_classes=14, dim=256, pose_drop=0.3):
        super().__init__()
        self.rgb = mc3_18(weights=MC3_18_Weights.KINETICS400_V1)
        self.rgb.fc = nn.Identity()
        self.rgb_proj = nn.Linear(512, dim)
        self.pose = LandmarkEncoder(dim=dim)
        self.pose_proj = nn.Linear(dim, dim)
        self.pose_drop = pose_drop
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Dropout(0.3), nn.Linear(dim, num_classes))

    def forward(self, rgb, lm):
        feats = [self.rgb_proj(self.rgb(rgb))]
        if not (self.training and random.random() < self.pose_drop):
            feats.append(self.pose_proj(self.pose(lm)))
        return self.head(torch.stack(feats, 0).mean(0))


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/IPN_Hand")
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=16, help="per GPU")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--pose-drop", type=float, default=0.3)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--save-dir", default="runs/ipn_rgb_pose")
    return ap.parse_args()


@torch.no_grad()
def validate(model, loader, device, num_classes=14):
    model.eval()
    confusion = torch.zeros(num_classes, num_classes, device=device)
    for rgb, lm, y in loader:
        pred = model(rgb.to(device, non_blocking=True), lm.to(device, non_blocking=True)).argmax(1)
        confusion.index_put_((y.to(device), pred), torch.ones_like(pred, dtype=torch.float), accumulate=True)
    dist.all_reduce(confusion)
    acc = confusion.diag().sum() / confusion.sum()
    per_class = confusion.diag() / confusion.sum(1).clamp(min=1)
    return acc.item(), per_class.mean().item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    train_ds = IPNSegments(args.root, "train", train=True)
    val_ds = IPNSegments(args.root, "test", train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), args.batch_size,
                        num_workers=args.workers, pin_memory=True)

    model = RGBPoseNet(pose_drop=args.pose_drop)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    backbone = [p for n, p in model.named_parameters() if n.startswith("module.rgb.")]
    others = [p for n, p in model.named_parameters() if not n.startswith("module.rgb.")]
    base_lr = args.lr * args.batch_size * world / 64
    optimizer = torch.optim.AdamW([{"params": backbone, "lr": base_lr * 0.1}, {"params": others, "lr": base_lr}],
                                  weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[base_lr * 0.1, base_lr],
                                                    epochs=args.epochs, steps_per_epoch=len(train_dl))

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, seen, loss_acc = time.time(), 0, 0.0
        for rgb, lm, y in train_dl:
            rgb, lm, y = rgb.to(device, non_blocking=True), lm.to(device, non_blocking=True), y.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(rgb, lm)
            loss = F.cross_entropy(logits.float(), y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            loss_acc += loss.item() * y.size(0)
            seen += y.size(0)

        stats = torch.tensor([loss_acc, seen], device=device)
        dist.all_reduce(stats)
        acc, mean_cls = validate(model, val_dl, device)
        if rank == 0:
            print(f"[{epoch:02d}] train loss {(stats[0] / stats[1]).item():.4f} | test acc {acc * 100:.2f} "
                  f"mean-class {mean_cls * 100:.2f} | {time.time() - t0:.0f}s", flush=True)
            if acc > best:
                best = acc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": acc},
                           os.path.join(args.save_dir, "best.pth"))
    if rank == 0:
        print(f"best test acc {best * 100:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
