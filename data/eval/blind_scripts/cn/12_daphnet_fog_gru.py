"""Freezing-of-gait detection on the Daphnet dataset (3 body-worn 3-axis accelerometers, 64 Hz).

Leave-one-subject-out: --fold k tests on subject k+1. Subjects 4 and 10 have no freezing
episodes and are therefore never used as test subjects (they stay in training).

Windows of 4 s (hop 0.5 s for training, 1 s for evaluation); a window is FoG when more than
half of it is annotated as freezing. Freezing windows are ~10 % of the data, so training
batches are drawn with class-balanced weights.

    torchrun --nproc_per_node=2 12_daphnet_fog_gru.py --raw_dir /data/daphnet/dataset --fold 0
"""
import argparse
import glob
import math
import os
import re

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import f1_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Sampler, TensorDataset

FS = 64
TEST_SUBJECTS = [1, 2, 3, 5, 6, 7, 8, 9]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--raw_dir", required=True)
    p.add_argument("--cache", default="cache/daphnet_windows.npz")
    p.add_argument("--fold", type=int, default=0, choices=range(len(TEST_SUBJECTS)))
    p.add_argument("--win_s", type=float, default=4.0)
    p.add_argument("--batch_size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--patience", type=int, default=10)
    p.add_argument("--out_dir", default="runs/daphnet")
    p.add_argument("--seed", type=int, default=11)
    return p.parse_args()


def build_windows(raw_dir, win_s):
    win = int(win_s * FS)
    out = {"x": [], "y": [], "subject": [], "hop": []}
    for path in sorted(glob.glob(os.path.join(raw_dir, "S*R*.txt"))):
        subj = int(re.search(r"S(\d+)R", os.path.basename(path)).group(1))
        a = np.loadtxt(path)
        sig, ann = a[:, 1:10].astype(np.float32) / 1000.0, a[:, 10].astype(int)  # mg -> g
        for hop_s in (0.5, 1.0):
            hop = int(hop_s * FS)
            for s in range(0, len(a) - win + 1, hop):
                lab = ann[s:s + win]
                if (lab == 0).any():  # outside the experiment protocol
                    continue
                out["x"].append(sig[s:s + win].T)
                out["y"].append(int((lab == 2).mean() > 0.5))
                out["subject"].append(subj)
                out["hop"].append(hop_s)
    return {k: np.asarray(v) for k, v in out.items()}


def load_or_build_cache(args, rank):
    if rank == 0 and not os.path.exists(args.cache):
        os.makedirs(os.path.dirname(args.cache) or ".", exist_ok=True)
        arrays = build_windows(args.raw_dir, args.win_s)
        tmp = args.cache + f".tmp{os.getpid()}.npz"
        np.savez(tmp, **arrays)
        os.replace(tmp, args.cache)
    dist.barrier()
    with np.load(args.cache) as d:
        return {k: d[k] for k in d.files}


class DistributedWeightedSampler(Sampler):
    """WeightedRandomSampler for DDP: all ranks draw the same multinomial sample for an
    epoch (same generator seed) and each keeps a disjoint strided slice of it."""

    def __init__(self, weights, num_replicas, rank, num_samples=None, seed=0):
        self.weights = torch.as_tensor(weights, dtype=torch.double)
        self.num_replicas, self.rank, self.seed, self.epoch = num_replicas, rank, seed, 0
        total = num_samples if num_samples is not None else len(self.weights)
        self.num_samples = math.ceil(total / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        idx = torch.multinomial(self.weights, self.total_size, replacement=True, generator=g)
        return iter(idx[self.rank:self.total_size:self.num_replicas].tolist())

    def __len__(self):
        return self.num_samples

    def set_epoch(self, epoch):
        self.epoch = epoch


class ConvGRU(nn.Module):
    def __init__(self, in_ch=9, hidden=128, n_classes=2):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv1d(in_ch, 64, 7, padding=3), nn.GroupNorm(8, 64), nn.ReLU(),
            nn.Conv1d(64, 64, 7, padding=3, stride=2), nn.GroupNorm(8, 64), nn.ReLU(),
            nn.Conv1d(64, 128, 5, padding=2, stride=2), nn.GroupNorm(8, 128), nn.ReLU(),
        )
        self.gru = nn.GRU(128, hidden, num_layers=2, batch_first=True, bidirectional=True, dropout=0.2)
        self.fc = nn.Linear(2 * hidden, n_classes)

    def forward(self, x):
        h, _ = self.gru(self.conv(x).transpose(1, 2))
        return self.fc(h[:, -1])


