"""DeepSEA-style chromatin profile classifier: 1000 bp -> 919 binary marks
(DNase, TF ChIP, histone), trained on all GPUs of one node.

Started with plain python; the script spawns one worker per visible GPU:
    python 14_dna_cnn_spawn.py --genome hg19.fa --bed data/deepsea_{split}.bed.gz \
        --labels data/deepsea_{split}_labels.npz --cache /data/cache/deepsea --out runs/deepsea_cnn
"""
import argparse
import os
import socket
import time

import numpy as np
import pandas as pd
import pyfaidx
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

LUT = np.full(256, 4, dtype=np.uint8)
for i, c in enumerate(b"ACGT"):
    LUT[c] = i
    LUT[ord(chr(c).lower())] = i


def build_cache(genome, bed, labels, out_prefix, seq_len=1000):
    fa = pyfaidx.Fasta(genome)
    regions = pd.read_csv(bed, sep="\t", header=None, usecols=[0, 1, 2], names=["chrom", "start", "end"])
    codes = np.empty((len(regions), seq_len), dtype=np.uint8)
    for i, r in enumerate(regions.itertuples(index=False)):
        mid = (r.start + r.end) // 2
        s = str(fa[r.chrom][mid - seq_len // 2: mid + seq_len // 2]).encode()
        codes[i] = LUT[np.frombuffer(s.ljust(seq_len, b"N"), dtype=np.uint8)]
    y = np.load(labels)["y"].astype(np.uint8)
    assert len(y) == len(codes)
    np.save(out_prefix + ".x.npy.tmp.npy", codes)
    np.save(out_prefix + ".y.npy.tmp.npy", y)
    os.replace(out_prefix + ".x.npy.tmp.npy", out_prefix + ".x.npy")
    os.replace(out_prefix + ".y.npy.tmp.npy", out_prefix + ".y.npy")


class OneHotSet(Dataset):
    def __init__(self, prefix, rc_augment=False):
        self.x = np.load(prefix + ".x.npy", mmap_mode="r")
        self.y = np.load(prefix + ".y.npy", mmap_mode="r")
        self.rc = rc_augment

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        codes = torch.from_numpy(np.array(self.x[i], dtype=np.int64))
        onehot = F.one_hot(codes, 5)[:, :4].float().t()   # N -> all zeros
        if self.rc and torch.rand(()) < 0.5:
            onehot = onehot.flip(0).flip(1)
        return onehot, torch.from_numpy(np.array(self.y[i], dtype=np.float32))


class DeepSEA(nn.Module):
    def __init__(self, n_out=919):
        super().__init__()
        def block(ci, co, k, pool):
            return nn.Sequential(nn.Conv1d(ci, co, k, padding=k // 2), nn.BatchNorm1d(co), nn.ReLU(),
                                 nn.MaxPool1d(pool), nn.Dropout(0.2))
        self.features = nn.Sequential(block(4, 320, 9, 4), block(320, 480, 9, 4), block(480, 960, 9, 2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(960 * 31, 925), nn.BatchNorm1d(925), nn.ReLU(),
                                        nn.Dropout(0.5), nn.Linear(925, n_out))

    def forward(self, x):
        return self.classifier(self.features(x))


def find_free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@torch.no_grad()
def gather_predictions(model, loader, device):
    model.eval()
    preds, targets = [], []
    for x, y in loader:
        preds.append(torch.sigmoid(model(x.to(device, non_blocking=True))).cpu().numpy())
        targets.append(y.numpy())
    model.train()
    local = (np.concatenate(preds), np.concatenate(targets).astype(np.uint8))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def mean_auc(p, y):
    aucs, auprs = [], []
    for j in range(y.shape[1]):
        if 0 < y[:, j].sum() < len(y):
            aucs.append(roc_auc_score(y[:, j], p[:, j]))
            auprs.append(average_precision_score(y[:, j], p[:, j]))
    return float(np.mean(aucs)), float(np.mean(auprs))


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    prefixes = {s: os.path.join(args.cache, s) for s in ("train", "valid")}
    if rank == 0:
        os.makedirs(args.cache, exist_ok=True)
        for split, prefix in prefixes.items():
            if not os.path.exists(prefix + ".y.npy"):
                print(f"building cache for {split}", flush=True)
                build_cache(args.genome, args.bed.format(split=split), args.labels.format(split=split), prefix)
    dist.barrier()

    train_ds = OneHotSet(prefixes["train"], rc_augment=True)
    valid_all = OneHotSet(prefixes["valid"])
    valid_ds = Subset(valid_all, range(rank, len(valid_all), world_size))
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=512, num_workers=2, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(DeepSEA()).to(device)
    model = DDP(model, device_ids=[rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-6)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=2)

    start_epoch, best = 0, 0.0
    ckpt_path = os.path.join(args.out, "last.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location={"cuda:0": f"cuda:{rank}"})
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        plateau.load_state_dict(ck["plateau"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0, running = time.time(), torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(running)

        p, y = gather_predictions(model.module, valid_loader, device)
        metrics = [None]
        if rank == 0:
            metrics[0] = mean_auc(p, y)
        dist.broadcast_object_list(metrics, src=0)
        auroc, auprc = metrics[0]
        plateau.step(auroc)

        if rank == 0:
            print(f"epoch {epoch} train bce {(running[0] / running[1]).item():.4f} valid AUROC {auroc:.4f} "
                  f"AUPRC {auprc:.4f} lr {opt.param_groups[0]['lr']:.1e} ({time.time() - t0:.0f}s)", flush=True)
            os.makedirs(args.out, exist_ok=True)
            best = max(best, auroc)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "plateau": plateau.state_dict(), "epoch": epoch, "best": best}, ckpt_path)
            if auroc >= best:
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--genome", required=True)
    ap.add_argument("--bed", required=True, help="path with {split}")
    ap.add_argument("--labels", required=True, help="path with {split}")
    ap.add_argument("--cache", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    world_size = torch.cuda.device_count()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(find_free_port()))
    mp.spawn(worker, args=(world_size, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
