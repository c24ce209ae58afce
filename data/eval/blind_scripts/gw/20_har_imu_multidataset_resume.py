"""Human activity recognition across IMU datasets with different sensor layouts.

UCI-HAR, PAMAP2, WISDM and MotionSense are windowed into .npz files beforehand.
Every dataset gets its own input stem (channel counts differ) and its own
classifier; the temporal transformer in between is shared. Each step uses one
batch from every dataset. Jobs are preemptible, so the script resumes from the
newest checkpoint in the run directory.

    torchrun --nproc_per_node=4 har_mtl.py --data /data/har_npz --run_dir runs/har_mtl
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

DATASETS = {
    # name: (channels, classes)
    "ucihar": (9, 6),
    "pamap2": (27, 12),
    "wisdm": (3, 6),
    "motionsense": (12, 6),
}


def load_npz(path):
    z = np.load(path)
    x = torch.from_numpy(z["x"].astype(np.float32))  # N x T x C
    y = torch.from_numpy(z["y"].astype(np.int64))
    x = (x - x.mean((0, 1), keepdim=True)) / (x.std((0, 1), keepdim=True) + 1e-6)
    return TensorDataset(x, y)


class Stem(nn.Module):
    def __init__(self, c_in, d):
        super().__init__()
        self.net = nn.Sequential(nn.Conv1d(c_in, d, 7, padding=3), nn.GroupNorm(8, d), nn.GELU(),
                                 nn.Conv1d(d, d, 5, stride=2, padding=2), nn.GroupNorm(8, d), nn.GELU())

    def forward(self, x):
        return self.net(x.transpose(1, 2)).transpose(1, 2)


class HARMultiTask(nn.Module):
    def __init__(self, d=256, layers=6, heads=8):
        super().__init__()
        self.stems = nn.ModuleDict({n: Stem(c, d) for n, (c, _) in DATASETS.items()})
        self.pos = nn.Parameter(torch.zeros(1, 512, d))
        enc = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.1, activation="gelu", batch_first=True,
                                         norm_first=True)
        self.encoder = nn.TransformerEncoder(enc, layers)
        self.norm = nn.LayerNorm(d)
        self.heads = nn.ModuleDict({n: nn.Linear(d, k) for n, (_, k) in DATASETS.items()})
        nn.init.trunc_normal_(self.pos, std=0.02)

    def encode(self, name, x):
        h = self.stems[name](x)
        h = self.encoder(h + self.pos[:, :h.size(1)])
        return self.norm(h).mean(1)

    def forward(self, batch):
        return {n: self.heads[n](self.encode(n, x)) for n, x in batch.items()}


def repeat(loader, sampler):
    ep = 0
    while True:
        sampler.set_epoch(ep)
        yield from loader
        ep += 1


@torch.no_grad()
def evaluate(net, val, device, rank, world):
    net.eval()
    out = {}
    for n, ds in val.items():
        preds, gold = [], []
        for x, y in DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=512):
            preds.append(net.heads[n](net.encode(n, x.to(device))).argmax(-1).cpu())
            gold.append(y)
        parts = [None] * world
        dist.all_gather_object(parts, (torch.cat(preds), torch.cat(gold)))
        p = torch.cat([a for a, _ in parts]).numpy()
        g = torch.cat([b for _, b in parts]).numpy()
        out[n] = f1_score(g, p, average="macro")
    net.train()
    return out


def latest_checkpoint(run_dir):
    if not os.path.isdir(run_dir):
        return None
    c = [f for f in os.listdir(run_dir) if f.startswith("step_") and f.endswith(".pt")]
    return os.path.join(run_dir, max(c, key=lambda f: int(f[5:-3]))) if c else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--run_dir", default="runs/har_mtl")
    ap.add_argument("--batch_size", type=int, default=128, help="per dataset per GPU")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--steps", type=int, default=30000)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--eval_every", type=int, default=1000)
    ap.add_argument("--save_every", type=int, default=1000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train = {n: load_npz(os.path.join(args.data, f"{n}_train.npz")) for n in DATASETS}
    val = {n: load_npz(os.path.join(args.data, f"{n}_test.npz")) for n in DATASETS}
    streams = {}
    for n, ds in train.items():
        s = DistributedSampler(ds, shuffle=True, drop_last=True)
        streams[n] = repeat(DataLoader(ds, batch_size=args.batch_size, sampler=s, num_workers=2, drop_last=True,
                                       pin_memory=True), s)

    net = HARMultiTask().to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup, 0.5 * (1 + math.cos(math.pi * s / args.steps))))

    start = 0
    ck_path = latest_checkpoint(args.run_dir)
    if ck_path is not None:
        ck = torch.load(ck_path, map_location="cpu")
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["step"]
        if rank == 0:
            print(f"resumed from {ck_path} (step {start})", flush=True)

    model = DDP(net, device_ids=[local_rank])
    model.train()
    t0 = time.time()
    meter = torch.zeros(len(DATASETS), device=device)
    for step in range(start + 1, args.steps + 1):
        xs, ys = {}, {}
        for n in DATASETS:
            x, y = next(streams[n])
            xs[n], ys[n] = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(xs)
        losses = torch.stack([F.cross_entropy(logits[n], ys[n], label_smoothing=0.05) for n in DATASETS])
        loss = losses.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        meter += losses.detach()

        if step % 200 == 0:
            dist.all_reduce(meter, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"step {step} " + " ".join(f"{n}={v / 200:.4f}" for n, v in zip(DATASETS, meter.tolist())) +
                      f" lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)
            meter.zero_()
        if step % args.eval_every == 0:
            f1 = evaluate(net, val, device, rank, world)
            if rank == 0:
                print(f"[eval step {step}] macro-F1 {f1} mean {np.mean(list(f1.values())):.4f}", flush=True)
        if step % args.save_every == 0:
            if rank == 0:
                os.makedirs(args.run_dir, exist_ok=True)
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                            "step": step}, os.path.join(args.run_dir, f"step_{step}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
