"""WeatherMixer: MLP-Mixer over lat-lon patches of 1.40625 deg ERA5 (128 x 256).

Single-node script that starts its own workers with torch.multiprocessing
(no torchrun on the workstation cluster):

    python 06_weathermixer_spawn.py --gpus 4 --data /srv/wx/wb_1p4_6h.zarr
"""
import argparse
import os
import socket
import time
from collections import OrderedDict

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import xarray as xr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

VARIABLES = ["z500", "t850", "t2m", "u10", "v10", "msl", "q700", "z250", "u250", "v250", "tcwv"]


class ZarrPairs(Dataset):
    """Opens the zarr store lazily so the dataset object pickles cheaply to spawned processes."""

    def __init__(self, path, start, end, stats_path, lead=1):
        self.path, self.start, self.end, self.lead = path, start, end, lead
        st = np.load(stats_path)
        self.mu = np.array([st[v][0] for v in VARIABLES], np.float32)[:, None, None]
        self.sd = np.array([st[v][1] for v in VARIABLES], np.float32)[:, None, None]
        with xr.open_zarr(path) as ds:
            self.n = ds.sel(time=slice(start, end)).sizes["time"] - lead
        self._arr = None

    def _open(self):
        if self._arr is None:
            ds = xr.open_zarr(self.path).sel(time=slice(self.start, self.end))
            self._arr = ds[VARIABLES].to_array("v").transpose("time", "v", "lat", "lon")
        return self._arr

    def __getstate__(self):
        d = dict(self.__dict__)
        d["_arr"] = None
        return d

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        a = self._open()
        xy = (a.isel(time=[i, i + self.lead]).values.astype(np.float32) - self.mu) / self.sd
        return torch.from_numpy(xy[0]), torch.from_numpy(xy[1])


class MixerBlock(nn.Module):
    def __init__(self, n_tokens, dim, tok_hidden, ch_hidden):
        super().__init__()
        self.n1 = nn.LayerNorm(dim)
        self.tok = nn.Sequential(nn.Linear(n_tokens, tok_hidden), nn.GELU(), nn.Linear(tok_hidden, n_tokens))
        self.n2 = nn.LayerNorm(dim)
        self.ch = nn.Sequential(nn.Linear(dim, ch_hidden), nn.GELU(), nn.Linear(ch_hidden, dim))

    def forward(self, x):
        x = x + self.tok(self.n1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.ch(self.n2(x))


class WeatherMixer(nn.Module):
    def __init__(self, ch, img=(128, 256), patch=8, dim=512, depth=12):
        super().__init__()
        self.p, self.ch = patch, ch
        self.gh, self.gw = img[0] // patch, img[1] // patch
        n_tok = self.gh * self.gw
        self.embed = nn.Conv2d(ch, dim, patch, patch)
        self.blocks = nn.Sequential(*[MixerBlock(n_tok, dim, 2 * n_tok, 4 * dim) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, ch * patch * patch)

    def forward(self, x):
        B = x.shape[0]
        h = self.blocks(self.embed(x).flatten(2).transpose(1, 2))
        h = self.head(self.norm(h)).view(B, self.gh, self.gw, self.p, self.p, self.ch)
        return x + h.permute(0, 5, 1, 3, 2, 4).reshape(B, self.ch, self.gh * self.p, self.gw * self.p)


def strip_prefix(state_dict, prefix="module."):
    """Older checkpoints of this project were saved from the DDP wrapper."""
    if not any(k.startswith(prefix) for k in state_dict):
        return state_dict
    return OrderedDict((k[len(prefix):] if k.startswith(prefix) else k, v) for k, v in state_dict.items())


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    train_ds = ZarrPairs(args.data, "1979", "2015", args.stats)
    val_ds = ZarrPairs(args.data, "2016", "2016", args.stats)
    val_ds = torch.utils.data.Subset(val_ds, list(range(rank, len(val_ds), world_size)))
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, num_workers=2, pin_memory=True)

    model = WeatherMixer(len(VARIABLES)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    start = 0
    if args.resume:
        ck = torch.load(args.resume, map_location=device)
        model.load_state_dict(strip_prefix(ck["model"]))
        if "opt" in ck:
            opt.load_state_dict(ck["opt"])
            sched.load_state_dict(ck["sched"])
            start = ck["epoch"] + 1
    model = DDP(model, device_ids=[rank], output_device=rank)

    lat = torch.linspace(-89.296875, 89.296875, 128, device=device)
    w = torch.cos(torch.deg2rad(lat))
    w = (w / w.mean()).view(1, 1, -1, 1)
    std = torch.as_tensor(val_ds.dataset.sd[:, 0, 0], device=device)

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(x)
            loss = (w * (pred.float() - y) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and it % 200 == 0:
                print(f"[{epoch}] {it}/{len(train_dl)} loss {loss.item():.4f}", flush=True)
        sched.step()

        model.eval()
        sums = torch.zeros(len(VARIABLES) + 1, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, y in val_dl:
                x, y = x.to(device), y.to(device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = model.module(x)
                sums[:-1] += (w * ((pred.float() - y) * std.view(1, -1, 1, 1)) ** 2).mean((-2, -1)).sum(0).double()
                sums[-1] += x.shape[0]
        dist.all_reduce(sums)
        rmse = (sums[:-1] / sums[-1]).sqrt()
        if rank == 0:
            print(f"epoch {epoch} {time.time() - t0:.0f}s " +
                  " ".join(f"{v}={r:.3f}" for v, r in zip(VARIABLES, rmse.tolist())), flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(args.out, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--data", default="/srv/wx/wb_1p4_6h.zarr")
    ap.add_argument("--stats", default="/srv/wx/wb_1p4_stats_1979_2015.npz")
    ap.add_argument("--out", default="/srv/wx/runs/weathermixer")
    ap.add_argument("--resume", default=None)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
