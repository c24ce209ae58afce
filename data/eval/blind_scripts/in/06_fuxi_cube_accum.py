"""FuXi-style cube-embedding transformer, 0.25 deg ERA5, trained on a multi-step rollout
with gradient accumulation.

    torchrun --nnodes=1 --nproc_per_node=8 06_fuxi_cube_accum.py \
        --data /mnt/shared/era5_025_zarr --out /mnt/shared/runs/fuxi_small
"""
import argparse
import contextlib
import math
import os
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import zarr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


@dataclass
class Config:
    data: str = ""
    out: str = ""
    micro_batch: int = 1
    accum: int = 4
    lr: float = 2.5e-4          # for a global batch of 32 (micro_batch * accum * world)
    ref_batch: int = 32
    epochs: int = 30
    rollout: int = 3
    dim: int = 768
    depth: int = 16
    heads: int = 12
    workers: int = 6
    resume: bool = False


def get_config():
    ap = argparse.ArgumentParser()
    for k, v in asdict(Config()).items():
        if isinstance(v, bool):
            ap.add_argument(f"--{k.replace('_', '-')}", action="store_true")
        else:
            ap.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    return Config(**vars(ap.parse_args()))


class ZarrSeq(Dataset):
    """Returns (x_{t-1}, x_t) and the next `rollout` states."""

    def __init__(self, root, years, rollout):
        self.root, self.rollout = root, rollout
        g = zarr.open(root, mode="r")
        year = g["year"][:]
        self.idx = np.where(np.isin(year, years))[0]
        self.idx = self.idx[(self.idx >= 1) & (self.idx + rollout < len(year))]
        self.mean = g["mean"][:][:, None, None].astype(np.float32)
        self.std = g["std"][:][:, None, None].astype(np.float32)
        self.arr = None

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        if self.arr is None:
            self.arr = zarr.open(self.root, mode="r")["fields"]
        t = int(self.idx[i])
        x = (self.arr[t - 1:t + self.rollout + 1, :, :720] - self.mean) / self.std
        x = torch.from_numpy(x.astype(np.float32))
        return x[:2], x[2:]


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.heads = heads

    def forward(self, x):
        B, N, D = x.shape
        qkv = self.qkv(self.n1(x)).view(B, N, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        x = x + self.o(a.transpose(1, 2).reshape(B, N, D))
        return x + self.ff(self.n2(x))


class CubeFormer(nn.Module):
    def __init__(self, ch, dim, depth, heads, patch=(2, 8, 8), img=(720, 1440)):
        super().__init__()
        self.ch, self.ph, self.pw = ch, patch[1], patch[2]
        self.gh, self.gw = img[0] // patch[1], img[1] // patch[2]
        self.cube = nn.Conv3d(ch, dim, kernel_size=patch, stride=patch)
        self.pos = nn.Parameter(torch.zeros(1, self.gh * self.gw, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, ch * self.ph * self.pw)
        nn.init.trunc_normal_(self.pos, std=0.02)

    def forward(self, x2):
        # x2: (B, 2, C, H, W) -> next state (B, C, H, W)
        B, _, C, H, W = x2.shape
        h = self.cube(x2.transpose(1, 2)).flatten(2).transpose(1, 2) + self.pos
        for blk in self.blocks:
            if self.training:
                h = checkpoint(blk, h, use_reentrant=False)
            else:
                h = blk(h)
        h = self.head(self.norm(h)).view(B, self.gh, self.gw, C, self.ph, self.pw)
        return x2[:, -1] + h.permute(0, 3, 1, 4, 2, 5).reshape(B, C, H, W)


def lat_w(device, n=720):
    lat = torch.linspace(90, -90, 721, device=device)[:n]
    w = torch.cos(torch.deg2rad(lat))
    return (w / w.mean()).view(1, 1, n, 1)


def rollout(model, x2, steps):
    preds = []
    for _ in range(steps):
        nxt = model(x2)
        preds.append(nxt)
        x2 = torch.stack([x2[:, -1], nxt], dim=1)
    return torch.stack(preds, dim=1)


@torch.no_grad()
def validate(net, loader, w, std, steps, device):
    net.eval()
    se = torch.zeros(steps, std.shape[1], dtype=torch.float64, device=device)
    cnt = torch.zeros((), dtype=torch.float64, device=device)
    for x2, ys in loader:
        x2, ys = x2.to(device), ys.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            preds = rollout(net, x2, steps).float()
        rmse = ((((preds - ys) * std.unsqueeze(1)) ** 2) * w.unsqueeze(1)).mean(dim=(-2, -1)).sqrt()
        se += rmse.sum(0).double()
        cnt += x2.shape[0]
    dist.all_reduce(se)
    dist.all_reduce(cnt)
    net.train()
    return (se / cnt).cpu()


def main():
    cfg = get_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = ZarrSeq(cfg.data, list(range(1979, 2016)), cfg.rollout)
    val_all = ZarrSeq(cfg.data, [2017], cfg.rollout)
    val_ds = Subset(val_all, list(range(rank, len(val_all), world)))
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=cfg.micro_batch, sampler=sampler,
                          num_workers=cfg.workers, pin_memory=True, drop_last=True,
                          persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=cfg.micro_batch, num_workers=cfg.workers, pin_memory=True)
    std = torch.from_numpy(train_ds.std).to(device).unsqueeze(0)

    net = CubeFormer(std.shape[1], cfg.dim, cfg.depth, cfg.heads).to(device)
    model = DDP(net, device_ids=[local_rank])

    global_batch = cfg.micro_batch * cfg.accum * world
    lr = cfg.lr * global_batch / cfg.ref_batch
    opt = torch.optim.AdamW(net.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    updates_per_epoch = len(train_dl) // cfg.accum
    total = cfg.epochs * updates_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 2000) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))

    ckpt_path = os.path.join(cfg.out, "ckpt.pt")
    start_epoch = 0
    if cfg.resume and os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch = ckpt["epoch"] + 1

    tb = None
    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
        tb = SummaryWriter(os.path.join(cfg.out, "tb"))
    w = lat_w(device)
    if rank == 0:
        print(f"world {world} global batch {global_batch} lr {lr:.2e} updates/epoch {updates_per_epoch}")

    for epoch in range(start_epoch, cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros((), device=device)
        for i, (x2, ys) in enumerate(train_dl):
            if i >= updates_per_epoch * cfg.accum:
                break
            x2 = x2.to(device, non_blocking=True)
            ys = ys.to(device, non_blocking=True)
            last_micro = (i + 1) % cfg.accum == 0
            ctx = contextlib.nullcontext() if last_micro else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    preds = rollout(model, x2, cfg.rollout)
                loss = (((preds.float() - ys) ** 2) * w.unsqueeze(1)).mean()
                (loss / cfg.accum).backward()
            loss_acc += loss.detach() / cfg.accum
            if last_micro:
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                sched.step()
                gstep = epoch * updates_per_epoch + (i + 1) // cfg.accum
                if gstep % 25 == 0:
                    dist.all_reduce(loss_acc, op=dist.ReduceOp.AVG)
                    if tb is not None:
                        tb.add_scalar("train/loss", loss_acc.item(), gstep)
                        tb.add_scalar("train/lr", sched.get_last_lr()[0], gstep)
                loss_acc.zero_()

        rmse = validate(net, val_dl, w, std, cfg.rollout, device)
        if rank == 0:
            for k in range(cfg.rollout):
                for c in (11, 48, 65):  # z500, t850, t2m in our channel order
                    tb.add_scalar(f"val/rmse_ch{c}_{6 * (k + 1)}h", rmse[k, c].item(), epoch)
            print(f"epoch {epoch} {time.time() - t0:.0f}s z500@{6 * cfg.rollout}h={rmse[-1, 11]:.1f}", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "cfg": asdict(cfg)}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
