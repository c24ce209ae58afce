"""Writer-independent offline signature verification on BHSig260 (Bengali + Hindi).

A ResNet-18 twin encoder scores (reference, questioned) pairs; genuine/genuine pairs are
positives, genuine/skilled-forgery pairs negatives. Signers are split by id (disjoint).
The job is preemptible: it resumes from <out>/last.pt if present.

    torchrun --nproc_per_node=4 07_bhsig_pair_verifier.py --root /data/BHSig260 --out /ckpt/bhsig_r18
"""
import argparse
import glob
import itertools
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from PIL import Image
from sklearn.metrics import roc_auc_score, roc_curve
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--scripts", nargs="+", default=["Bengali", "Hindi"])
    p.add_argument("--train-frac", type=float, default=0.8)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=128, help="global")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--neg-per-signer", type=int, default=276)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=2024)
    return p.parse_args()


def collect(root, scripts):
    """returns {(script, signer): {"G": [...], "F": [...]}}"""
    table = {}
    for script in scripts:
        for d in sorted(glob.glob(os.path.join(root, script, "*"))):
            if not os.path.isdir(d):
                continue
            key = (script, os.path.basename(d))
            files = sorted(glob.glob(os.path.join(d, "*.tif")))
            table[key] = {"G": [f for f in files if "-G-" in os.path.basename(f)],
                          "F": [f for f in files if "-F-" in os.path.basename(f)]}
    return table


def build_pairs(table, signers, neg_per_signer, seed):
    rng = random.Random(seed)
    pairs = []
    for s in signers:
        g, f = table[s]["G"], table[s]["F"]
        pos = [(a, b, 1.0) for a, b in itertools.combinations(g, 2)]
        neg = [(a, b, 0.0) for a in g for b in f]
        rng.shuffle(neg)
        pairs.extend(pos)
        pairs.extend(neg[:neg_per_signer])
    return pairs


class SigPairs(Dataset):
    def __init__(self, pairs, train):
        self.pairs = pairs
        aug = [T.RandomAffine(degrees=5, translate=(0.03, 0.03), scale=(0.9, 1.1), fill=0)] if train else []
        self.tf = T.Compose([T.Grayscale(), T.Lambda(lambda im: Image.eval(im, lambda v: 255 - v)),
                             T.Resize((150, 220)), *aug, T.ToTensor()])

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        a, b, y = self.pairs[i]
        return self.tf(Image.open(a)), self.tf(Image.open(b)), torch.tensor(y), i


class PairVerifier(nn.Module):
    def __init__(self):
        super().__init__()
        r = torchvision.models.resnet18(weights=None, num_classes=256)
        r.conv1 = nn.Conv2d(1, 64, 7, 2, 3, bias=False)
        self.encoder = r
        self.head = nn.Sequential(nn.Linear(256 * 2, 128), nn.ReLU(inplace=True), nn.Linear(128, 1))

    def forward(self, a, b):
        ea, eb = self.encoder(a), self.encoder(b)
        return self.head(torch.cat([(ea - eb).abs(), ea * eb], dim=1)).squeeze(1)


def eer(y, s):
    fpr, tpr, _ = roc_curve(y, s)
    i = np.argmin(np.abs(1 - tpr - fpr))
    return (fpr[i] + 1 - tpr[i]) / 2


@torch.no_grad()
def validate(model, loader, device, world):
    model.eval()
    scores, labels, idx = [], [], []
    for a, b, y, i in loader:
        scores.append(torch.sigmoid(model(a.to(device), b.to(device))))
        labels.append(y.to(device))
        idx.append(i.to(device))
    local = torch.stack([torch.cat(idx).float(), torch.cat(labels), torch.cat(scores)], dim=1)
    out = [torch.empty_like(local) for _ in range(world)]  # DistributedSampler gives every rank the same count
    dist.all_gather(out, local)
    allv = torch.cat(out).cpu().numpy()
    _, keep = np.unique(allv[:, 0], return_index=True)
    y, s = allv[keep, 1], allv[keep, 2]
    model.train()
    acc = float(((s > 0.5) == (y > 0.5)).mean())
    return acc, float(roc_auc_score(y, s)), float(eer(y, s))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    table = collect(args.root, args.scripts)
    signers = sorted(table)
    n_train = int(len(signers) * args.train_frac)
    train_signers, val_signers = signers[:n_train], signers[n_train:]
    train_ds = SigPairs(build_pairs(table, train_signers, args.neg_per_signer, args.seed), train=True)
    val_ds = SigPairs(build_pairs(table, val_signers, args.neg_per_signer, args.seed + 1), train=False)
    if rank == 0:
        print(f"train: {len(train_signers)} signers {len(train_ds)} pairs | "
              f"val: {len(val_signers)} signers {len(val_ds)} pairs", flush=True)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size // world, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=128, sampler=val_sampler, num_workers=args.workers)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(PairVerifier()).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[15, 25], gamma=0.1)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, best_eer = 0, 1.0
    last_path = os.path.join(args.out, "last.pt")
    if os.path.exists(last_path):
        ckpt = torch.load(last_path)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_eer = ckpt["epoch"] + 1, ckpt["best_eer"]
        if rank == 0:
            print(f"resumed from epoch {ckpt['epoch']}", flush=True)
        del ckpt

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        loss_stats = torch.zeros(2, device=device)
        for a, b, y, _ in train_loader:
            a, b, y = a.to(device, non_blocking=True), b.to(device, non_blocking=True), y.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                logit = model(a, b)
                loss = F.binary_cross_entropy_with_logits(logit.float(), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            loss_stats[0] += loss.detach() * len(y)
            loss_stats[1] += len(y)
        sched.step()
        dist.all_reduce(loss_stats)

        acc, auc, e = validate(model, val_loader, device, world)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) loss {(loss_stats[0] / loss_stats[1]).item():.4f} "
                  f"val acc {acc:.4f} AUC {auc:.4f} EER {e * 100:.2f}%", flush=True)
            best_eer = min(best_eer, e)
            os.makedirs(args.out, exist_ok=True)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "scaler": scaler.state_dict(), "epoch": epoch, "best_eer": best_eer}
            torch.save(state, last_path + ".tmp")
            os.replace(last_path + ".tmp", last_path)
            if e <= best_eer:
                torch.save(model.module.state_dict(), os.path.join(args.out, "best_model.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
