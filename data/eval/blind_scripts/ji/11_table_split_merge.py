"""SPLERGE-style table structure recognition (split rows/columns, then merge spanning cells).

Training data: cropped table images from FinTabNet, preprocessed into .npz files with
    image (H, W, 3) uint8, row_sep (H,), col_sep (W,), row_bounds (R+1,), col_bounds (C+1,),
    merge_right (R, C), merge_down (R, C)
Most tables have no spanning cells at all; for those the merge targets are all zero.

    torchrun --nproc_per_node=4 11_table_split_merge.py --data /data/fintabnet_tsr --out ckpt/splerge
"""
import argparse
import glob
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SIZE = 512
MAX_CELLS = 64


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="ckpt/splerge")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--merge_weight", type=float, default=0.5)
    ap.add_argument("--workers", type=int, default=6)
    return ap.parse_args()


class TableNpz(Dataset):
    def __init__(self, root, split):
        self.files = sorted(glob.glob(os.path.join(root, split, "*.npz")))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        z = np.load(self.files[i])
        img = torch.from_numpy(z["image"]).permute(2, 0, 1).float() / 255.0
        h, w = img.shape[1:]
        img = F.interpolate(img[None], size=(SIZE, SIZE), mode="bilinear", align_corners=False)[0]
        row = F.interpolate(torch.from_numpy(z["row_sep"]).float()[None, None], size=SIZE, mode="nearest")[0, 0]
        col = F.interpolate(torch.from_numpy(z["col_sep"]).float()[None, None], size=SIZE, mode="nearest")[0, 0]
        rb = np.round(z["row_bounds"] * SIZE / h).astype(np.int64)
        cb = np.round(z["col_bounds"] * SIZE / w).astype(np.int64)
        r, c = min(len(rb) - 1, MAX_CELLS), min(len(cb) - 1, MAX_CELLS)
        bounds_r = torch.full((MAX_CELLS + 1,), -1, dtype=torch.long)
        bounds_c = torch.full((MAX_CELLS + 1,), -1, dtype=torch.long)
        bounds_r[: r + 1] = torch.from_numpy(rb[: r + 1])
        bounds_c[: c + 1] = torch.from_numpy(cb[: c + 1])
        merge = torch.full((2, MAX_CELLS, MAX_CELLS), -1.0)
        merge[0, :r, :c] = torch.from_numpy(z["merge_right"][:r, :c]).float()
        merge[1, :r, :c] = torch.from_numpy(z["merge_down"][:r, :c]).float()
        has_span = bool(z["merge_right"].any() or z["merge_down"].any())
        img = (img - 0.5) / 0.5
        return img, row, col, bounds_r, bounds_c, merge, torch.tensor(has_span)


class SplitMergeNet(nn.Module):
    def __init__(self, dim=128):
        super().__init__()
        r = torchvision.models.resnet18(weights="IMAGENET1K_V1")
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.layer1, r.layer2)  # stride 8
        self.reduce = nn.Conv2d(128, dim, 1)
        self.row_head = nn.Sequential(nn.Conv1d(dim, dim, 5, padding=2), nn.ReLU(), nn.Conv1d(dim, 1, 1))
        self.col_head = nn.Sequential(nn.Conv1d(dim, dim, 5, padding=2), nn.ReLU(), nn.Conv1d(dim, 1, 1))
        self.merge_head = nn.Sequential(
            nn.Conv2d(dim, dim, 3, padding=1), nn.ReLU(),
            nn.Conv2d(dim, dim, 3, padding=1), nn.ReLU(),
            nn.Conv2d(dim, 2, 1),
        )

    def grid_pool(self, feat, br, bc):
        """Average the feature map inside every grid cell -> (D, R, C), padded to MAX_CELLS."""
        d = feat.shape[0]
        out = feat.new_zeros(d, MAX_CELLS, MAX_CELLS)
        rs = (br[br >= 0] // 8).clamp(0, feat.shape[1]).tolist()
        cs = (bc[bc >= 0] // 8).clamp(0, feat.shape[2]).tolist()
        for i in range(len(rs) - 1):
            y0, y1 = rs[i], max(rs[i + 1], rs[i] + 1)
            for j in range(len(cs) - 1):
                x0, x1 = cs[j], max(cs[j + 1], cs[j] + 1)
                out[:, i, j] = feat[:, y0:y1, x0:x1].mean(dim=(1, 2))
        return out

    def forward(self, x, bounds_r=None, bounds_c=None, with_merge=False):
        f = self.reduce(self.stem(x))
        row_logits = self.row_head(f.mean(dim=3))
        col_logits = self.col_head(f.mean(dim=2))
        row_logits = F.interpolate(row_logits, size=x.shape[2], mode="linear", align_corners=False)[:, 0]
        col_logits = F.interpolate(col_logits, size=x.shape[3], mode="linear", align_corners=False)[:, 0]
        out = {"row": row_logits, "col": col_logits}
        if with_merge:
            grids = torch.stack([self.grid_pool(f[b], bounds_r[b], bounds_c[b]) for b in range(x.shape[0])])
            out["merge"] = self.merge_head(grids)
        return out


def split_loss(logits, target):
    pos = target.mean().clamp(min=1e-3)
    return F.binary_cross_entropy_with_logits(logits, target, pos_weight=(1 - pos) / pos)


def merge_loss(logits, target):
    valid = target >= 0
    return F.binary_cross_entropy_with_logits(logits[valid], target[valid]) if valid.any() else logits.sum() * 0


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(6, device=device)  # row tp/fp/fn, col tp/fp/fn
    for img, row, col, *_ in loader:
        out = model(img.to(device))
        for k, (pred, gt) in enumerate(((out["row"], row), (out["col"], col))):
            p = pred.sigmoid() > 0.5
            g = gt.to(device) > 0.5
            stats[3 * k] += (p & g).sum()
            stats[3 * k + 1] += (p & ~g).sum()
            stats[3 * k + 2] += (~p & g).sum()
    dist.all_reduce(stats)
    model.train()
    f1 = lambda tp, fp, fn: (2 * tp / (2 * tp + fp + fn).clamp(min=1)).item()
    return f1(*stats[:3]), f1(*stats[3:])


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds, val_ds = TableNpz(args.data, "train"), TableNpz(args.data, "val")
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                        batch_size=args.bs, num_workers=args.workers)

    net = SplitMergeNet()
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl))

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, (img, row, col, br, bc, merge, has_span) in enumerate(train_dl):
            img, row, col = img.to(device, non_blocking=True), row.to(device), col.to(device)
            run_merge = bool(has_span.any())
            out = model(img, br.to(device), bc.to(device), with_merge=run_merge)
            loss = split_loss(out["row"], row) + split_loss(out["col"], col)
            if run_merge:
                loss = loss + args.merge_weight * merge_loss(out["merge"], merge.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} it {it}/{len(train_dl)} loss {loss.item():.4f} merge={run_merge}", flush=True)

        row_f1, col_f1 = evaluate(model.module, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch}: row F1 {row_f1:.4f} col F1 {col_f1:.4f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pt"))
            if (row_f1 + col_f1) / 2 > best:
                best = (row_f1 + col_f1) / 2
                torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
