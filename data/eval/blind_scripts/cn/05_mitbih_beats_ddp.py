#!/usr/bin/env python3
# AAMI beat classification (N / S / V / F / Q) on the MIT-BIH Arrhythmia Database.
#
# Beats are cut around the reference R-peak annotations (wfdb), MLII lead, 360 Hz.
# Each beat gets the raw waveform plus pre-RR / post-RR / local-average RR features.
# Records are split into k folds (inter-patient); --fold is the held-out fold.
#
#   torchrun --nnodes=1 --nproc_per_node=4 05_mitbih_beats_ddp.py --db_dir /data/mitdb --fold 1
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import wfdb
from sklearn.metrics import classification_report, f1_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler
from torch.utils.data.distributed import DistributedSampler

RECORDS = [
    "101", "106", "108", "109", "112", "114", "115", "116", "118", "119", "122", "124", "201", "203",
    "205", "207", "208", "209", "215", "220", "223", "230", "100", "103", "105", "111", "113", "117",
    "121", "123", "200", "202", "210", "212", "213", "214", "219", "221", "222", "228", "231", "232",
    "233", "234",
]  # paced records 102, 104, 107, 217 excluded as usual
AAMI = {
    "N": 0, "L": 0, "R": 0, "e": 0, "j": 0,
    "A": 1, "a": 1, "J": 1, "S": 1,
    "V": 2, "E": 2,
    "F": 3,
    "/": 4, "f": 4, "Q": 4,
}
CLASSES = ["N", "S", "V", "F", "Q"]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--db_dir", default="/data/mitdb")
    p.add_argument("--out", default="out/mitbih")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--n_folds", type=int, default=4)
    p.add_argument("--pre", type=int, default=90)
    p.add_argument("--post", type=int, default=162)
    p.add_argument("--bs", type=int, default=256)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=2023)
    return p.parse_args()


def load_record(db_dir, rec, pre, post):
    sig, _ = wfdb.rdsamp(os.path.join(db_dir, rec), channel_names=["MLII"])
    ann = wfdb.rdann(os.path.join(db_dir, rec), "atr")
    x = sig[:, 0].astype(np.float32)
    peaks = np.asarray(ann.sample)
    syms = np.asarray(ann.symbol)
    keep = np.isin(syms, list(AAMI))
    peaks, syms = peaks[keep], syms[keep]
    rr = np.diff(peaks).astype(np.float32) / 360.0
    beats, feats, labels = [], [], []
    for i in range(1, len(peaks) - 1):
        p = peaks[i]
        if p - pre < 0 or p + post > len(x):
            continue
        seg = x[p - pre:p + post]
        seg = (seg - seg.mean()) / (seg.std() + 1e-6)
        local = rr[max(0, i - 10):i].mean()
        feats.append([rr[i - 1], rr[i], local, rr[i - 1] / local])
        beats.append(seg)
        labels.append(AAMI[syms[i]])
    return np.stack(beats), np.asarray(feats, np.float32), np.asarray(labels, np.int64)


def build(db_dir, recs, pre, post):
    parts = [load_record(db_dir, r, pre, post) for r in recs]
    x = torch.from_numpy(np.concatenate([p[0] for p in parts]))[:, None]
    f = torch.from_numpy(np.concatenate([p[1] for p in parts]))
    y = torch.from_numpy(np.concatenate([p[2] for p in parts]))
    return TensorDataset(x, f, y)


class BeatNet(nn.Module):
    def __init__(self, n_classes=5):
        super().__init__()
        ch = [1, 32, 64, 128, 128]
        blocks = []
        for a, b in zip(ch[:-1], ch[1:]):
            blocks += [nn.Conv1d(a, b, 5, padding=2), nn.BatchNorm1d(b), nn.ReLU(inplace=True), nn.MaxPool1d(2)]
        self.cnn = nn.Sequential(*blocks, nn.AdaptiveAvgPool1d(1), nn.Flatten())
        self.rr = nn.Sequential(nn.Linear(4, 32), nn.ReLU(inplace=True))
        self.cls = nn.Sequential(nn.Linear(128 + 32, 128), nn.ReLU(inplace=True), nn.Dropout(0.3),
                                 nn.Linear(128, n_classes))

    def forward(self, x, rr):
        return self.cls(torch.cat([self.cnn(x), self.rr(rr)], dim=1))


