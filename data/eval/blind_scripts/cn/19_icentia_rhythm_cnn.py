"""Rhythm classification (normal sinus / AFib / AFlutter) on Icentia11k wearable single-lead ECG.

From each patient's 70-minute segments, prepare_icentia.py cut 8.192 s windows (2048 samples
@ 250 Hz) with a majority rhythm label and stored them per patient:
    {root}/p{patient:05d}.npz   x [n, 2048] int16 (raw ADC), y [n] int8 (0 N, 1 AFIB, 2 AFL)
We use the first --n_patients patients, split patient-wise into k folds.

    torchrun --nproc_per_node=4 19_icentia_rhythm_cnn.py --root /data/icentia_windows --fold 3
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import f1_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

CLASSES = ["N", "AFIB", "AFL"]
ADC_GAIN = 1 / 1000.0


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--n_patients", type=int, default=2000)
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--n_folds", type=int, default=5)
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--patience", type=int, default=5)
    p.add_argument("--out_dir", default="runs/icentia")
    p.add_argument("--seed", type=int, default=4)
    return p.parse_args()


class IcentiaWindows(Dataset):
    def __init__(self, root, patients):
        xs, ys = [], []
        for pid in patients:
            d = np.load(os.path.join(root, f"p{pid:05d}.npz"))
            xs.append(d["x"])
            ys.append(d["y"].astype(np.int64))
        self.x = np.concatenate(xs)
        self.y = np.concatenate(ys)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x = self.x[i].astype(np.float32) * ADC_GAIN
        x = (x - x.mean()) / (x.std() + 1e-6)
        return torch.from_numpy(x)[None], self.y[i]


def res_unit(c_in, c_out, stride):
    return nn.ModuleDict({
        "main": nn.Sequential(
            nn.BatchNorm1d(c_in), nn.ReLU(), nn.Conv1d(c_in, c_out, 15, stride, 7, bias=False),
            nn.BatchNorm1d(c_out), nn.ReLU(), nn.Dropout(0.2), nn.Conv1d(c_out, c_out, 15, 1, 7, bias=False),
        ),
        "skip": nn.Sequential(nn.MaxPool1d(stride, ceil_mode=True), nn.Conv1d(c_in, c_out, 1, bias=False)),
    })


class StanfordStyleNet(nn.Module):
    """Pre-activation 1D ResNet loosely following Hannun et al. 2019."""

    def __init__(self, n_classes=3, base=32, n_units=8):
        super().__init__()
        self.stem = nn.Conv1d(1, base, 15, 1, 7, bias=False)
        units, c = [], base
        for i in range(n_units):
            c_out = base * 2 ** (i // 2)
            units.append(res_unit(c, c_out, 2 if i % 2 else 1))
            c = c_out
        self.units = nn.ModuleList(units)
        self.final = nn.Sequential(nn.BatchNorm1d(c), nn.ReLU())
        self.fc = nn.Linear(c, n_classes)

    def forward(self, x):
        h = self.stem(x)
        for u in self.units:
            h = u["main"](h) + u["skip"](h)
        return self.fc(self.final(h).mean(-1))


def shard(n, rank, world):
    # strided shard: every sample is evaluated exactly once
    return np.arange(n)[rank::world]


@torch.no_grad()
def evaluate(net, ds, rank, world, device, bs=1024):
    net.eval()
    loader = DataLoader(Subset(ds, shard(len(ds), rank, world)), batch_size=bs, num_workers=4, pin_memory=True)
    probs, labels = [], []
    for x, y in loader:
        probs.append(F.softmax(net(x.to(device, non_blocking=True)), 1))
        labels.append(y.to(device, non_blocking=True))
    probs, labels = torch.cat(probs), torch.cat(labels)
    all_probs = [torch.zeros_like(probs) for _ in range(world)]
    all_labels = [torch.zeros_like(labels) for _ in range(world)]
    dist.all_gather(all_probs, probs)
    dist.all_gather(all_labels, labels)
    P = torch.cat(all_probs).cpu().numpy()
    Y = torch.cat(all_labels).cpu().numpy()
    pred = P.argmax(1)
    return {
        "macro_f1": float(f1_score(Y, pred, average="macro")),
        "f1_af": float(f1_score(Y == 1, pred == 1)),
        "auroc": float(roc_auc_score(Y, P, multi_class="ovr", average="macro")),
    }


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    patients = np.arange(args.n_patients)
    folds = np.array_split(np.random.RandomState(args.seed).permutation(patients), args.n_folds)
    test_p = folds[args.fold]
    val_p = folds[(args.fold + 1) % args.n_folds]
    train_p = np.setdiff1d(patients, np.concatenate([test_p, val_p]))
    train_ds, val_ds, test_ds = (IcentiaWindows(args.root, sorted(p)) for p in (train_p, val_p, test_p))

    counts = np.bincount(train_ds.y, minlength=len(CLASSES))
    if rank == 0:
        print(f"fold {args.fold}: windows train {len(train_ds)} {counts.tolist()} | val {len(val_ds)} | "
              f"test {len(test_ds)}", flush=True)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=8, pin_memory=True,
                          drop_last=True, persistent_workers=True)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(StanfordStyleNet()).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.1, patience=2)
    # AFib/AFlutter are rare in Icentia11k; weight the loss by inverse sqrt frequency
    class_w = torch.tensor((counts.max() / np.maximum(counts, 1)) ** 0.5, dtype=torch.float32, device=device)

    os.makedirs(args.out_dir, exist_ok=True)
    best_path = os.path.join(args.out_dir, f"fold{args.fold}_best.pt")
    best, bad = -1.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, tot = time.time(), torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, weight=class_w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)

        val = evaluate(net, val_ds, rank, world, device)
        sched.step(val["macro_f1"])
        if rank == 0:
            print(f"epoch {epoch:02d} loss {(tot[0] / tot[1]).item():.4f} val macroF1 {val['macro_f1']:.4f} "
                  f"AF F1 {val['f1_af']:.4f} AUROC {val['auroc']:.4f} ({time.time() - t0:.0f}s)", flush=True)
        if val["macro_f1"] > best:
            best, bad = val["macro_f1"], 0
            if rank == 0:
                torch.save(net.state_dict(), best_path)
        else:
            bad += 1
            if bad >= args.patience:
                break

    dist.barrier()
    net.load_state_dict(torch.load(best_path, map_location=device))
    test = evaluate(net, test_ds, rank, world, device)
    if rank == 0:
        print(f"fold {args.fold} TEST macroF1 {test['macro_f1']:.4f} AF F1 {test['f1_af']:.4f} "
              f"AUROC {test['auroc']:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
