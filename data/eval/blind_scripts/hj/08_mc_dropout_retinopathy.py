"""MC-dropout EfficientNet for diabetic-retinopathy referral with uncertainty.

Binary task (referable DR: grade >= 2), following the BDL benchmark of
Filos et al. (2019). Predictive entropy from T dropout samples is used to
refer the most uncertain cases to an ophthalmologist; we report AUC on the
retained fraction for several referral rates.

    torchrun --nproc_per_node=8 08_mc_dropout_retinopathy.py --data-root /data/eyepacs --epochs 30
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from torchvision import transforms as T


class EyePACS(Dataset):
    def __init__(self, root, split, tf):
        df = pd.read_csv(os.path.join(root, f"{split}.csv"))
        self.paths = [os.path.join(root, split, f"{n}.jpeg") for n in df["image"]]
        self.labels = (df["level"].values >= 2).astype(np.int64)
        self.tf = tf

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return self.tf(Image.open(self.paths[i]).convert("RGB")), self.labels[i], i


class MCDropoutNet(nn.Module):
    def __init__(self, backbone="efficientnet_b3", p=0.3):
        super().__init__()
        self.backbone = timm.create_model(backbone, pretrained=True, num_classes=0, drop_rate=0.0)
        d = self.backbone.num_features
        self.head = nn.Sequential(nn.Dropout(p), nn.Linear(d, 256), nn.ReLU(inplace=True),
                                  nn.Dropout(p), nn.Linear(256, 2))

    def forward(self, x):
        return self.head(self.backbone(x))

    @torch.no_grad()
    def mc_predict(self, x, T):
        """T stochastic passes; the backbone (with BN) runs once in eval mode."""
        self.eval()
        feats = self.backbone(x)
        for m in self.head.modules():
            if isinstance(m, nn.Dropout):
                m.train()
        probs = torch.stack([F.softmax(self.head(feats), dim=-1) for _ in range(T)])
        self.eval()
        return probs  # [T, B, 2]


def build_tf(size, train):
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    if train:
        return T.Compose([T.RandomResizedCrop(size, scale=(0.8, 1.0)), T.RandomHorizontalFlip(),
                          T.RandomVerticalFlip(), T.RandomRotation(180), T.ColorJitter(0.2, 0.2),
                          T.ToTensor(), norm])
    return T.Compose([T.Resize(size), T.CenterCrop(size), T.ToTensor(), norm])


@torch.no_grad()
def evaluate(model, loader, device, T, n_total):
    """Gathers per-image p(referable) and predictive entropy over all ranks."""
    buf = torch.full((n_total, 3), -1.0, device=device)  # p1, entropy, label
    for x, y, idx in loader:
        x = x.to(device, non_blocking=True)
        probs = model.mc_predict(x, T).mean(0)
        ent = -(probs * probs.clamp_min(1e-12).log()).sum(-1)
        buf[idx.to(device)] = torch.stack([probs[:, 1], ent, y.to(device).float()], dim=1)
    # every index is written by exactly one rank, the others keep -1
    dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    return buf.cpu().numpy()


def referral_curve(res, rates=(0.0, 0.1, 0.2, 0.3, 0.4, 0.5)):
    p1, ent, y = res[:, 0], res[:, 1], res[:, 2].astype(int)
    order = np.argsort(ent)  # most certain first
    out = {}
    for r in rates:
        keep = order[: int(round(len(order) * (1 - r)))]
        out[r] = roc_auc_score(y[keep], p1[keep]) if len(np.unique(y[keep])) > 1 else float("nan")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", required=True)
    ap.add_argument("--out", default="runs/dr_mcd")
    ap.add_argument("--backbone", default="efficientnet_b3")
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--p-drop", type=float, default=0.3)
    ap.add_argument("--mc", type=int, default=32)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    train_ds = EyePACS(args.data_root, "train", build_tf(args.size, True))
    val_ds = EyePACS(args.data_root, "val", build_tf(args.size, False))
    # class imbalance: ~20% referable
    pos_w = float((train_ds.labels == 0).sum() / max((train_ds.labels == 1).sum(), 1))
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=17)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_shard = Subset(val_ds, range(rank, len(val_ds), dist.get_world_size()))
    val_loader = DataLoader(val_shard, 32, shuffle=False, num_workers=args.workers, pin_memory=True)

    net = MCDropoutNet(args.backbone, args.p_drop)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW([
        {"params": net.backbone.parameters(), "lr": args.lr},
        {"params": net.head.parameters(), "lr": args.lr * 10},
    ], weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[args.lr, args.lr * 10],
                                                total_steps=args.epochs * len(train_loader), pct_start=0.1)
    scaler = torch.cuda.amp.GradScaler()
    class_w = torch.tensor([1.0, pos_w], device=device)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_auc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for x, y, _ in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y, weight=class_w)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            tot += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(tot)

        res = evaluate(model, val_loader, device, args.mc, len(val_ds))
        curve = referral_curve(res)
        if rank == 0:
            print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} "
                  + " ".join(f"AUC@{int(r * 100)}%ref={a:.4f}" for r, a in curve.items())
                  + f" ({time.time() - t0:.0f}s)", flush=True)
            ckpt = {"model": net.state_dict(), "epoch": epoch, "curve": curve, "args": vars(args)}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if curve[0.0] > best_auc:
                best_auc = curve[0.0]
                torch.save(ckpt, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
