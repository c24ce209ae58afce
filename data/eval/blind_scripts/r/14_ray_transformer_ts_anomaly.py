"""Masked-reconstruction transformer for sensor anomaly detection (plant telemetry, 38 channels).

Trains on normal-operation windows only. Ray Train, 2 nodes x 4 GPUs:
    python 14_ray_transformer_ts_anomaly.py --num-workers 8 --data /shared/telemetry/normal.parquet
"""
import argparse
import math
import os
import tempfile

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

import ray
import ray.train
import ray.train.torch
from ray.train import Checkpoint, CheckpointConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer


class WindowSet(Dataset):
    def __init__(self, values, window, stride):
        self.v = torch.from_numpy(values.astype(np.float32))
        self.window, self.stride = window, stride
        self.n = (len(self.v) - window) // stride + 1

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        s = i * self.stride
        return self.v[s:s + self.window]


def load_series(path, val_frac=0.1):
    df = pd.read_parquet(path).sort_values("ts")
    vals = df.drop(columns=["ts"]).interpolate(limit_direction="both").to_numpy()
    cut = int(len(vals) * (1 - val_frac))
    mu, sd = vals[:cut].mean(0), vals[:cut].std(0) + 1e-6
    return (vals[:cut] - mu) / sd, (vals[cut:] - mu) / sd


class PosEnc(nn.Module):
    def __init__(self, d, max_len=4096):
        super().__init__()
        pe = torch.zeros(max_len, d)
        pos = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, x):
        return x + self.pe[: x.size(1)]


class MaskedTSTransformer(nn.Module):
    def __init__(self, n_ch, d=128, heads=8, layers=4, ff=256, dropout=0.1):
        super().__init__()
        self.inp = nn.Linear(n_ch, d)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = PosEnc(d)
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, layers)
        self.out = nn.Linear(d, n_ch)

    def forward(self, x, mask):
        h = self.inp(x)
        h = torch.where(mask.unsqueeze(-1), self.mask_token.expand_as(h), h)
        return self.out(self.enc(self.pos(h)))


def random_span_mask(b, t, ratio, span, device):
    m = torch.zeros(b, t, dtype=torch.bool, device=device)
    n_spans = max(1, int(t * ratio / span))
    starts = torch.randint(0, t - span, (b, n_spans), device=device)
    for k in range(span):
        m.scatter_(1, starts + k, True)
    return m


def train_loop_per_worker(cfg):
    device = ray.train.torch.get_device()
    rank = ray.train.get_context().get_world_rank()
    train_v, val_v = load_series(cfg["data"])

    train_loader = DataLoader(WindowSet(train_v, cfg["window"], cfg["stride"]), batch_size=cfg["batch_size"],
                              shuffle=True, num_workers=4, drop_last=True)
    val_loader = DataLoader(WindowSet(val_v, cfg["window"], cfg["window"]), batch_size=512, num_workers=2)
    train_loader = ray.train.torch.prepare_data_loader(train_loader)
    val_loader = ray.train.torch.prepare_data_loader(val_loader)

    model = ray.train.torch.prepare_model(MaskedTSTransformer(train_v.shape[1], d=cfg["d_model"]))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.05)
    steps = cfg["epochs"] * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 500) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))

    start = 0
    if ray.train.get_checkpoint():
        with ray.train.get_checkpoint().as_directory() as d:
            st = torch.load(os.path.join(d, "ckpt.pt"), map_location=device)
        (model.module if hasattr(model, "module") else model).load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        start = st["epoch"] + 1

    for epoch in range(start, cfg["epochs"]):
        model.train()
        tot = torch.zeros(2, device=device)
        for x in train_loader:
            m = random_span_mask(x.size(0), x.size(1), cfg["mask_ratio"], cfg["span"], device)
            rec = model(x, m)
            loss = ((rec - x) ** 2)[m].mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])

        model.eval()
        vtot = torch.zeros(2, device=device)
        errs = []
        with torch.no_grad():
            g = torch.Generator(device=device).manual_seed(1234)
            for x in val_loader:
                m = torch.rand(x.shape[:2], device=device, generator=g) < cfg["mask_ratio"]
                e = ((model(x, m) - x) ** 2)[m]
                vtot += torch.stack([e.sum(), torch.tensor(float(e.numel()), device=device)])
                errs.append(e.mean(-1) if e.dim() > 1 else e)
        if ray.train.get_context().get_world_size() > 1:
            torch.distributed.all_reduce(tot)
            torch.distributed.all_reduce(vtot)
        metrics = {"epoch": epoch, "train_mse": (tot[0] / tot[1]).item(), "val_mse": (vtot[0] / vtot[1]).item()}

        with tempfile.TemporaryDirectory() as tmp:
            ckpt = None
            if rank == 0:
                net = model.module if hasattr(model, "module") else model
                torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                            "epoch": epoch, "cfg": cfg}, os.path.join(tmp, "ckpt.pt"))
                ckpt = Checkpoint.from_directory(tmp)
            ray.train.report(metrics, checkpoint=ckpt)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/shared/telemetry/normal.parquet")
    ap.add_argument("--num-workers", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--stride", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=128)
    args = ap.parse_args()

    ray.init(address="auto")
    cfg = {"data": args.data, "epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr,
           "window": args.window, "stride": args.stride, "d_model": args.d_model,
           "mask_ratio": 0.15, "span": 8}
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=cfg,
        scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=True),
        run_config=RunConfig(name="ts_masked_ae", storage_path="/shared/ray_results",
                             checkpoint_config=CheckpointConfig(num_to_keep=3, checkpoint_score_attribute="val_mse",
                                                                checkpoint_score_order="min")),
    )
    result = trainer.fit()
    print("best:", result.get_best_checkpoint("val_mse", "min"))


if __name__ == "__main__":
    main()
