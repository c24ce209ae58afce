"""Target / non-target ERP classification for a P300 speller (multi-subject).

Raw EDF recordings are epoched with MNE once (-0.1..0.8 s around each flash,
0.5-20 Hz, decimated to 64 Hz) and cached as one .npz per subject.  The model
is a small spatio-temporal CNN; the metric is ROC-AUC over all validation
epochs, which is what matters for the character-level speller accuracy.

    torchrun --standalone --nproc_per_node=4 09_p300_erp_cnn.py --raw_dir /data/p300/raw
"""
import argparse
import glob
import os
from datetime import timedelta
from pathlib import Path

import mne
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

mne.set_log_level("WARNING")


def build_cache(raw_dir, cache_dir):
    cache_dir.mkdir(parents=True, exist_ok=True)
    for edf in sorted(glob.glob(os.path.join(raw_dir, "*.edf"))):
        sub = Path(edf).stem
        out = cache_dir / f"{sub}.npz"
        if out.exists():
            continue
        raw = mne.io.read_raw_edf(edf, preload=True)
        raw.pick("eeg").set_eeg_reference("average")
        raw.filter(0.5, 20.0, fir_design="firwin")
        events, event_id = mne.events_from_annotations(raw)
        keep = {k: v for k, v in event_id.items() if k in ("target", "nontarget")}
        epochs = mne.Epochs(raw, events, keep, tmin=-0.1, tmax=0.8, baseline=(None, 0),
                            decim=int(raw.info["sfreq"] // 64), preload=True)
        X = epochs.get_data().astype(np.float32) * 1e6  # V -> uV
        y = (epochs.events[:, 2] == keep["target"]).astype(np.int64)
        tmp = cache_dir / f"{sub}.tmp.npz"
        np.savez(tmp, X=X, y=y)
        os.replace(tmp, out)


class ERPDataset(Dataset):
    def __init__(self, files):
        xs, ys = [], []
        for f in files:
            d = np.load(f)
            X = d["X"]
            # per-subject channel scaling from that subject's own recording
            X = X / (X.std(axis=(0, 2), keepdims=True) + 1e-6)
            xs.append(X)
            ys.append(d["y"])
        self.X = torch.from_numpy(np.concatenate(xs))
        self.y = torch.from_numpy(np.concatenate(ys))

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return i, self.X[i], self.y[i]


class ERPNet(nn.Module):
    def __init__(self, n_chans, n_times, f_spatial=16, f_temporal=32, drop=0.4):
        super().__init__()
        self.spatial = nn.Conv2d(1, f_spatial, (n_chans, 1), bias=False)
        self.bn1 = nn.BatchNorm2d(f_spatial)
        self.temporal = nn.Conv2d(f_spatial, f_temporal, (1, 9), padding=(0, 4), bias=False)
        self.bn2 = nn.BatchNorm2d(f_temporal)
        self.pool = nn.AvgPool2d((1, 4))
        self.drop = nn.Dropout(drop)
        self.fc = nn.Linear(f_temporal * (n_times // 4), 1)

    def forward(self, x):
        x = F.elu(self.bn1(self.spatial(x.unsqueeze(1))))
        x = self.drop(self.pool(F.elu(self.bn2(self.temporal(x)))))
        return self.fc(x.flatten(1)).squeeze(1)


@torch.no_grad()
def evaluate(model, loader, device, n_total, world):
    model.eval()
    idx_l, score_l = [], []
    for idx, x, _ in loader:
        score_l.append(model(x.to(device, non_blocking=True)).float())
        idx_l.append(idx.to(device))
    idx_local, score_local = torch.cat(idx_l), torch.cat(score_l)
    # DistributedSampler pads every rank to the same length, so shapes match
    idx_all = [torch.empty_like(idx_local) for _ in range(world)]
    score_all = [torch.empty_like(score_local) for _ in range(world)]
    dist.all_gather(idx_all, idx_local)
    dist.all_gather(score_all, score_local)
    idx_all = torch.cat(idx_all).cpu().numpy()
    score_all = torch.cat(score_all).cpu().numpy()
    # drop the padded duplicates
    _, first = np.unique(idx_all, return_index=True)
    assert len(first) == n_total
    return idx_all[first], score_all[first]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--raw_dir", required=True)
    ap.add_argument("--cache_dir", default="/data/p300/cache_64hz")
    ap.add_argument("--val_subjects", nargs="+", default=["s07", "s08"])
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch_size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--pos_weight", type=float, default=5.0, help="1 target per 6 flashes")
    ap.add_argument("--out", default="runs/p300")
    ap.add_argument("--init_from", default=None)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # the first run builds the MNE cache on rank 0 while the others wait in the barrier
    dist.init_process_group("nccl", timeout=timedelta(minutes=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    cache_dir = Path(args.cache_dir)
    if rank == 0:
        build_cache(args.raw_dir, cache_dir)
    dist.barrier()

    files = sorted(cache_dir.glob("*.npz"))
    val_files = [f for f in files if f.stem in args.val_subjects]
    train_files = [f for f in files if f.stem not in args.val_subjects]
    train_ds, val_ds = ERPDataset(train_files), ERPDataset(val_files)
    n_chans, n_times = train_ds.X.shape[1:]

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=2,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=1024, sampler=val_sampler, num_workers=2)

    model = ERPNet(n_chans, n_times).to(device)
    if args.init_from:
        model.load_state_dict(torch.load(args.init_from, map_location="cpu"))
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-4)
    pos_weight = torch.tensor(args.pos_weight, device=device)

    writer = SummaryWriter(args.out) if rank == 0 else None
    best_auc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        loss_acc = torch.zeros(2, device=device)
        for _, x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True).float()
            loss = F.binary_cross_entropy_with_logits(model(x), y, pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_acc)

        idx, scores = evaluate(model, val_dl, device, len(val_ds), world)
        if rank == 0:
            auc = roc_auc_score(val_ds.y.numpy()[idx], scores)
            train_loss = (loss_acc[0] / loss_acc[1]).item()
            writer.add_scalar("train/loss", train_loss, epoch)
            writer.add_scalar("val/auc", auc, epoch)
            print(f"epoch {epoch:02d} loss {train_loss:.4f} val AUC {auc:.4f}", flush=True)
            if auc > best_auc:
                best_auc = auc
                torch.save(model.module.state_dict(), Path(args.out) / "best_erpnet.pt")

    if rank == 0:
        writer.close()
        print(f"best val AUC {best_auc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
