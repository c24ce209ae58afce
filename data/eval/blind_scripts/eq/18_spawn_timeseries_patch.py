"""
Patch-transformer forecaster trained on a large collection of univariate series stored
in parquet shards (columns: series_id, values: list<float32>).

Single node, started with plain python; one process per visible GPU via mp.spawn:

    python 18_spawn_timeseries_patch.py --train_dir /data/ts/train --val_dir /data/ts/val
"""
import argparse
import glob
import os
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_dir", required=True)
    ap.add_argument("--val_dir", required=True)
    ap.add_argument("--ckpt", default="./ckpt/patch_forecaster.pt")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--horizon", type=int, default=96)
    ap.add_argument("--patch", type=int, default=16)
    ap.add_argument("--d_model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch_size", type=int, default=256, help="per GPU")
    ap.add_argument("--base_lr", type=float, default=2.5e-4, help="lr per 1024 windows of global batch")
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--eval_every", type=int, default=5_000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--port", default="29517")
    return ap.parse_args()


class WindowStream(IterableDataset):
    """Random (context, horizon) windows from this reader's share of the series files."""

    def __init__(self, files, rank, world, context, horizon, train, seed=0):
        self.files, self.rank, self.world = sorted(files), rank, world
        self.context, self.horizon, self.train, self.seed = context, horizon, train, seed

    def __iter__(self):
        info = get_worker_info()
        nw, wid = (info.num_workers, info.id) if info else (1, 0)
        reader = self.rank * nw + wid
        files = self.files[reader::self.world * nw]
        rng = np.random.default_rng([self.seed, reader])
        L = self.context + self.horizon
        while True:
            for f in (rng.permutation(files) if self.train else files):
                for vals in pq.read_table(f, columns=["values"]).column("values").to_pylist():
                    v = np.asarray(vals, dtype=np.float32)
                    if len(v) < L:
                        continue
                    starts = (rng.integers(0, len(v) - L + 1, size=4) if self.train
                              else [len(v) - L])
                    for s in starts:
                        w = v[s:s + L]
                        yield torch.from_numpy(w[:self.context].copy()), torch.from_numpy(w[self.context:].copy())
            if not self.train:
                return


class PatchForecaster(nn.Module):
    def __init__(self, context, horizon, patch, d, layers):
        super().__init__()
        self.patch = patch
        n = context // patch
        self.embed = nn.Linear(patch, d)
        self.pos = nn.Parameter(torch.zeros(1, n, d))
        enc = nn.TransformerEncoderLayer(d, 8, 4 * d, dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc, layers)
        self.head = nn.Linear(n * d, horizon)

    def forward(self, x):
        mu = x.mean(1, keepdim=True)
        sd = x.std(1, keepdim=True) + 1e-5
        z = (x - mu) / sd  # instance normalisation
        p = z.unfold(1, self.patch, self.patch)
        h = self.encoder(self.embed(p) + self.pos)
        y = self.head(h.flatten(1))
        return y * sd + mu


def run(rank, world_size, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = args.port
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(0)

    train_files = glob.glob(os.path.join(args.train_dir, "*.parquet"))
    val_files = glob.glob(os.path.join(args.val_dir, "*.parquet"))
    train_dl = DataLoader(WindowStream(train_files, rank, world_size, args.context, args.horizon, True),
                          batch_size=args.batch_size, num_workers=args.workers, pin_memory=True,
                          persistent_workers=True)

    model = PatchForecaster(args.context, args.horizon, args.patch, args.d_model, args.layers).to(device)
    lr = args.base_lr * args.batch_size * world_size / 1024
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=args.steps, pct_start=0.03)

    step = 0
    if os.path.exists(args.ckpt):
        # tensors were saved from cuda:0 by rank 0; remap them onto this rank's GPU
        ck = torch.load(args.ckpt, map_location={"cuda:0": f"cuda:{rank}"})
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        step = ck["step"]
    model = DDP(model, device_ids=[rank])

    it = iter(train_dl)
    model.train()
    t0 = time.time()
    while step < args.steps:
        x, y = (t.to(device, non_blocking=True) for t in next(it))
        loss = F.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        step += 1

        if step % 200 == 0:
            l = loss.detach()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"[{step}] train mse {l.item():.5f} ({(time.time() - t0) / 200 * 1e3:.0f} ms/step)",
                      flush=True)
                t0 = time.time()

        if step % args.eval_every == 0 or step == args.steps:
            model.eval()
            val_dl = DataLoader(WindowStream(val_files, rank, world_size, args.context, args.horizon, False),
                                batch_size=1024, num_workers=2)
            sums = torch.zeros(3, device=device)  # squared err, abs err, count
            with torch.no_grad():
                for vx, vy in val_dl:
                    vx, vy = vx.to(device), vy.to(device)
                    pred = model.module(vx)
                    sums += torch.stack([((pred - vy) ** 2).sum(), (pred - vy).abs().sum(),
                                         torch.tensor(float(vy.numel()), device=device)])
            # ranks hold different numbers of validation windows: reduce sums, not means
            dist.all_reduce(sums)
            model.train()
            if rank == 0:
                print(f"[{step}] val mse {(sums[0] / sums[2]).item():.5f} mae {(sums[1] / sums[2]).item():.5f}")
                os.makedirs(os.path.dirname(os.path.abspath(args.ckpt)), exist_ok=True)
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                            "sched": sched.state_dict(), "step": step}, args.ckpt)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args()
    n_gpus = torch.cuda.device_count()
    assert n_gpus >= 1, "needs at least one GPU"
    mp.spawn(run, args=(n_gpus, args), nprocs=n_gpus, join=True)
