#!/usr/bin/env python3
"""Two-stage pipeline in one launch:

  1. feature extraction: ResNet50 (ImageNet, truncated after layer3) over the patch
     coordinates produced by the tissue-segmentation step (<patch_dir>/<slide_id>.h5, 'coords'),
     written to <feat_dir>/h5_files/<slide_id>.h5 with 'features' and 'coords'.
  2. ABMIL training / evaluation for one patient-level fold.

    torchrun --nproc_per_node=8 02_extract_then_abmil.py --slide_dir /data/tcga_brca/svs ...
"""
import argparse
import os
from datetime import timedelta

import h5py
import numpy as np
import openslide
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedGroupKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--slide_dir", required=True)
    ap.add_argument("--patch_dir", required=True)
    ap.add_argument("--feat_dir", required=True)
    ap.add_argument("--csv", required=True, help="case_id, slide_id, label (IDC / ILC)")
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--n_folds", type=int, default=5)
    ap.add_argument("--patch_level", type=int, default=0)
    ap.add_argument("--patch_size", type=int, default=256)
    ap.add_argument("--extract_batch", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--out", default="runs/brca_subtype")
    ap.add_argument("--seed", type=int, default=2024)
    return ap.parse_args()


# ---------------------------------------------------------------- extraction
class PatchBag(Dataset):
    """Patches of one slide. The OpenSlide handle is opened lazily inside each worker."""

    def __init__(self, slide_path, coords, level, size):
        self.slide_path, self.coords, self.level, self.size = slide_path, coords, level, size
        self.wsi = None
        self.tf = transforms.Compose([transforms.ToTensor(),
                                      transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])

    def __len__(self):
        return len(self.coords)

    def __getitem__(self, i):
        if self.wsi is None:
            self.wsi = openslide.OpenSlide(self.slide_path)
        x, y = self.coords[i]
        img = self.wsi.read_region((int(x), int(y)), self.level, (self.size, self.size)).convert("RGB")
        return self.tf(img)


def resnet50_trunc():
    net = torchvision.models.resnet50(weights=torchvision.models.ResNet50_Weights.IMAGENET1K_V1)
    return nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool, net.layer1, net.layer2, net.layer3,
                         nn.AdaptiveAvgPool2d(1), nn.Flatten())


@torch.no_grad()
def extract_features(args, slide_ids, rank, world, device):
    os.makedirs(os.path.join(args.feat_dir, "h5_files"), exist_ok=True)
    encoder = resnet50_trunc().to(device).eval()
    mine = slide_ids[rank::world]
    for n, sid in enumerate(mine):
        out_path = os.path.join(args.feat_dir, "h5_files", f"{sid}.h5")
        if os.path.exists(out_path):
            continue
        with h5py.File(os.path.join(args.patch_dir, f"{sid}.h5"), "r") as f:
            coords = f["coords"][:]
        loader = DataLoader(PatchBag(os.path.join(args.slide_dir, f"{sid}.svs"), coords,
                                     args.patch_level, args.patch_size),
                            batch_size=args.extract_batch, num_workers=8, pin_memory=True)
        feats = []
        for imgs in loader:
            with torch.autocast("cuda", dtype=torch.float16):
                feats.append(encoder(imgs.to(device, non_blocking=True)).float().cpu())
        feats = torch.cat(feats).numpy()
        tmp_path = out_path + f".tmp{rank}"
        with h5py.File(tmp_path, "w") as f:
            f.create_dataset("features", data=feats)
            f.create_dataset("coords", data=coords)
        os.replace(tmp_path, out_path)
        print(f"[rank {rank}] {n + 1}/{len(mine)} {sid}: {feats.shape[0]} patches", flush=True)
    del encoder
    torch.cuda.empty_cache()


# ---------------------------------------------------------------- MIL
class FeatureBags(Dataset):
    def __init__(self, df, feat_dir):
        self.df = df.reset_index(drop=True)
        self.feat_dir = feat_dir

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        row = self.df.iloc[i]
        with h5py.File(os.path.join(self.feat_dir, "h5_files", f"{row.slide_id}.h5"), "r") as f:
            feats = torch.from_numpy(f["features"][:])
        return feats, int(row.y), i