@torch.no_grad()
def evaluate(net, x, y, device, bs=1024):
    """Single-process evaluation over the full set (called on rank 0 with the unwrapped module)."""
    net.eval()
    probs = []
    for i in range(0, len(x), bs):
        xb = torch.from_numpy(x[i:i + bs]).to(device)
        probs.append(F.softmax(net(xb), -1)[:, 1].cpu())
    p = torch.cat(probs).numpy()
    return {"auroc": roc_auc_score(y, p), "f1": f1_score(y, p > 0.5), "sens": float((p[y == 1] > 0.5).mean()),
            "spec": float((p[y == 0] <= 0.5).mean())}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    d = load_or_build_cache(args, rank)
    test_subj = TEST_SUBJECTS[args.fold]
    val_subj = TEST_SUBJECTS[(args.fold + 1) % len(TEST_SUBJECTS)]
    tr = (d["subject"] != test_subj) & (d["subject"] != val_subj) & (d["hop"] == 0.5)
    va = (d["subject"] == val_subj) & (d["hop"] == 1.0)
    te = (d["subject"] == test_subj) & (d["hop"] == 1.0)
    mu = d["x"][tr].mean(axis=(0, 2), keepdims=True)
    sd = d["x"][tr].std(axis=(0, 2), keepdims=True) + 1e-6
    norm = lambda m: ((d["x"][m] - mu) / sd).astype(np.float32)
    x_tr, y_tr = norm(tr), d["y"][tr]
    x_va, y_va, x_te, y_te = norm(va), d["y"][va], norm(te), d["y"][te]

    train_ds = TensorDataset(torch.from_numpy(x_tr), torch.from_numpy(y_tr).long())
    class_freq = np.bincount(y_tr, minlength=2) / len(y_tr)
    sampler = DistributedWeightedSampler(1.0 / class_freq[y_tr], num_replicas=world, rank=rank, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=2,
                        pin_memory=True, drop_last=True)

    model = DDP(ConvGRU().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    best_path = os.path.join(args.out_dir, f"fog_S{test_subj:02d}.pt")
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"test S{test_subj:02d} val S{val_subj:02d}: train {len(y_tr)} ({y_tr.mean():.1%} FoG), "
              f"val {len(y_va)}, test {len(y_te)}", flush=True)
    best_auc, bad = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        running = torch.zeros(2, device=device)
        for xb, yb in loader:
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(running)

        stop = torch.zeros(1, device=device)
        if rank == 0:
            m = evaluate(model.module, x_va, y_va, device)
            print(f"epoch {epoch:02d} loss {(running[0] / running[1]).item():.4f} val AUROC {m['auroc']:.4f} "
                  f"F1 {m['f1']:.4f} sens {m['sens']:.3f} spec {m['spec']:.3f}", flush=True)
            if m["auroc"] > best_auc:
                best_auc, bad = m["auroc"], 0
                torch.save(model.module.state_dict(), best_path)
            else:
                bad += 1
            stop.fill_(float(bad >= args.patience))
        dist.broadcast(stop, src=0)
        if stop.item() > 0:
            break

    if rank == 0:
        model.module.load_state_dict(torch.load(best_path, map_location=device))
        m = evaluate(model.module, x_te, y_te, device)
        print(f"TEST S{test_subj:02d}: AUROC {m['auroc']:.4f} F1 {m['f1']:.4f} "
              f"sens {m['sens']:.3f} spec {m['spec']:.3f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
