"""FourCastNet-style AFNO forecaster on 0.25deg ERA5 (721x1440 cropped to 720x1440).

Pre-training: one-step 6h prediction. Fine-tuning (--rollout 2): two-step autoregressive loss.

    torchrun --nproc_per_node=8 03_afno_era5_forecast.py --config configs/afno_backbone.yaml
"""
import argparse
import glob
import logging
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class ERA5(Dataset):
    """Yearly h5 files, dataset 'fields' with shape (T, C, 721, 1440). Sample = (x_t, x_{t+dt}, ..)."""

    def __init__(self, root, channels, rollout, dt=1, stats=None):
        self.files = sorted(glob.glob(os.path.join(root, "*.h5")))
        self.channels = channels
        self.rollout, self.dt = rollout, dt
        with h5py.File(self.files[0], "r") as f:
            self.n_per_year = f["fields"].shape[0]
        self.n_valid = self.n_per_year - dt * rollout
        self.mean = np.load(stats["mean"])[:, channels]  # (1, C, 1, 1)
        self.std = np.load(stats["std"])[:, channels]
        self._h = {}

    def __len__(self):
        return len(self.files) * self.n_valid

    def _file(self, y):
        if y not in self._h:  # opened lazily inside each worker
            self._h[y] = h5py.File(self.files[y], "r")["fields"]
        return self._h[y]

    def __getitem__(self, idx):
        y, t = divmod(idx, self.n_valid)
        f = self._file(y)
        steps = [f[t + k * self.dt, self.channels, :720] for k in range(self.rollout + 1)]
        arr = (np.stack(steps) - self.mean) / self.std
        return torch.from_numpy(arr.astype(np.float32))