@torch.no_grad()
def predict(model, loader, device):
    model.eval()
    out, ys = [], []
    for x, f, y in loader:
        out.append(torch.softmax(model(x.to(device), f.to(device)), 1))
        ys.append(y.to(device))
    out, ys = torch.cat(out), torch.cat(ys)
    ws = dist.get_world_size()
    go = [torch.zeros_like(out) for _ in range(ws)]
    gy = [torch.zeros_like(ys) for _ in range(ws)]
    dist.all_gather(go, out)
    dist.all_gather(gy, ys)
    n = len(loader.dataset)
    return torch.stack(go, 1).flatten(0, 1)[:n].cpu().numpy(), torch.stack(gy, 1).flatten(0, 1)[:n].cpu().numpy()


def scores(prob, y):
    pred = prob.argmax(1)
    present = [c for c in range(len(CLASSES)) if (y == c).any()]
    auc = np.mean([roc_auc_score(y == c, prob[:, c]) for c in present])
    return f1_score(y, pred, average="macro", labels=present), auc, pred


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    rng = np.random.default_rng(args.seed)
    recs = rng.permutation(RECORDS)
    folds = np.array_split(recs, args.n_folds)
    test_recs = list(folds[args.fold])
    val_recs = list(folds[(args.fold + 1) % args.n_folds])
    train_recs = [r for r in recs if r not in test_recs and r not in val_recs]

    train_ds = build(args.db_dir, train_recs, args.pre, args.post)
    val_ds = build(args.db_dir, val_recs, args.pre, args.post)
    test_ds = build(args.db_dir, test_recs, args.pre, args.post)

    # N beats outnumber F beats ~100:1, so draw training beats with inverse class frequency
    y_tr = train_ds.tensors[2]
    class_count = torch.bincount(y_tr, minlength=len(CLASSES)).float()
    sample_w = (1.0 / class_count.clamp(min=1))[y_tr]
    train_sampler = WeightedRandomSampler(sample_w, num_samples=len(y_tr), replacement=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=1024, sampler=DistributedSampler(val_ds, shuffle=False))
    test_dl = DataLoader(test_ds, batch_size=1024, sampler=DistributedSampler(test_ds, shuffle=False))

    model = DDP(BeatNet().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    crit = nn.CrossEntropyLoss()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train {len(train_ds)} beats ({class_count.long().tolist()}) val {len(val_ds)} test {len(test_ds)}")
    best, best_ep = -1.0, -1
    ckpt = os.path.join(args.out, f"beatnet_fold{args.fold}.pt")
    for ep in range(args.epochs):
        model.train()
        t = time.time()
        tot_loss = torch.zeros(1, device=device)
        for x, f, y in train_dl:
            x, f, y = x.to(device, non_blocking=True), f.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = crit(model(x, f), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            tot_loss += loss.detach()
        sched.step()
        dist.all_reduce(tot_loss)
        prob, y = predict(model, val_dl, device)
        mf1, auc, _ = scores(prob, y)
        if rank == 0:
            print(f"ep {ep:02d} loss {tot_loss.item() / dist.get_world_size() / len(train_dl):.4f} "
                  f"val mF1 {mf1:.4f} AUROC {auc:.4f} ({time.time() - t:.1f}s)")
            if mf1 > best:
                best, best_ep = mf1, ep
                torch.save(model.module.state_dict(), ckpt)

    dist.barrier()
    model.module.load_state_dict(torch.load(ckpt, map_location=device))
    prob, y = predict(model, test_dl, device)
    mf1, auc, pred = scores(prob, y)
    if rank == 0:
        print(f"best epoch {best_ep}: test macro-F1 {mf1:.4f} AUROC {auc:.4f}")
        print(classification_report(y, pred, labels=range(len(CLASSES)), target_names=CLASSES, digits=4,
                                    zero_division=0))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
