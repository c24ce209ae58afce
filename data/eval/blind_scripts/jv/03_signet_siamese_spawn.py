"""SigNet-style siamese network for offline signature verification (writer-independent).

Signers are split into disjoint train / validation sets. Pairs are (genuine, genuine) ->
same, (genuine, skilled forgery) -> different. One process per GPU via mp.spawn:

    python 03_signet_siamese_spawn.py --data /data/CEDAR --gpus 4
"""
import argparse
import glob
import itertools
import os
import random
import re

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image, ImageOps
from sklearn.metrics import roc_curve
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

IMG_SIZE = (155, 220)  # H, W as in SigNet


def get_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="CEDAR root with full_org/ and full_forg/")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--port", default="29533")
    ap.add_argument("--val-signers", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=32, help="pairs per GPU")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--margin", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--save", default="checkpoints/signet")
    return ap.parse_args()


def load_cedar(root):
    pat = re.compile(r"_(\d+)_(\d+)\.png$")
    genuine, forged = {}, {}
    for path in sorted(glob.glob(os.path.join(root, "full_org", "*.png"))):
        signer = int(pat.search(path).group(1))
        genuine.setdefault(signer, []).append(path)
    for path in sorted(glob.glob(os.path.join(root, "full_forg", "*.png"))):
        signer = int(pat.search(path).group(1))
        forged.setdefault(signer, []).append(path)
    return genuine, forged


def make_pairs(signers, genuine, forged, rng, max_neg_per_signer=276):
    pairs = []
    for s in signers:
        g = genuine[s]
        pos = list(itertools.combinations(g, 2))
        neg = [(a, b) for a in g for b in forged.get(s, [])]
        rng.shuffle(neg)
        pairs += [(a, b, 1) for a, b in pos]
        pairs += [(a, b, 0) for a, b in neg[:max_neg_per_signer]]
    return pairs


def preprocess(path):
    img = Image.open(path).convert("L")
    img = ImageOps.invert(img)
    img = img.resize((IMG_SIZE[1], IMG_SIZE[0]), Image.BILINEAR)
    arr = np.asarray(img, dtype=np.float32) / 255.0
    return torch.from_numpy(arr).unsqueeze(0)


class PairDataset(Dataset):
    def __init__(self, pairs):
        self.pairs = pairs

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        a, b, y = self.pairs[i]
        return preprocess(a), preprocess(b), torch.tensor(y, dtype=torch.float32)


class SigNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 96, 11, stride=4), nn.BatchNorm2d(96), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
            nn.Conv2d(96, 256, 5, padding=2), nn.BatchNorm2d(256), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
            nn.Dropout(0.3),
            nn.Conv2d(256, 384, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
            nn.Dropout(0.3),
        )
        self.fc = nn.Sequential(
            nn.Flatten(), nn.Linear(256 * 3 * 5, 1024), nn.ReLU(inplace=True), nn.Dropout(0.5),
            nn.Linear(1024, 128),
        )

    def embed(self, x):
        return self.fc(self.features(x))

    def forward(self, a, b):
        return self.embed(a), self.embed(b)


def contrastive_loss(ea, eb, y, margin):
    d = F.pairwise_distance(ea, eb)
    return (y * d.pow(2) + (1 - y) * F.relu(margin - d).pow(2)).mean() / 2


def eer_from_scores(dists, labels):
    fpr, tpr, thr = roc_curve(labels, -dists)
    fnr = 1 - tpr
    i = np.nanargmin(np.abs(fnr - fpr))
    return float((fpr[i] + fnr[i]) / 2), float(-thr[i])


def train_worker(gpu, cfg, world_size):
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{cfg.port}", rank=gpu, world_size=world_size)
    device = torch.device("cuda", gpu)
    torch.manual_seed(cfg.seed)

    genuine, forged = load_cedar(cfg.data)
    signers = sorted(genuine)
    split_rng = random.Random(cfg.seed)
    val_signers = sorted(split_rng.sample(signers, cfg.val_signers))
    train_signers = [s for s in signers if s not in set(val_signers)]
    pair_rng = random.Random(cfg.seed)
    train_ds = PairDataset(make_pairs(train_signers, genuine, forged, pair_rng))
    val_ds = PairDataset(make_pairs(val_signers, genuine, forged, pair_rng))
    if gpu == 0:
        print(f"{len(train_signers)} train signers / {len(train_ds)} pairs, "
              f"{len(val_signers)} val signers / {len(val_ds)} pairs", flush=True)

    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=gpu, shuffle=True, seed=cfg.seed)
    val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=gpu, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=train_sampler,
                              num_workers=cfg.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=64, sampler=val_sampler, num_workers=cfg.workers)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(SigNet()).to(device)
    model = DDP(model, device_ids=[gpu])
    opt = torch.optim.RMSprop(model.parameters(), lr=cfg.lr * world_size, eps=1e-8, weight_decay=5e-4, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.1)

    best_eer = 1.0
    for epoch in range(cfg.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        loss_sum = torch.zeros(2, device=device)
        for a, b, y in train_loader:
            a, b, y = a.to(device, non_blocking=True), b.to(device, non_blocking=True), y.to(device)
            ea, eb = model(a, b)
            loss = contrastive_loss(ea, eb, y, cfg.margin)
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss_sum += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
        sched.step()
        dist.all_reduce(loss_sum)

        # validation: every rank scores its shard, rank 0 computes the EER on all of them
        model.eval()
        dists, labels, idx = [], [], list(val_sampler)
        with torch.no_grad():
            for a, b, y in val_loader:
                ea, eb = model.module(a.to(device), b.to(device))
                dists.append(F.pairwise_distance(ea, eb).cpu().numpy())
                labels.append(y.numpy())
        local = (np.array(idx), np.concatenate(dists), np.concatenate(labels))
        gathered = [None] * world_size
        dist.all_gather_object(gathered, local)
        if gpu == 0:
            all_idx = np.concatenate([g[0] for g in gathered])
            _, keep = np.unique(all_idx, return_index=True)  # drop the sampler's padding duplicates
            all_d = np.concatenate([g[1] for g in gathered])[keep]
            all_y = np.concatenate([g[2] for g in gathered])[keep]
            eer, thr = eer_from_scores(all_d, all_y)
            print(f"epoch {epoch:02d} loss {(loss_sum[0] / loss_sum[1]).item():.4f} "
                  f"val EER {eer * 100:.2f}% (thr {thr:.3f})", flush=True)
            os.makedirs(cfg.save, exist_ok=True)
            ck = {"model": model.module.state_dict(), "epoch": epoch, "eer": eer, "threshold": thr}
            torch.save(ck, os.path.join(cfg.save, "last.pt"))
            if eer < best_eer:
                best_eer = eer
                torch.save(ck, os.path.join(cfg.save, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    cfg = get_config()
    mp.spawn(train_worker, nprocs=cfg.gpus, args=(cfg.gpus, cfg), join=True)
