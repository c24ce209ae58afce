"""Norm-in-Norm loss IQA on LIVE Challenge with tiled full-image inference.

Training uses random 320x320 crops; at test time each 500x500 image is covered
by overlapping tiles whose scores are averaged (predict_image). 10 random
80/20 splits are run by the launcher script, one per --split-id.

    torchrun --nproc_per_node=4 13_clive_tiled_eval.py --root /data/ChallengeDB_release --split-id 0
"""
import argparse
import os
import time

import numpy as np
import scipy.io as sio
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from scipy.stats import pearsonr, spearmanr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T


def load_clive(root):
    names = sio.loadmat(os.path.join(root, "Data", "AllImages_release.mat"))["AllImages_release"]
    mos = sio.loadmat(os.path.join(root, "Data", "AllMOS_release.mat"))["AllMOS_release"][0]
    names = [str(n[0][0]) for n in names][7:]   # first 7 are the training images of the study
    return names, mos[7:].astype(np.float32)


class CLIVE(Dataset):
    def __init__(self, root, names, mos, crop, train):
        self.root, self.names, self.mos = root, names, mos
        norm = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
        if train:
            self.tf = T.Compose([T.RandomCrop(crop), T.RandomHorizontalFlip(), T.ToTensor(), norm])
        else:
            self.tf = T.Compose([T.ToTensor(), norm])

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.root, "Images", self.names[i])).convert("RGB")
        return self.tf(img), self.mos[i], i


class TileIQA(nn.Module):
    def __init__(self, arch, crop):
        super().__init__()
        self.crop = crop
        self.net = timm.create_model(arch, pretrained=True, num_classes=0)
        self.fc = nn.Sequential(nn.Linear(self.net.num_features, 256), nn.ReLU(inplace=True), nn.Linear(256, 1))

    def forward(self, x):
        return self.fc(self.net(x)).squeeze(-1)

    def predict_image(self, img, stride=90):
        # img: B,C,H,W full image -> mean over overlapping crops
        _, _, h, w = img.shape
        ys = list(range(0, max(1, h - self.crop) + 1, stride))
        xs = list(range(0, max(1, w - self.crop) + 1, stride))
        tiles = [img[:, :, y:y + self.crop, x:x + self.crop] for y in ys for x in xs]
        scores = torch.stack([self.forward(t) for t in tiles], 1)
        return scores.mean(1)


def norm_in_norm_loss(pred, mos, p=1, q=2, eps=1e-8):
    pred = pred - pred.mean()
    pred = pred / (pred.norm(p=q) + eps)
    mos = mos - mos.mean()
    mos = mos / (mos.norm(p=q) + eps)
    n = pred.numel()
    scale = 2 ** p * n ** max(0.5, 1 - 1 / q)
    loss = (pred - mos).abs().pow(p).sum() / scale
    rho = (pred * mos).sum()
    loss_lin = (pred - rho * mos).abs().pow(p).sum() / scale
    return loss + loss_lin


@torch.no_grad()
def evaluate(model, loader, device, n):
    model.eval()
    res = []
    for img, mos, idx in loader:
        img = img.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            score = model.predict_image(img)
        res.append(torch.stack([score.float(), mos.to(device), idx.to(device).float()], 1))
    res = torch.cat(res)
    bag = [torch.empty_like(res) for _ in range(dist.get_world_size())]
    dist.all_gather(bag, res)
    arr = torch.cat(bag).cpu().numpy()
    _, keep = np.unique(arr[:, 2].astype(np.int64), return_index=True)
    arr = arr[keep]
    assert len(arr) == n
    return spearmanr(arr[:, 0], arr[:, 1])[0], pearsonr(arr[:, 0], arr[:, 1])[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--split-id", type=int, default=0)
    ap.add_argument("--arch", default="convnext_tiny.fb_in1k")
    ap.add_argument("--crop", type=int, default=320)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--out", default="results/clive")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    names, mos = load_clive(args.root)
    perm = np.random.RandomState(1000 + args.split_id).permutation(len(names))
    n_train = int(0.8 * len(names))
    tr, te = perm[:n_train], perm[n_train:]
    train_ds = CLIVE(args.root, [names[i] for i in tr], mos[tr], args.crop, True)
    test_ds = CLIVE(args.root, [names[i] for i in te], mos[te], args.crop, False)

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=4, sampler=DistributedSampler(test_ds, shuffle=False),
                             num_workers=args.workers, pin_memory=True)

    model = TileIQA(args.arch, args.crop).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam([
        {"params": model.module.net.parameters(), "lr": args.lr * 0.1},
        {"params": model.module.fc.parameters(), "lr": args.lr},
    ])
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    scaler = torch.cuda.amp.GradScaler()

    out_dir = os.path.join(args.out, f"split{args.split_id}")
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
    best = (-1.0, -1.0)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        meter = torch.zeros(2, device=device)
        for img, y, _ in train_loader:
            img, y = img.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                pred = model(img)
            loss = norm_in_norm_loss(pred.float(), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            meter += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(meter)

        srcc, plcc = evaluate(model, test_loader, device, len(test_ds))
        if rank == 0:
            print(f"[split {args.split_id}] epoch {epoch} loss {meter[0] / meter[1]:.4f} "
                  f"SRCC {srcc:.4f} PLCC {plcc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if srcc > best[0]:
                best = (srcc, plcc)
                torch.save(model.module.state_dict(), os.path.join(out_dir, "best.pth"))
        dist.barrier()

    if rank == 0:
        with open(os.path.join(args.out, "summary.csv"), "a") as f:
            f.write(f"{args.split_id},{best[0]:.4f},{best[1]:.4f}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
