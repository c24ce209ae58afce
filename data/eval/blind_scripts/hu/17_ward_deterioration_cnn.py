"""Ward deterioration early warning (ICU transfer / rapid response / death within 24h).

Samples are 12h windows of vitals + labs taken every 4h along each ward encounter.
Split is done by patient so that windows of the same person never end up on both sides.

torchrun --nproc_per_node=4 17_ward_deterioration_cnn.py --windows /data/ews/windows.npz
"""
import argparse
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def get_args():
    p = argparse.ArgumentParser(description="ward EWS training")
    p.add_argument("--windows", required=True)
    p.add_argument("--save", default="ews_ckpt")
    p.add_argument("--val_frac", type=float, default=0.15)
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--jitter", type=float, default=0.05, help="gaussian noise on z-scored vitals")
    p.add_argument("--seed", type=int, default=11)
    return p.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def split_by_patient(patient_ids, val_frac):
    uniq = np.unique(patient_ids)
    np.random.shuffle(uniq)
    n_val = int(len(uniq) * val_frac)
    val_patients = set(uniq[:n_val].tolist())
    is_val = np.array([p in val_patients for p in patient_ids])
    return np.where(~is_val)[0], np.where(is_val)[0]


class Windows(Dataset):
    def __init__(self, x, m, y, idx, train, jitter):
        self.x, self.m, self.y, self.idx = x, m, y, idx
        self.train, self.jitter = train, jitter

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, k):
        i = self.idx[k]
        x = self.x[i].copy()
        if self.train and self.jitter > 0:
            x = x + np.random.normal(0, self.jitter, size=x.shape).astype(np.float32) * self.m[i]
        return (torch.from_numpy(np.concatenate([x, self.m[i]], axis=0)),
                torch.tensor(self.y[i], dtype=torch.float32), k)


class EWSNet(nn.Module):
    def __init__(self, in_ch, ch):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv1d(in_ch, ch, 3, padding=1), nn.GELU(),
            nn.Conv1d(ch, ch, 3, padding=2, dilation=2), nn.GELU(),
            nn.Conv1d(ch, ch, 3, padding=4, dilation=4), nn.GELU(),
        )
        self.fc = nn.Sequential(nn.Linear(2 * ch, ch), nn.GELU(), nn.Dropout(0.2), nn.Linear(ch, 1))

    def forward(self, x):
        h = self.conv(x)
        return self.fc(torch.cat([h.mean(-1), h[..., -1]], dim=-1)).squeeze(-1)


@torch.no_grad()
def evaluate(model, ds, device, rank, world):
    loader = DataLoader(ds, batch_size=1024, num_workers=2,
                        sampler=DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False))
    model.eval()
    p = torch.full((len(ds),), -1.0, device=device)
    for x, _, k in loader:
        p[k.to(device)] = torch.sigmoid(model(x.to(device)))
    dist.all_reduce(p, op=dist.ReduceOp.MAX)
    y = ds.y[ds.idx]
    p = p.cpu().numpy()
    return roc_auc_score(y, p), average_precision_score(y, p)


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    # per-rank seed so the jitter augmentation is not identical on every GPU
    seed_everything(args.seed + rank)

    d = np.load(args.windows)
    x = d["x"].astype(np.float32)      # [N, C, 12] z-scored, 0 where missing
    m = d["mask"].astype(np.float32)   # [N, C, 12]
    y = d["label"].astype(np.float32)  # [N]
    patient_ids = d["patient_id"]
    tr_idx, va_idx = split_by_patient(patient_ids, args.val_frac)

    train_ds = Windows(x, m, y, tr_idx, True, args.jitter)
    val_ds = Windows(x, m, y, va_idx, False, 0.0)
    if rank == 0:
        print(f"windows train {len(train_ds)} ({y[tr_idx].mean():.3%} pos), "
              f"val {len(val_ds)} ({y[va_idx].mean():.3%} pos)", flush=True)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=args.batch, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True,
                        worker_init_fn=lambda w: np.random.seed((args.seed + rank) * 1000 + w))

    model = DDP(EWSNet(2 * x.shape[1], args.channels).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    pos_w = torch.tensor(min(20.0, (1 - y[tr_idx].mean()) / y[tr_idx].mean()), device=device)

    if rank == 0:
        os.makedirs(args.save, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        agg = torch.zeros(2, device=device)
        for xb, yb, _ in loader:
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(xb), yb, pos_weight=pos_w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            agg += torch.stack([loss.detach() * len(yb), torch.tensor(float(len(yb)), device=device)])
        sched.step()
        dist.all_reduce(agg)
        auc, ap = evaluate(model.module, val_ds, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch:02d} loss {(agg[0] / agg[1]).item():.4f} val AUROC {auc:.4f} AUPRC {ap:.4f}",
                  flush=True)
            if auc > best:
                best = auc
                torch.save({"state_dict": model.module.state_dict(), "epoch": epoch, "auroc": auc},
                           os.path.join(args.save, "ews_best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
