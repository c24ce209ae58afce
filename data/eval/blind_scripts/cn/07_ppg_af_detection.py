"""Atrial fibrillation detection from wrist PPG (+ 3-axis accelerometer for motion context).

Each subject is one HDF5 file written by our ingestion job:
    /ppg      float32 [T]      64 Hz, green channel
    /acc      float32 [3, T]   64 Hz resampled
    /af_mask  uint8   [T]      1 where the reference ECG was labelled AF
Windows: 30 s, hop 10 s for training and 30 s (non-overlapping) for evaluation.
Folds are precomputed (folds.json: {"0": [subject ids], ...}) so that every run of a
given fold sees the same subjects.

    torchrun --nproc_per_node=4 07_ppg_af_detection.py --root /mnt/data/ppg_af --fold 2
"""
import argparse
import json
import os
from pathlib import Path

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score, f1_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

FS = 64


class SubjectWindows(Dataset):
    def __init__(self, h5_path, win_s=30, hop_s=10, augment=False):
        with h5py.File(h5_path, "r") as f:
            ppg = f["ppg"][:]
            acc = f["acc"][:]
            mask = f["af_mask"][:]
        ppg = (ppg - np.median(ppg)) / (np.percentile(ppg, 95) - np.percentile(ppg, 5) + 1e-6)
        self.sig = np.concatenate([ppg[None], acc / 9.81], axis=0).astype(np.float32)
        self.mask = mask
        self.win, self.hop = win_s * FS, hop_s * FS
        self.starts = np.arange(0, self.sig.shape[1] - self.win + 1, self.hop)
        self.augment = augment

    def __len__(self):
        return len(self.starts)

    def label(self, i):
        s = self.starts[i]
        return float(self.mask[s:s + self.win].mean() >= 0.5)

    def __getitem__(self, i):
        s = self.starts[i]
        x = self.sig[:, s:s + self.win].copy()
        if self.augment:
            x[0] *= np.random.uniform(0.8, 1.2)
            x[0] += np.random.normal(0, 0.02, size=x.shape[1]).astype(np.float32)
        return torch.from_numpy(x), torch.tensor(self.label(i))


class ResBlock(nn.Module):
    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv1d(c_in, c_out, 9, stride, 4, bias=False), nn.GroupNorm(8, c_out), nn.GELU(),
            nn.Conv1d(c_out, c_out, 9, 1, 4, bias=False), nn.GroupNorm(8, c_out),
        )
        self.skip = nn.Identity() if (stride == 1 and c_in == c_out) else nn.Conv1d(c_in, c_out, 1, stride)

    def forward(self, x):
        return F.gelu(self.body(x) + self.skip(x))


class PPGNet(nn.Module):
    def __init__(self, in_ch=4, widths=(32, 64, 128, 128, 256)):
        super().__init__()
        layers, c = [nn.Conv1d(in_ch, widths[0], 15, 2, 7)], widths[0]
        for w in widths:
            layers.append(ResBlock(c, w, 2))
            c = w
        self.net = nn.Sequential(*layers)
        self.head = nn.Linear(c, 1)

    def forward(self, x):
        return self.head(self.net(x).mean(-1)).squeeze(-1)


def make_split(root, fold, augment_train=True):
    folds = json.loads((Path(root) / "folds.json").read_text())
    n = len(folds)
    test_ids = folds[str(fold)]
    val_ids = folds[str((fold + 1) % n)]
    train_ids = [s for k, v in folds.items() if int(k) not in (fold, (fold + 1) % n) for s in v]

    def ds(ids, **kw):
        return ConcatDataset([SubjectWindows(Path(root) / f"{sid}.h5", **kw) for sid in ids])

    return (ds(train_ids, hop_s=10, augment=augment_train), ds(val_ids, hop_s=30), ds(test_ids, hop_s=30))


def positive_fraction(concat):
    labels = [d.label(i) for d in concat.datasets for i in range(len(d))]
    return float(np.mean(labels))


@torch.no_grad()
def collect(model, loader, n, device):
    model.eval()
    p, t = [], []
    for x, y in loader:
        p.append(torch.sigmoid(model(x.to(device, non_blocking=True))))
        t.append(y.to(device, non_blocking=True))
    p, t = torch.cat(p), torch.cat(t)
    world = dist.get_world_size()
    bufs_p = [torch.empty_like(p) for _ in range(world)]
    bufs_t = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(bufs_p, p)
    dist.all_gather(bufs_t, t)
    p = torch.stack(bufs_p, 1).flatten()[:n].cpu().numpy()
    t = torch.stack(bufs_t, 1).flatten()[:n].cpu().numpy()
    return {
        "auroc": roc_auc_score(t, p),
        "auprc": average_precision_score(t, p),
        "f1": f1_score(t.astype(int), (p >= 0.5).astype(int)),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--fold", type=int, required=True)
    ap.add_argument("--ckpt_dir", default="checkpoints")
    ap.add_argument("--batch_size", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--patience", type=int, default=6)
    ap.add_argument("--num_workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=17)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_ds, val_ds, test_ds = make_split(args.root, args.fold)
    pos_frac = positive_fraction(train_ds)
    if rank == 0:
        print(f"fold {args.fold}: {len(train_ds)} train windows ({pos_frac:.1%} AF), "
              f"{len(val_ds)} val, {len(test_ds)} test", flush=True)

    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, drop_last=True,
                          num_workers=args.num_workers, pin_memory=True, persistent_workers=True, prefetch_factor=4)
    val_dl = DataLoader(val_ds, batch_size=256, sampler=DistributedSampler(val_ds, shuffle=False),
                        num_workers=args.num_workers, pin_memory=True)
    test_dl = DataLoader(test_ds, batch_size=256, sampler=DistributedSampler(test_ds, shuffle=False),
                         num_workers=args.num_workers, pin_memory=True)

    model = DDP(PPGNet().to(dev), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(train_dl))
    pos_weight = torch.tensor((1 - pos_frac) / max(pos_frac, 1e-3), device=dev)
    scaler = torch.cuda.amp.GradScaler()

    os.makedirs(args.ckpt_dir, exist_ok=True)
    ckpt_file = os.path.join(args.ckpt_dir, f"ppgnet_fold{args.fold}.pt")
    best, stale = 0.0, 0
    for epoch in range(args.epochs):
        model.train()
        loss_sum = torch.zeros(2, device=dev)
        for x, y in train_dl:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logit = model(x)
            loss = F.binary_cross_entropy_with_logits(logit.float(), y, pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=dev)])
        dist.all_reduce(loss_sum)

        val = collect(model, val_dl, len(val_ds), dev)
        improved = val["auroc"] > best
        if improved:
            best, stale = val["auroc"], 0
        else:
            stale += 1
        if rank == 0:
            print(f"epoch {epoch:02d} train_loss {(loss_sum[0] / loss_sum[1]).item():.4f} "
                  f"val AUROC {val['auroc']:.4f} AUPRC {val['auprc']:.4f} F1 {val['f1']:.4f}"
                  + (" *" if improved else ""), flush=True)
            if improved:
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "val": val}, ckpt_file)
        if stale >= args.patience:
            break

    dist.barrier()
    state = torch.load(ckpt_file, map_location=dev)
    model.module.load_state_dict(state["model"])
    test = collect(model, test_dl, len(test_ds), dev)
    if rank == 0:
        print(f"fold {args.fold} best epoch {state['epoch']} TEST AUROC {test['auroc']:.4f} "
              f"AUPRC {test['auprc']:.4f} F1 {test['f1']:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