class ABMIL(nn.Module):
    def __init__(self, in_dim=1024, dim=512, attn_dim=128, n_classes=2):
        super().__init__()
        self.proj = nn.Sequential(nn.Linear(in_dim, dim), nn.ReLU(), nn.Dropout(0.25))
        self.attn = nn.Sequential(nn.Linear(dim, attn_dim), nn.Tanh(), nn.Linear(attn_dim, 1))
        self.head = nn.Linear(dim, n_classes)

    def forward(self, x):
        h = self.proj(x)
        a = torch.softmax(self.attn(h), dim=0)  # N x 1
        return self.head((a * h).sum(0, keepdim=True))


def gather_variable(t, world):
    """all_gather for 1-D tensors whose length differs between ranks."""
    n = torch.tensor([t.numel()], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    max_n = int(max(s.item() for s in sizes))
    padded = torch.zeros(max_n, dtype=t.dtype, device=t.device)
    padded[: t.numel()] = t
    out = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return torch.cat([o[: int(s.item())] for o, s in zip(out, sizes)])


@torch.no_grad()
def evaluate(net, loader, device, world):
    net.eval()
    idx, prob, lab = [], [], []
    for feats, y, i in loader:
        logits = net(feats[0].to(device, non_blocking=True))
        prob.append(logits.softmax(-1)[0, 1])
        lab.append(y.to(device).float()[0])
        idx.append(i.to(device).float()[0])
    prob = gather_variable(torch.stack(prob) if prob else torch.zeros(0, device=device), world)
    lab = gather_variable(torch.stack(lab) if lab else torch.zeros(0, device=device), world)
    idx = gather_variable(torch.stack(idx) if idx else torch.zeros(0, device=device), world)
    # DistributedSampler repeats a few slides to even out the shards; keep one copy each
    _, first = np.unique(idx.cpu().numpy(), return_index=True)
    p, y = prob.cpu().numpy()[first], lab.cpu().numpy()[first]
    return roc_auc_score(y, p), float(((p > 0.5) == y).mean())


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # extraction can keep some ranks busy for hours before the first collective
    dist.init_process_group("nccl", timeout=timedelta(hours=6))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed)

    df = pd.read_csv(args.csv)
    df["y"] = df.label.map({"IDC": 0, "ILC": 1})
    slide_ids = sorted(df.slide_id.unique())

    extract_features(args, slide_ids, rank, world, device)
    dist.barrier()  # all feature files must exist before any rank builds its datasets

    sgkf = StratifiedGroupKFold(n_splits=args.n_folds, shuffle=True, random_state=args.seed)
    train_idx, test_idx = list(sgkf.split(df, df.y, groups=df.case_id))[args.fold]
    train_df, test_df = df.iloc[train_idx], df.iloc[test_idx]

    train_ds, test_ds = FeatureBags(train_df, args.feat_dir), FeatureBags(test_df, args.feat_dir)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=1, sampler=train_sampler, num_workers=4, pin_memory=True)
    test_loader = DataLoader(test_ds, batch_size=1, sampler=DistributedSampler(test_ds, shuffle=False),
                             num_workers=4, pin_memory=True)

    net = ABMIL().to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-4)
    ckpt_path = os.path.join(args.out, f"fold{args.fold}.pt")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        running = torch.zeros(2, device=device)
        for feats, y, _ in train_loader:
            logits = model(feats[0].to(device, non_blocking=True))
            loss = F.cross_entropy(logits, y.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(running)
        if rank == 0:
            print(f"epoch {epoch}: train loss {running[0].item() / running[1].item():.4f}", flush=True)
            torch.save({"epoch": epoch, "model": net.state_dict(), "opt": opt.state_dict()}, ckpt_path)

    dist.barrier()
    state = torch.load(ckpt_path, map_location=device)
    net.load_state_dict(state["model"])
    auc, acc = evaluate(net, test_loader, device, world)
    if rank == 0:
        print(f"fold {args.fold}: test AUC {auc:.4f}  acc {acc:.4f}  ({len(test_ds)} slides)")
        with open(os.path.join(args.out, f"fold{args.fold}_test.txt"), "w") as f:
            f.write(f"{auc:.6f}\t{acc:.6f}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
