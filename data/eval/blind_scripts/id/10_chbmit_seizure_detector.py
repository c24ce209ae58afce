"""Patient-independent seizure detection on CHB-MIT scalp EEG.

Recordings were converted to float16 .npy (18 bipolar channels, 256 Hz) plus a
per-second seizure annotation vector.  Training windows are 4 s with 1 s hop
inside seizures and 4 s hop elsewhere (cheap oversampling of ictal data).
Validation patients are held out entirely.

The full training set does not fit in host memory on one node, so each rank
memory-maps only its own share of the recordings.

    torchrun --nproc_per_node=8 10_chbmit_seizure_detector.py --index /data/chbmit/index.csv
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

FS = 256
WIN = 4 * FS


class RecordingWindows(Dataset):
    def __init__(self, rows, data_root, hop_ictal=1, hop_inter=4):
        self.recs, self.windows = [], []
        for r, row in enumerate(rows.itertuples()):
            sig = np.load(os.path.join(data_root, row.npy), mmap_mode="r")     # (18, n_samples)
            ann = np.load(os.path.join(data_root, row.ann))                    # (n_seconds,) 0/1
            mu = np.asarray(sig[:, : 60 * FS], dtype=np.float32).mean(1, keepdims=True)
            sd = np.asarray(sig[:, : 60 * FS], dtype=np.float32).std(1, keepdims=True) + 1e-6
            self.recs.append((sig, ann, mu, sd))
            n_sec = sig.shape[1] // FS
            t = 0
            while t + 4 <= n_sec:
                label = int(ann[t:t + 4].mean() >= 0.5)
                self.windows.append((r, t, label))
                t += hop_ictal if ann[t:t + 4].any() else hop_inter

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        r, t, label = self.windows[i]
        sig, _, mu, sd = self.recs[r]
        x = (np.asarray(sig[:, t * FS: t * FS + WIN], dtype=np.float32) - mu) / sd
        return torch.from_numpy(x), torch.tensor(label, dtype=torch.float32)

    def positives(self):
        return sum(w[2] for w in self.windows)


class ResBlock1d(nn.Module):
    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.c1 = nn.Conv1d(c_in, c_out, 7, stride, 3, bias=False)
        self.b1 = nn.BatchNorm1d(c_out)
        self.c2 = nn.Conv1d(c_out, c_out, 7, 1, 3, bias=False)
        self.b2 = nn.BatchNorm1d(c_out)
        self.skip = nn.Sequential(nn.Conv1d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm1d(c_out)) \
            if (stride != 1 or c_in != c_out) else nn.Identity()

    def forward(self, x):
        return F.relu(self.b2(self.c2(F.relu(self.b1(self.c1(x))))) + self.skip(x))


class SeizureNet(nn.Module):
    def __init__(self, n_ch=18, width=64):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv1d(n_ch, width, 15, 2, 7, bias=False), nn.BatchNorm1d(width), nn.ReLU())
        self.layers = nn.Sequential(
            ResBlock1d(width, width, 2), ResBlock1d(width, 2 * width, 2),
            ResBlock1d(2 * width, 2 * width, 2), ResBlock1d(2 * width, 4 * width, 2),
        )
        self.gru = nn.GRU(4 * width, 128, batch_first=True, bidirectional=True)
        self.out = nn.Linear(256, 1)

    def forward(self, x):
        h = self.layers(self.stem(x)).transpose(1, 2)
        h, _ = self.gru(h)
        return self.out(h.mean(1)).squeeze(1)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    ys, ps = [], []
    for x, y in loader:
        ps.append(torch.sigmoid(model(x.to(device, non_blocking=True))).float())
        ys.append(y.to(device))
    y, p = torch.cat(ys), torch.cat(ps)
    world = dist.get_world_size()
    y_all = [torch.empty_like(y) for _ in range(world)]
    p_all = [torch.empty_like(p) for _ in range(world)]
    dist.all_gather(y_all, y)
    dist.all_gather(p_all, p)
    # rank r holds samples r, r + world, ... of the padded index list: interleave and cut the padding
    n = len(loader.dataset)
    y = torch.stack(y_all, 1).flatten()[:n].cpu().numpy()
    p = torch.stack(p_all, 1).flatten()[:n].cpu().numpy()
    return roc_auc_score(y, p), average_precision_score(y, p)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--index", default="/data/chbmit/index.csv")
    ap.add_argument("--data_root", default="/data/chbmit/npy")
    ap.add_argument("--val_patients", nargs="+", default=["chb05", "chb13", "chb21"])
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--bs", type=int, default=128)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--out", default="ckpt/seizurenet")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(7)

    index = pd.read_csv(args.index).sort_values("npy").reset_index(drop=True)
    train_rows = index[~index.patient.isin(args.val_patients)]
    val_rows = index[index.patient.isin(args.val_patients)]

    my_rows = train_rows.iloc[rank::world]
    train_ds = RecordingWindows(my_rows, args.data_root)
    val_ds = RecordingWindows(val_rows, args.data_root, hop_ictal=4, hop_inter=4)
    train_dl = DataLoader(train_ds, batch_size=args.bs, shuffle=True, num_workers=6,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=256, sampler=DistributedSampler(val_ds, shuffle=False),
                        num_workers=4, pin_memory=True)

    pos = torch.tensor([train_ds.positives(), len(train_ds)], dtype=torch.float64, device=device)
    dist.all_reduce(pos)
    pos_weight = ((pos[1] - pos[0]) / pos[0]).float().clamp(max=50.0)
    print(f"[rank {rank}] {len(my_rows)} recordings, {len(train_ds)} windows", flush=True)

    model = SeizureNet().to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_ap = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for step, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.binary_cross_entropy_with_logits(logits.float(), y, pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
        sched.step()

        auroc, ap_score = validate(model, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} val AUROC {auroc:.4f} AP {ap_score:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if ap_score > best_ap:
                best_ap = ap_score
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "auroc": auroc, "ap": ap_score},
                           os.path.join(args.out, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
