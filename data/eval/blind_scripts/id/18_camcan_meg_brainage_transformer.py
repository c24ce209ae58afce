"""Brain-age prediction from resting-state MEG (Cam-CAN) with a sensor-patch transformer.

Every subject's 8-min eyes-closed recording (102 magnetometers, 1-45 Hz,
decimated to 100 Hz) is stored as rest/sub-XXXXXX.npy (102, n_samples).
Training samples are 10-s windows with 5-s hop; the subject-level prediction
is the mean over all of the subject's windows.  Metric: subject-level MAE.

Large windows x deep transformer -> activation checkpointing and gradient
accumulation.  Early stopping on validation MAE.

    torchrun --nproc_per_node=4 18_camcan_meg_brainage_transformer.py --cfg camcan.yaml
"""
import argparse
import contextlib
import math
import os
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

FS, WIN, HOP = 100, 1000, 500


class RestWindows(Dataset):
    def __init__(self, root, subjects, ages, subj_index):
        self.recs, self.items = {}, []
        for sid in subjects:
            x = np.load(Path(root) / f"{sid}.npy", mmap_mode="r")
            med = np.median(np.asarray(x[:, ::10]), axis=1, keepdims=True).astype(np.float32)
            scale = np.percentile(np.abs(np.asarray(x[:, ::10]) - med), 75, axis=1, keepdims=True).astype(np.float32)
            self.recs[sid] = (x, med, scale + 1e-12)
            for s in range(0, x.shape[1] - WIN + 1, HOP):
                self.items.append((sid, s, ages[sid], subj_index[sid]))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        sid, s, age, k = self.items[i]
        x, med, scale = self.recs[sid]
        w = (np.asarray(x[:, s:s + WIN], dtype=np.float32) - med) / scale
        return torch.from_numpy(np.clip(w, -20, 20)), torch.tensor(age, dtype=torch.float32), k


class Block(nn.Module):
    def __init__(self, dim, heads, mlp=4.0, drop=0.1):
        super().__init__()
        self.n1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=drop, batch_first=True)
        self.n2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp)), nn.GELU(), nn.Dropout(drop), nn.Linear(int(dim * mlp), dim))

    def forward(self, x):
        h = self.n1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.n2(x))


class MEGTransformer(nn.Module):
    def __init__(self, n_sensors=102, patch=50, dim=384, depth=10, heads=6, grad_ckpt=True):
        super().__init__()
        self.patch = patch
        self.grad_ckpt = grad_ckpt
        self.tok = nn.Linear(patch, dim)
        self.sensor_emb = nn.Parameter(torch.zeros(1, n_sensors, 1, dim))
        self.time_emb = nn.Parameter(torch.zeros(1, 1, WIN // patch, dim))
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 1)
        for p in (self.sensor_emb, self.time_emb, self.cls):
            nn.init.trunc_normal_(p, std=0.02)

    def forward(self, x):  # (B, S, T)
        B, S, T = x.shape
        t = self.tok(x.view(B, S, T // self.patch, self.patch)) + self.sensor_emb + self.time_emb
        t = torch.cat([self.cls.expand(B, -1, -1), t.flatten(1, 2)], 1)
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                t = checkpoint(blk, t, use_reentrant=False)
            else:
                t = blk(t)
        return self.head(self.norm(t[:, 0])).squeeze(1)


@torch.no_grad()
def subject_mae(model, loader, device, ages_by_index, n_subjects):
    """Average window predictions per subject; sums are all-reduced over fixed-size tensors."""
    model.eval()
    sums = torch.zeros(n_subjects, device=device, dtype=torch.float64)
    cnts = torch.zeros(n_subjects, device=device, dtype=torch.float64)
    for x, _, k in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(x.to(device, non_blocking=True)).double()
        k = k.to(device)
        sums.index_add_(0, k, pred)
        cnts.index_add_(0, k, torch.ones_like(pred))
    dist.all_reduce(sums)
    dist.all_reduce(cnts)
    has = cnts > 0
    pred_age = sums[has] / cnts[has]
    return (pred_age - ages_by_index[has]).abs().mean().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default="camcan.yaml")
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()
    cfg = yaml.safe_load(open(args.cfg))
    resume = args.resume

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    assert torch.cuda.is_bf16_supported(), "bf16 autocast needs Ampere or newer"
    torch.manual_seed(cfg["seed"])

    # the split file is fixed and versioned with the paper, identical on every rank
    part = pd.read_csv(cfg["participants"]).sort_values("participant_id").reset_index(drop=True)
    ages = dict(zip(part.participant_id, part.age.astype(float)))
    subj_index = {sid: k for k, sid in enumerate(part.participant_id)}
    ages_by_index = torch.tensor(part.age.to_numpy(), dtype=torch.float64, device=device)
    split = {s: part.participant_id[part.split == s].tolist() for s in ("train", "val", "test")}

    train_ds = RestWindows(cfg["root"], split["train"], ages, subj_index)
    val_ds = RestWindows(cfg["root"], split["val"], ages, subj_index)
    mean_age = float(np.mean([ages[s] for s in split["train"]]))

    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg["seed"], drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=cfg["micro_bs"], sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=64, num_workers=4)

    model = MEGTransformer(dim=cfg["dim"], depth=cfg["depth"], heads=cfg["heads"]).to(device)
    nn.init.constant_(model.head.bias, mean_age)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.05)
    accum = cfg["accum_steps"]
    steps_per_epoch = len(train_dl) // accum
    total = cfg["epochs"] * steps_per_epoch
    warm = cfg["warmup_epochs"] * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))

    out = Path(cfg["out_dir"])
    start_epoch, best, bad_epochs = 0, float("inf"), 0
    if resume:
        ck = torch.load(resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best, bad_epochs = ck["epoch"] + 1, ck["best"], ck["bad_epochs"]
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)

    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        opt.zero_grad(set_to_none=True)
        for i, (x, y, _) in enumerate(train_dl):
            if i >= steps_per_epoch * accum:
                break  # same number of micro-batches on every rank
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            last_micro = (i + 1) % accum == 0
            # gradients are all-reduced only on the last micro-batch of each accumulation window
            with (contextlib.nullcontext() if last_micro else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = F.l1_loss(model(x).float(), y) / accum
                loss.backward()
            if last_micro:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)

        val_mae = subject_mae(model.module, val_dl, device, ages_by_index, len(part))
        improved = val_mae < best
        best = min(best, val_mae)
        bad_epochs = 0 if improved else bad_epochs + 1
        if rank == 0:
            print(f"epoch {epoch}: val subject MAE {val_mae:.2f} y (best {best:.2f})", flush=True)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "best": best, "bad_epochs": bad_epochs, "cfg": cfg}
            torch.save(state, out / "last.pt.tmp")
            os.replace(out / "last.pt.tmp", out / "last.pt")
            if improved:
                torch.save(model.module.state_dict(), out / "best.pt")

        stop = torch.tensor([int(bad_epochs >= cfg["patience"])], device=device)
        dist.broadcast(stop, src=0)
        if stop.item():
            if rank == 0:
                print(f"early stopping after epoch {epoch}")
            break

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
