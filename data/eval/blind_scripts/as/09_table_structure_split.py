"""
Table structure recognition, SPLERGE-style "split" model: predicts row and
column separator probabilities along the two image axes of a cropped table.
Ground truth comes from PubTabNet / FinTabNet cell boxes converted to
per-row / per-column separator masks (tools/make_split_gt.py).

    torchrun --nproc_per_node=4 train_table_split.py --ann data/pubtabnet/split_train.jsonl \
        --val-ann data/pubtabnet/split_val.jsonl --img-dir data/pubtabnet/train
"""
import argparse
import json
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ann", required=True)
    ap.add_argument("--val-ann", required=True)
    ap.add_argument("--img-dir", required=True)
    ap.add_argument("--val-img-dir", default=None)
    ap.add_argument("--max-side", type=int, default=768)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--ckpt", default="checkpoints/table_split/last.pt")
    ap.add_argument("--logdir", default="runs/table_split")
    return ap.parse_args()


class SplitDataset(Dataset):
    """Each record: {"filename": ..., "row_sep": [0/1 per pixel row], "col_sep": [0/1 per pixel col]}"""

    def __init__(self, ann, img_dir, max_side):
        with open(ann) as f:
            self.recs = [json.loads(l) for l in f]
        self.img_dir = img_dir
        self.max_side = max_side

    def __len__(self):
        return len(self.recs)

    def __getitem__(self, i):
        r = self.recs[i]
        img = Image.open(os.path.join(self.img_dir, r["filename"])).convert("RGB")
        w, h = img.size
        s = self.max_side / max(w, h)
        nw, nh = max(int(w * s), 32), max(int(h * s), 32)
        img = img.resize((nw, nh), Image.BILINEAR)
        rows = np.interp(np.linspace(0, h - 1, nh), np.arange(h), np.asarray(r["row_sep"], np.float32))
        cols = np.interp(np.linspace(0, w - 1, nw), np.arange(w), np.asarray(r["col_sep"], np.float32))
        x = torch.from_numpy(np.asarray(img, np.float32).transpose(2, 0, 1) / 255.0)
        return x, torch.from_numpy((rows > 0.5).astype(np.float32)), torch.from_numpy((cols > 0.5).astype(np.float32))


def pad_collate(batch):
    H = max(b[0].shape[1] for b in batch)
    W = max(b[0].shape[2] for b in batch)
    imgs = torch.zeros(len(batch), 3, H, W)
    rows = torch.full((len(batch), H), -1.0)
    cols = torch.full((len(batch), W), -1.0)
    for i, (x, r, c) in enumerate(batch):
        imgs[i, :, :x.shape[1], :x.shape[2]] = x
        rows[i, :r.shape[0]] = r
        cols[i, :c.shape[0]] = c
    return imgs, rows, cols


class ProjectionPool(nn.Module):
    """Row/column projection pooling from SPLERGE: average along one axis and broadcast back."""

    def __init__(self, c, axis):
        super().__init__()
        self.axis = axis
        self.conv = nn.Conv2d(c, c, 1)

    def forward(self, x):
        m = x.mean(dim=self.axis, keepdim=True).expand_as(x)
        return torch.cat([x, self.conv(m)], 1)


class SplitBranch(nn.Module):
    def __init__(self, cin, axis, blocks=3):
        super().__init__()
        layers, c = [], cin
        for _ in range(blocks):
            layers += [nn.Conv2d(c, 64, 3, padding=2, dilation=2), nn.GroupNorm(8, 64), nn.ReLU(True),
                       ProjectionPool(64, axis)]
            c = 128
        self.body = nn.Sequential(*layers)
        self.out = nn.Conv2d(c, 1, 1)
        self.axis = axis

    def forward(self, x):
        y = self.out(self.body(x))                 # B,1,H,W
        return y.mean(dim=self.axis).squeeze(1)    # rows: mean over W -> B,H ; cols: mean over H -> B,W


class SplitNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Sequential(
            nn.Conv2d(3, 32, 7, padding=3), nn.GroupNorm(8, 32), nn.ReLU(True),
            nn.Conv2d(32, 32, 7, padding=3), nn.GroupNorm(8, 32), nn.ReLU(True),
            nn.Conv2d(32, 64, 7, padding=6, dilation=2), nn.GroupNorm(8, 64), nn.ReLU(True),
        )
        self.row_branch = SplitBranch(64, axis=3)
        self.col_branch = SplitBranch(64, axis=2)

    def forward(self, x):
        f = self.shared(x)
        return self.row_branch(f), self.col_branch(f)


def masked_bce(logits, target):
    valid = target >= 0
    return F.binary_cross_entropy_with_logits(logits[valid], target[valid])


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(6, device=device, dtype=torch.float64)  # tp/fp/fn rows, tp/fp/fn cols
    for imgs, rows, cols in loader:
        imgs, rows, cols = imgs.to(device), rows.to(device), cols.to(device)
        pr, pc = model(imgs)
        for k, (p, t) in enumerate(((pr, rows), (pc, cols))):
            valid = t >= 0
            p = (p.sigmoid() > 0.5)[valid]
            t = t[valid] > 0.5
            s[3 * k] += (p & t).sum()
            s[3 * k + 1] += (p & ~t).sum()
            s[3 * k + 2] += (~p & t).sum()
    dist.all_reduce(s)
    f1_row = 2 * s[0] / (2 * s[0] + s[1] + s[2]).clamp(min=1)
    f1_col = 2 * s[3] / (2 * s[3] + s[4] + s[5]).clamp(min=1)
    model.train()
    return f1_row.item(), f1_col.item()


def main():
    args = get_args()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    train_ds = SplitDataset(args.ann, args.img_dir, args.max_side)
    val_ds = SplitDataset(args.val_ann, args.val_img_dir or args.img_dir, args.max_side)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=args.workers, collate_fn=pad_collate, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, sampler=DistributedSampler(val_ds, shuffle=False),
                        num_workers=args.workers, collate_fn=pad_collate)

    model = SplitNet().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.3)
    start_epoch = 0
    if os.path.isfile(args.ckpt):
        state = torch.load(args.ckpt, map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch = state["epoch"] + 1
        if rank == 0:
            print(f"resumed from {args.ckpt} at epoch {start_epoch}")
    model = DDP(model, device_ids=[local_rank])

    writer = SummaryWriter(args.logdir) if rank == 0 else None
    os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
    global_step = start_epoch * len(train_dl)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        for imgs, rows, cols in train_dl:
            imgs = imgs.to(device, non_blocking=True)
            rows, cols = rows.to(device), cols.to(device)
            pr, pc = model(imgs)
            loss = masked_bce(pr, rows) + masked_bce(pc, cols)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            global_step += 1
            if writer and global_step % 50 == 0:
                writer.add_scalar("loss/train", loss.item(), global_step)
        scheduler.step()

        f1_row, f1_col = evaluate(model, val_dl, device)
        if writer:
            writer.add_scalar("val/f1_row", f1_row, epoch)
            writer.add_scalar("val/f1_col", f1_col, epoch)
            print(f"epoch {epoch} row-F1 {f1_row:.4f} col-F1 {f1_col:.4f}", flush=True)

        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": epoch,
                    "f1_row": f1_row, "f1_col": f1_col}, args.ckpt)

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
