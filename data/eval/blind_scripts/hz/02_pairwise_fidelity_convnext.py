"""Learn a perceptual quality scorer from paired-comparison judgements.

Each training sample is a pair (A, B) with the empirical probability that A was
preferred over B. Scores are mapped to a preference probability with a Thurstone
Case V model and trained with the fidelity loss. Validation is SRCC/PLCC on an
absolute-MOS test set.
"""
import argparse
import math
import os
import time

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from scipy.stats import pearsonr, spearmanr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class PairDataset(Dataset):
    def __init__(self, root, csv_file, size):
        self.root = root
        self.df = pd.read_csv(csv_file)  # columns: img_a, img_b, p_a
        self.tf = T.Compose([
            T.RandomResizedCrop(size, scale=(0.6, 1.0), ratio=(0.9, 1.1)),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize(MEAN, STD),
        ])

    def __len__(self):
        return len(self.df)

    def _load(self, name):
        return Image.open(os.path.join(self.root, name)).convert("RGB")

    def __getitem__(self, i):
        r = self.df.iloc[i]
        # same crop geometry is not required: the score is meant to be crop-invariant
        return self.tf(self._load(r.img_a)), self.tf(self._load(r.img_b)), torch.tensor(r.p_a, dtype=torch.float32)


class MOSDataset(Dataset):
    def __init__(self, root, csv_file, size):
        self.root = root
        self.df = pd.read_csv(csv_file)  # columns: image, mos
        self.tf = T.Compose([T.Resize(size), T.CenterCrop(size), T.ToTensor(), T.Normalize(MEAN, STD)])

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        img = Image.open(os.path.join(self.root, r.image)).convert("RGB")
        return self.tf(img), torch.tensor(r.mos, dtype=torch.float32)


class Scorer(nn.Module):
    def __init__(self, arch):
        super().__init__()
        self.backbone = timm.create_model(arch, pretrained=True, num_classes=0)
        self.head = nn.Sequential(nn.LayerNorm(self.backbone.num_features),
                                  nn.Linear(self.backbone.num_features, 1))

    def forward(self, x):
        return self.head(self.backbone(x)).squeeze(-1)


def fidelity_loss(s_a, s_b, p):
    p_hat = 0.5 * (1 + torch.erf((s_a - s_b) / 2.0))  # Phi((sa - sb) / sqrt(2))
    eps = 1e-8
    return (1 - torch.sqrt(p * p_hat + eps) - torch.sqrt((1 - p) * (1 - p_hat) + eps)).mean()


def gather_variable(t, device):
    """all_gather for 1-D tensors whose length differs between ranks."""
    world = dist.get_world_size()
    n = torch.tensor([t.numel()], device=device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    sizes = [int(s.item()) for s in sizes]
    max_n = max(sizes)
    padded = torch.zeros(max_n, dtype=t.dtype, device=device)
    padded[: t.numel()] = t
    out = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return torch.cat([o[:s] for o, s in zip(out, sizes)])


@torch.no_grad()
def evaluate(model, ds, args, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    # contiguous shard per rank, no padding duplicates; shards may differ by one
    shard = np.array_split(np.arange(len(ds)), world)[rank]
    loader = DataLoader(Subset(ds, shard.tolist()), batch_size=args.eval_batch_size,
                        num_workers=args.workers, pin_memory=True)
    model.eval()
    preds, labels = [], []
    for img, mos in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            s = model(img.to(device, non_blocking=True))
        preds.append(s.float())
        labels.append(mos.to(device))
    preds = torch.cat(preds) if preds else torch.zeros(0, device=device)
    labels = torch.cat(labels) if labels else torch.zeros(0, device=device)
    preds = gather_variable(preds, device).cpu().numpy()
    labels = gather_variable(labels, device).cpu().numpy()
    model.train()
    return spearmanr(preds, labels)[0], pearsonr(preds, labels)[0], len(preds)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--pairs", required=True)
    ap.add_argument("--test-csv", required=True)
    ap.add_argument("--arch", default="convnext_tiny.fb_in22k")
    ap.add_argument("--size", type=int, default=384)
    ap.add_argument("--batch-size", type=int, default=32, help="pairs per GPU")
    ap.add_argument("--eval-batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--save", default="checkpoints/pair_fidelity")
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(0)

    train_ds = PairDataset(args.root, args.pairs, args.size)
    test_ds = MOSDataset(args.root, args.test_csv, args.size)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=17, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True)

    model = Scorer(args.arch).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    steps = args.epochs * len(loader)
    warmup = min(500, steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))

    start_epoch, best = 0, -1.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]

    model = DDP(model, device_ids=[local_rank])
    if rank == 0:
        os.makedirs(args.save, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        tic = time.time()
        running = torch.zeros(2, device=device)
        for it, (a, b, p) in enumerate(loader):
            a = a.to(device, non_blocking=True)
            b = b.to(device, non_blocking=True)
            p = p.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                s = model(torch.cat([a, b], 0)).float()
            s_a, s_b = s.chunk(2)
            loss = fidelity_loss(s_a, s_b, p)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
            if it % 100 == 0 and rank == 0:
                print(f"ep {epoch} it {it}/{len(loader)} loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)

        dist.all_reduce(running)
        srcc, plcc, n = evaluate(model, test_ds, args, device)
        if rank == 0:
            print(f"epoch {epoch}: train fidelity {running[0].item() / running[1].item():.4f} "
                  f"SRCC {srcc:.4f} PLCC {plcc:.4f} (n={n}) {time.time() - tic:.0f}s", flush=True)
            best = max(best, srcc)
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": epoch, "best": best}
            torch.save(ckpt, os.path.join(args.save, "last.pt"))
            if srcc >= best:
                torch.save(model.module.state_dict(), os.path.join(args.save, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
