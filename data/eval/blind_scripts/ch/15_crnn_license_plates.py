"""License-plate recognition: STN + small CRNN + CTC on cropped plates (EU + CCPD-style).

    torchrun --nproc_per_node=4 15_crnn_license_plates.py --train data/plates/train.csv \
        --val data/plates/val.csv --img-root data/plates/crops
"""
import argparse
import csv
import os
import random
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

ALPHABET = "0123456789ABCDEFGHJKLMNPQRSTUVWXYZ-"
C2I = {c: i + 1 for i, c in enumerate(ALPHABET)}


def levenshtein(a, b):
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


class Plates(Dataset):
    def __init__(self, csv_path, root, train, size=(32, 128)):
        with open(csv_path) as f:
            self.rows = [(r["file"], r["plate"].upper()) for r in csv.DictReader(f)]
        self.root, self.train, self.h, self.w = root, train, size[0], size[1]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        fn, plate = self.rows[i]
        img = cv2.imread(os.path.join(self.root, fn), cv2.IMREAD_COLOR)
        if self.train:
            h, w = img.shape[:2]
            # small random perspective jitter of the crop
            src = np.float32([[0, 0], [w, 0], [w, h], [0, h]])
            dst = src + np.random.uniform(-0.06, 0.06, src.shape).astype(np.float32) * np.float32([w, h])
            img = cv2.warpPerspective(img, cv2.getPerspectiveTransform(src, dst), (w, h),
                                      borderMode=cv2.BORDER_REPLICATE)
            if random.random() < 0.3:
                img = cv2.GaussianBlur(img, (3, 3), 0)
        img = cv2.resize(img, (self.w, self.h)).astype(np.float32)
        x = torch.from_numpy((img - 127.5) / 128.0).permute(2, 0, 1)
        y = torch.tensor([C2I[c] for c in plate if c in C2I], dtype=torch.long)
        return x, y, plate


def collate(batch):
    xs, ys, plates = zip(*batch)
    return torch.stack(xs), torch.cat(ys), torch.tensor([len(y) for y in ys]), list(plates)


class STN(nn.Module):
    def __init__(self):
        super().__init__()
        self.loc = nn.Sequential(nn.Conv2d(3, 16, 5, 2, 2), nn.ReLU(True), nn.MaxPool2d(2),
                                 nn.Conv2d(16, 32, 3, 1, 1), nn.ReLU(True), nn.AdaptiveAvgPool2d((2, 8)))
        self.fc = nn.Sequential(nn.Linear(32 * 16, 64), nn.ReLU(True), nn.Linear(64, 6))
        nn.init.zeros_(self.fc[2].weight)
        self.fc[2].bias.data.copy_(torch.tensor([1, 0, 0, 0, 1, 0], dtype=torch.float))

    def forward(self, x):
        theta = self.fc(self.loc(x).flatten(1)).view(-1, 2, 3)
        grid = F.affine_grid(theta, x.size(), align_corners=False)
        return F.grid_sample(x, grid, align_corners=False)


class PlateNet(nn.Module):
    def __init__(self, n_classes=len(ALPHABET) + 1):
        super().__init__()
        self.stn = STN()

        def cbr(i, o):
            return [nn.Conv2d(i, o, 3, 1, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU(True)]

        self.cnn = nn.Sequential(*cbr(3, 64), nn.MaxPool2d(2), *cbr(64, 128), nn.MaxPool2d(2),
                                 *cbr(128, 256), *cbr(256, 256), nn.MaxPool2d((2, 1)),
                                 *cbr(256, 256), nn.MaxPool2d((4, 1)))
        self.rnn = nn.GRU(256, 128, bidirectional=True, batch_first=True)
        self.fc = nn.Linear(256, n_classes)

    def forward(self, x):
        x = self.stn(x)
        f = self.cnn(x).squeeze(2).transpose(1, 2)  # B, 32, 256
        return self.fc(self.rnn(f)[0])


def decode(logits):
    res = []
    for row in logits.argmax(-1).tolist():
        s, prev = [], 0
        for k in row:
            if k != prev and k != 0:
                s.append(ALPHABET[k - 1])
            prev = k
        res.append("".join(s))
    return res


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, total, char_err, char_total = 0, 0, 0, 0
    for x, _, _, plates in loader:
        preds = decode(model(x.to(device, non_blocking=True)).cpu())
        for p, g in zip(preds, plates):
            correct += int(p == g)
            total += 1
            char_err += levenshtein(p, g)
            char_total += len(g)
    stats = torch.tensor([correct, total, char_err, char_total], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    return stats[0].item() / max(stats[1].item(), 1), stats[2].item() / max(stats[3].item(), 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--img-root", required=True)
    ap.add_argument("--out", default="runs/platenet")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    train_ds = Plates(args.train, args.img_root, train=True)
    val_ds = Plates(args.val, args.img_root, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch, sampler=train_sampler, collate_fn=collate,
                          num_workers=args.workers, pin_memory=True, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=512, collate_fn=collate,
                        num_workers=args.workers)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(PlateNet()).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, seen, run = time.time(), 0, 0.0
        for x, y, ylen, _ in train_dl:
            x = x.to(device, non_blocking=True)
            logp = model(x).log_softmax(-1).transpose(0, 1)
            loss = ctc(logp, y, torch.full((x.size(0),), logp.size(0), dtype=torch.long), ylen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run += loss.item() * x.size(0)
            seen += x.size(0)
        sched.step()

        acc, cer = evaluate(model, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch:3d} loss {run / seen:.4f} plate-acc {acc:.4f} CER {cer:.4f} "
                  f"lr {sched.get_last_lr()[0]:.2e} ({time.time() - t0:.0f}s)", flush=True)
            torch.save(model.module.state_dict(), os.path.join(args.out, "last.pt"))
            if acc > best:
                best = acc
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
