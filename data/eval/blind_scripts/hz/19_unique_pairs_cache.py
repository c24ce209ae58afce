"""UNIQUE-style training from image pairs sampled within each IQA database.

For every database, pairs (a, b) are sampled and labelled with the Thurstone
probability P(a > b) = Phi((mu_a - mu_b) / sqrt(s_a^2 + s_b^2)), so databases
with incompatible MOS scales can be mixed. Sampling the pair list (and reading
image sizes for the multi-scale crops) takes a while on the full collection, so
it is cached in --cache-dir.

    torchrun --nproc_per_node=8 19_unique_pairs_cache.py --db-config dbs.yaml --cache-dir cache/
"""
import argparse
import math
import os
import pickle
import random

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from PIL import Image
from scipy.stats import pearsonr, spearmanr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models
from torchvision import transforms as T

NORM = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])


def build_pairs(dbs, pairs_per_image, seed):
    rng = random.Random(seed)
    pairs, sizes = [], {}
    for db in dbs:
        df = pd.read_csv(db["csv"])  # image, mos, std
        paths = [os.path.join(db["root"], p) for p in df["image"]]
        for p in paths:
            with Image.open(p) as im:
                sizes[p] = im.size
        mos, std = df["mos"].values, df["std"].values
        n = len(df)
        for i in range(n):
            for _ in range(pairs_per_image):
                j = rng.randrange(n)
                if j == i:
                    continue
                z = (mos[i] - mos[j]) / math.sqrt(std[i] ** 2 + std[j] ** 2 + 1e-8)
                prob = 0.5 * (1 + math.erf(z / math.sqrt(2)))
                pairs.append((paths[i], paths[j], prob, float(std[i]), float(std[j])))
    return pairs, sizes


def load_pairs(cache_dir, dbs, pairs_per_image, seed):
    cache_file = os.path.join(cache_dir, f"pairs_{len(dbs)}db_k{pairs_per_image}_s{seed}.pkl")
    if os.path.exists(cache_file):
        with open(cache_file, "rb") as f:
            return pickle.load(f)
    pairs, sizes = build_pairs(dbs, pairs_per_image, seed)
    os.makedirs(cache_dir, exist_ok=True)
    with open(cache_file, "wb") as f:
        pickle.dump((pairs, sizes), f)
    return pairs, sizes


class PairSet(Dataset):
    def __init__(self, pairs, sizes, crop):
        self.pairs, self.sizes, self.crop = pairs, sizes, crop
        self.tf = T.Compose([T.RandomHorizontalFlip(), T.ToTensor(), NORM])

    def __len__(self):
        return len(self.pairs)

    def _load(self, path):
        w, h = self.sizes[path]
        img = Image.open(path).convert("RGB")
        # multi-scale: occasionally downscale large images before cropping
        if min(w, h) > 2 * self.crop and random.random() < 0.5:
            img = img.resize((w // 2, h // 2), Image.BICUBIC)
        img = T.RandomCrop(self.crop, pad_if_needed=True)(img)
        return self.tf(img)

    def __getitem__(self, i):
        a, b, p, sa, sb = self.pairs[i]
        return self._load(a), self._load(b), torch.tensor(p, dtype=torch.float32)


class TestSet(Dataset):
    def __init__(self, db, crop):
        df = pd.read_csv(db["test_csv"])
        self.paths = [os.path.join(db["root"], p) for p in df["image"]]
        self.mos = df["mos"].values.astype(np.float32)
        self.tf = T.Compose([T.CenterCrop(crop), T.ToTensor(), NORM])

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return self.tf(Image.open(self.paths[i]).convert("RGB")), self.mos[i], i


class QualityNet(nn.Module):
    def __init__(self):
        super().__init__()
        r = models.resnet34(weights=models.ResNet34_Weights.IMAGENET1K_V1)
        r.fc = nn.Linear(512, 1)
        self.net = r

    def forward(self, x):
        return self.net(x).squeeze(-1)


def fidelity(s_a, s_b, p):
    ph = 0.5 * (1 + torch.erf((s_a - s_b) / math.sqrt(2)))
    return (1 - torch.sqrt(p * ph + 1e-8) - torch.sqrt((1 - p) * (1 - ph) + 1e-8)).mean()


@torch.no_grad()
def test_db(model, ds, device):
    loader = DataLoader(ds, batch_size=32, sampler=DistributedSampler(ds, shuffle=False), num_workers=4)
    model.eval()
    chunks = []
    for x, y, idx in loader:
        chunks.append(torch.stack([model(x.to(device)).float(), y.to(device), idx.to(device).float()], 1))
    c = torch.cat(chunks)
    out = [torch.empty_like(c) for _ in range(dist.get_world_size())]
    dist.all_gather(out, c)
    a = torch.cat(out).cpu().numpy()
    _, k = np.unique(a[:, 2].astype(np.int64), return_index=True)
    a = a[k]
    model.train()
    return spearmanr(a[:, 0], a[:, 1])[0], pearsonr(a[:, 0], a[:, 1])[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--db-config", required=True)
    ap.add_argument("--cache-dir", default="cache")
    ap.add_argument("--pairs-per-image", type=int, default=8)
    ap.add_argument("--crop", type=int, default=384)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="checkpoints/unique")
    args = ap.parse_args()
    dbs = yaml.safe_load(open(args.db_config))["databases"]

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    pairs, sizes = load_pairs(args.cache_dir, dbs, args.pairs_per_image, args.seed)
    train_set = PairSet(pairs, sizes, args.crop)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True)
    tests = {db["name"]: TestSet(db, args.crop) for db in dbs}

    model = nn.SyncBatchNorm.convert_sync_batchnorm(QualityNet()).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.3)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(pairs)} training pairs from {len(dbs)} databases", flush=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        run = torch.zeros(2, device=device)
        for step, (a, b, p) in enumerate(loader):
            a, b, p = a.to(device, non_blocking=True), b.to(device, non_blocking=True), p.to(device)
            s = model(torch.cat([a, b]))
            s_a, s_b = s.chunk(2)
            loss = fidelity(s_a, s_b, p)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
            if rank == 0 and step % 500 == 0:
                print(f"epoch {epoch} step {step}/{len(loader)} fidelity {loss.item():.4f}", flush=True)
        scheduler.step()
        dist.all_reduce(run)

        results = {name: test_db(model, ds, device) for name, ds in tests.items()}
        if rank == 0:
            print(f"epoch {epoch}: train fidelity {run[0] / run[1]:.4f}")
            for name, (srcc, plcc) in results.items():
                print(f"   {name:>12s} SRCC {srcc:.4f} PLCC {plcc:.4f}")
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "results": results},
                       os.path.join(args.out, f"epoch{epoch}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