class AFNO2D(nn.Module):
    def __init__(self, dim, num_blocks=8, sparsity=0.01, hard_thresh=1.0):
        super().__init__()
        self.nb, self.bs = num_blocks, dim // num_blocks
        self.sparsity, self.hard_thresh = sparsity, hard_thresh
        s = 0.02
        self.w1 = nn.Parameter(s * torch.randn(2, num_blocks, self.bs, self.bs))
        self.b1 = nn.Parameter(s * torch.randn(2, num_blocks, self.bs))
        self.w2 = nn.Parameter(s * torch.randn(2, num_blocks, self.bs, self.bs))
        self.b2 = nn.Parameter(s * torch.randn(2, num_blocks, self.bs))

    def forward(self, x):
        bias = x
        dtype = x.dtype
        x = x.float()
        B, H, W, C = x.shape
        x = torch.fft.rfft2(x, dim=(1, 2), norm="ortho").reshape(B, H, W // 2 + 1, self.nb, self.bs)
        kept = int((W // 2 + 1) * self.hard_thresh)
        o1r = F.relu(torch.einsum("...bi,bio->...bo", x.real, self.w1[0]) - torch.einsum("...bi,bio->...bo", x.imag, self.w1[1]) + self.b1[0])
        o1i = F.relu(torch.einsum("...bi,bio->...bo", x.imag, self.w1[0]) + torch.einsum("...bi,bio->...bo", x.real, self.w1[1]) + self.b1[1])
        o2r = torch.einsum("...bi,bio->...bo", o1r, self.w2[0]) - torch.einsum("...bi,bio->...bo", o1i, self.w2[1]) + self.b2[0]
        o2i = torch.einsum("...bi,bio->...bo", o1i, self.w2[0]) + torch.einsum("...bi,bio->...bo", o1r, self.w2[1]) + self.b2[1]
        x = torch.view_as_complex(F.softshrink(torch.stack([o2r, o2i], -1), lambd=self.sparsity).contiguous())
        x = x.reshape(B, H, W // 2 + 1, C)
        x[:, :, kept:] = 0
        x = torch.fft.irfft2(x, s=(H, W), dim=(1, 2), norm="ortho")
        return x.to(dtype) + bias


class Block(nn.Module):
    def __init__(self, dim, mlp_ratio=4.0, num_blocks=8):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.filter = AFNO2D(dim, num_blocks)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(), nn.Linear(int(dim * mlp_ratio), dim))

    def forward(self, x):
        x = x + self.filter(self.n1(x))
        return x + self.mlp(self.n2(x))


class AFNONet(nn.Module):
    def __init__(self, img_size=(720, 1440), patch=8, in_ch=20, out_ch=20, dim=768, depth=12, num_blocks=8):
        super().__init__()
        self.patch, self.out_ch = patch, out_ch
        self.h, self.w = img_size[0] // patch, img_size[1] // patch
        self.embed = nn.Conv2d(in_ch, dim, patch, patch)
        self.pos = nn.Parameter(torch.zeros(1, self.h, self.w, dim))
        nn.init.trunc_normal_(self.pos, std=0.02)
        self.blocks = nn.ModuleList([Block(dim, num_blocks=num_blocks) for _ in range(depth)])
        self.head = nn.Linear(dim, out_ch * patch * patch, bias=False)

    def forward(self, x):
        B = x.shape[0]
        x = self.embed(x).permute(0, 2, 3, 1) + self.pos
        for blk in self.blocks:
            x = blk(x)
        x = self.head(x).reshape(B, self.h, self.w, self.patch, self.patch, self.out_ch)
        return x.permute(0, 5, 1, 3, 2, 4).reshape(B, self.out_ch, self.h * self.patch, self.w * self.patch)


def lat_weights(n_lat=720):
    lat = torch.linspace(90, -90, 721)[:n_lat]
    w = torch.cos(torch.deg2rad(lat))
    return (w / w.mean()).view(1, 1, -1, 1)


def weighted_rmse_channels(pred, target, w):
    # (B, C) area-weighted RMSE per sample and channel
    return torch.sqrt(((pred - target) ** 2 * w).mean(dim=(-1, -2)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-dir", default="exp/afno")
    ap.add_argument("--rollout", type=int, default=1)
    ap.add_argument("--pretrained", default=None)
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="%(asctime)s %(message)s")
    log = logging.getLogger(__name__)
    dev = torch.device("cuda", local_rank)

    chans = cfg["channels"]
    stats = {"mean": cfg["global_means"], "std": cfg["global_stds"]}
    train_ds = ERA5(cfg["train_dir"], chans, args.rollout, stats=stats)
    val_ds = ERA5(cfg["valid_dir"], chans, 1, stats=stats)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    bs = cfg["batch_size"] // world
    train_dl = DataLoader(train_ds, bs, sampler=train_sampler, num_workers=cfg.get("num_workers", 8),
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, bs, sampler=val_sampler, num_workers=4, pin_memory=True)

    model = AFNONet(in_ch=len(chans), out_ch=len(chans), dim=cfg["embed_dim"], depth=cfg["depth"]).to(dev)
    if args.pretrained:
        sd = torch.load(args.pretrained, map_location="cpu")["model"]
        model.load_state_dict(sd)
    ddp = DistributedDataParallel(model, device_ids=[local_rank], gradient_as_bucket_view=True)

    opt = torch.optim.AdamW(ddp.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg["max_epochs"])
    scaler = torch.cuda.amp.GradScaler()
    w = lat_weights().to(dev)

    os.makedirs(args.run_dir, exist_ok=True)
    ckpt_path = os.path.join(args.run_dir, "ckpt.tar")
    start_epoch, best = 0, float("inf")
    if os.path.isfile(ckpt_path):
        ck = torch.load(ckpt_path, map_location=dev)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]
        log.info("resumed at epoch %d", start_epoch)

    for epoch in range(start_epoch, cfg["max_epochs"]):
        train_sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.time()
        for it, seq in enumerate(train_dl):
            seq = seq.to(dev, non_blocking=True)  # (B, R+1, C, H, W)
            x = seq[:, 0]
            with torch.autocast("cuda", dtype=torch.float16):
                loss = 0.0
                for k in range(1, args.rollout + 1):
                    x = ddp(x)
                    loss = loss + F.mse_loss(x.float(), seq[:, k])
                loss = loss / args.rollout
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if it % 100 == 0:
                log.info("ep %d it %d/%d loss %.5f", epoch, it, len(train_dl), loss.item())
        sched.step()

        # validation: area-weighted RMSE per channel (normalised units)
        ddp.eval()
        rmse_sum = torch.zeros(len(chans), device=dev)
        n = 0
        with torch.no_grad():
            for seq in val_dl:
                seq = seq.to(dev, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.float16):
                    pred = model(seq[:, 0])
                rmse_sum += weighted_rmse_channels(pred.float(), seq[:, 1], w).sum(0)
                n += seq.shape[0]
        val_rmse = rmse_sum / n
        score = val_rmse.mean().item()

        if rank == 0:
            names = cfg.get("channel_names", [str(c) for c in chans])
            msg = " ".join(f"{nm}={v:.4f}" for nm, v in zip(names, val_rmse.tolist()))
            log.info("epoch %d done in %.0fs | val wRMSE %.4f | %s", epoch, time.time() - t0, score, msg)
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                     "scaler": scaler.state_dict(), "epoch": epoch, "best": min(best, score)}
            torch.save(state, ckpt_path)
            if score < best:
                torch.save(state, os.path.join(args.run_dir, "best_ckpt.tar"))
        best = min(best, score)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
