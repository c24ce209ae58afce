# RSNA abdominal trauma - 2.5D slice stacks, timm encoder + GRU over slices
# volumes are stored as int16 npy; windowing + resize done with torch on the GPU (much faster
# than cv2 per slice)
#
# torchrun --nproc_per_node=8 13_ct25d_gpu_resize.py --fold 0
import os
import time
import argparse

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from sklearn.metrics import log_loss
import timm

TARGETS = ["liver_low", "liver_high", "spleen_low", "spleen_high", "kidney_low", "kidney_high"]
N_SLICES = 32
SIZE = 384
WINDOWS = [(40, 400), (80, 200), (600, 2800)]  # soft tissue, narrow, bone


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--vol_dir", default="/scratch/rsna_atd/vol_npy")
    p.add_argument("--csv", default="/scratch/rsna_atd/train_series_folds.csv")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--backbone", default="tf_efficientnetv2_s.in21k_ft_in1k")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--bs", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--out", default="./atd_runs")
    return p.parse_args()


class VolumeDataset(Dataset):
    def __init__(self, df, vol_dir, device, train=True):
        self.series = df.series_id.values
        self.y = df[TARGETS].values.astype(np.float32)
        self.vol_dir = vol_dir
        self.device = device
        self.train = train

    def __len__(self):
        return len(self.series)

    def _window(self, v):
        chans = []
        for level, width in WINDOWS:
            lo, hi = level - width / 2, level + width / 2
            chans.append(((v.clamp(lo, hi) - lo) / (hi - lo)))
        return torch.stack(chans, 1)  # S,3,H,W

    def __getitem__(self, i):
        vol = np.load(os.path.join(self.vol_dir, f"{self.series[i]}.npy"))  # D,H,W int16
        v = torch.from_numpy(vol.astype(np.float32)).to(self.device)
        d = v.shape[0]
        if self.train:
            jitter = np.random.uniform(-0.5, 0.5) * d / N_SLICES
            pos = torch.linspace(0, d - 1, N_SLICES, device=self.device) + jitter
            pos = pos.clamp(0, d - 1).round().long()
        else:
            pos = torch.linspace(0, d - 1, N_SLICES, device=self.device).round().long()
        v = v[pos]
        v = F.interpolate(v[None], size=(SIZE, SIZE), mode="bilinear", align_corners=False)[0]
        x = self._window(v)
        if self.train and np.random.rand() < 0.5:
            x = x.flip(-1)
        return x, torch.from_numpy(self.y[i]), i


class SliceGRU(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.enc = timm.create_model(name, pretrained=True, num_classes=0, in_chans=3)
        nf = self.enc.num_features
        self.gru = nn.GRU(nf, 256, batch_first=True, bidirectional=True)
        self.head = nn.Linear(512, len(TARGETS))

    def forward(self, x):
        b, s = x.shape[:2]
        f = self.enc(x.flatten(0, 1)).view(b, s, -1)
        h, _ = self.gru(f)
        return self.head(h.mean(1))


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    df = pd.read_csv(args.csv)
    tr, va = df[df.fold != args.fold], df[df.fold == args.fold].reset_index(drop=True)
    ds_tr = VolumeDataset(tr, args.vol_dir, device, train=True)
    ds_va = VolumeDataset(va, args.vol_dir, device, train=False)
    s_tr = DistributedSampler(ds_tr, shuffle=True)
    s_va = DistributedSampler(ds_va, shuffle=False)
    dl_tr = DataLoader(ds_tr, batch_size=args.bs, sampler=s_tr, num_workers=args.workers,
                       drop_last=True, persistent_workers=True)
    dl_va = DataLoader(ds_va, batch_size=args.bs, sampler=s_va, num_workers=args.workers)

    model = SliceGRU(args.backbone).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(dl_tr))
    scaler = torch.cuda.amp.GradScaler()
    pos_w = torch.tensor([1, 2, 1, 2, 1, 2], dtype=torch.float32, device=device)
    crit = nn.BCEWithLogitsLoss(pos_weight=pos_w)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 1e9
    for ep in range(args.epochs):
        s_tr.set_epoch(ep)
        model.train()
        t0 = time.time()
        for x, y, _ in dl_tr:
            x, y = x.to(device), y.to(device)
            with torch.cuda.amp.autocast():
                loss = crit(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 3.0)
            scaler.step(opt)
            scaler.update()
            sched.step()

        model.eval()
        P, I = [], []
        with torch.no_grad():
            for x, _, i in dl_va:
                with torch.cuda.amp.autocast():
                    P.append(model(x.to(device)).sigmoid().float().cpu().numpy())
                I.append(i.numpy())
        res = [None] * world
        dist.all_gather_object(res, (np.concatenate(P), np.concatenate(I)))
        if rank == 0:
            P = np.concatenate([r[0] for r in res])
            I = np.concatenate([r[1] for r in res])
            I, k = np.unique(I, return_index=True)
            P = P[k]
            Y = ds_va.y[I]
            ll = np.mean([log_loss(Y[:, c], P[:, c], labels=[0, 1]) for c in range(len(TARGETS))])
            print(f"ep {ep} val logloss {ll:.4f} ({time.time() - t0:.0f}s)", flush=True)
            with open(f"{args.out}/log_f{args.fold}.tsv", "a") as fh:
                fh.write(f"{ep}\t{ll:.5f}\n")
            if ll < best:
                best = ll
                torch.save(model.module.state_dict(), f"{args.out}/slicegru_f{args.fold}.pth")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
