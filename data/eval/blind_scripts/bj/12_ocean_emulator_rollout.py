"""Autoregressive global ocean emulator (5-daily means, 1 deg) with a ConvNeXt U-Net.

Training unrolls the model for `train_steps` steps inside one forward; validation runs
long rollouts from initial conditions spread over the validation period and scores
masked RMSE per lead time.  Micro-batches are accumulated to the global batch.

    torchrun --nnodes=$SLURM_NNODES --nproc_per_node=4 --rdzv_backend=c10d \
        --rdzv_endpoint=$MASTER_ADDR:29500 12_ocean_emulator_rollout.py --config cfg/ocean.yaml
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
import zarr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


class OceanWindows(Dataset):
    def __init__(self, store, t_range, n_steps, mean, std):
        root = zarr.open(store, mode="r")
        self.state, self.forcing = root["state"], root["forcing"]  # (T, C, 180, 360), (T, F, 180, 360)
        self.t0, self.t1 = t_range
        self.n = n_steps
        self.mean, self.std = mean, std

    def __len__(self):
        return self.t1 - self.t0 - self.n

    def __getitem__(self, i):
        t = self.t0 + i
        s = (self.state[t: t + self.n + 1] - self.mean["state"]) / self.std["state"]
        f = (self.forcing[t: t + self.n] - self.mean["forcing"]) / self.std["forcing"]
        s = np.nan_to_num(s.astype(np.float32))
        return torch.from_numpy(s[0]), torch.from_numpy(np.nan_to_num(f.astype(np.float32))), torch.from_numpy(s[1:])


class ConvNeXtBlock(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.dw = nn.Conv2d(ch, ch, 7, padding=3, groups=ch, padding_mode="circular")
        self.norm = nn.BatchNorm2d(ch)
        self.pw1 = nn.Conv2d(ch, 4 * ch, 1)
        self.pw2 = nn.Conv2d(4 * ch, ch, 1)

    def forward(self, x):
        return x + self.pw2(F.gelu(self.pw1(self.norm(self.dw(x)))))


class UNet(nn.Module):
    def __init__(self, c_state, c_forcing, widths=(128, 256, 512)):
        super().__init__()
        self.inp = nn.Conv2d(c_state + c_forcing, widths[0], 3, padding=1)
        self.enc = nn.ModuleList([nn.Sequential(ConvNeXtBlock(w), ConvNeXtBlock(w)) for w in widths])
        self.down = nn.ModuleList([nn.Conv2d(widths[i], widths[i + 1], 2, stride=2) for i in range(len(widths) - 1)])
        self.up = nn.ModuleList([nn.ConvTranspose2d(widths[i + 1], widths[i], 2, stride=2) for i in reversed(range(len(widths) - 1))])
        self.dec = nn.ModuleList([nn.Sequential(nn.Conv2d(2 * widths[i], widths[i], 1), ConvNeXtBlock(widths[i]))
                                  for i in reversed(range(len(widths) - 1))])
        self.out = nn.Conv2d(widths[0], c_state, 1)

    def step(self, state, forcing, mask):
        x = self.inp(torch.cat([state, forcing], 1))
        skips = []
        for i, blk in enumerate(self.enc):
            x = blk(x)
            if i < len(self.down):
                skips.append(x)
                x = self.down[i](x)
        for up, dec in zip(self.up, self.dec):
            x = dec(torch.cat([up(x), skips.pop()], 1))
        return (state + self.out(x)) * mask

    def forward(self, state, forcings, mask):
        """Unroll over forcings[:, k]; returns (B, K, C, H, W)."""
        outs = []
        for k in range(forcings.shape[1]):
            state = self.step(state, forcings[:, k], mask)
            outs.append(state)
        return torch.stack(outs, 1)

    @torch.no_grad()
    def rollout(self, state, forcings, mask):
        return self.forward(state, forcings, mask)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])

    st = np.load(cfg["stats"])  # precomputed from the training period, read-only
    mean = {"state": st["state_mean"][:, None, None], "forcing": st["forcing_mean"][:, None, None]}
    std = {"state": st["state_std"][:, None, None], "forcing": st["forcing_std"][:, None, None]}
    mask = torch.from_numpy(np.load(cfg["wet_mask"]).astype(np.float32)).to(device)[None]  # (1, C, H, W)
    area = torch.from_numpy(np.load(cfg["cell_area"]).astype(np.float32)).to(device)
    wts = mask * area / (mask * area).sum(dim=(-2, -1), keepdim=True)

    train_ds = OceanWindows(cfg["store"], cfg["train_t"], cfg["train_steps"], mean, std)
    val_ds = OceanWindows(cfg["store"], cfg["val_t"], cfg["val_steps"], mean, std)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    micro = cfg["micro_batch"]
    accum = cfg["global_batch"] // (micro * world)
    loader = DataLoader(train_ds, batch_size=micro, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    ics = list(range(0, len(val_ds), cfg["val_ic_stride"]))
    val_loader = DataLoader(Subset(val_ds, ics[rank::world]), batch_size=1, num_workers=2)

    c_state, c_forc = len(st["state_mean"]), len(st["forcing_mean"])
    model = UNet(c_state, c_forc).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    n_updates = cfg["epochs"] * (len(loader) // accum)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg["lr"], total_steps=n_updates, pct_start=0.05)

    ckpt_path = os.path.join(cfg["ckpt_dir"], "last.pt")
    start_epoch = 0
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch = ckpt["epoch"] + 1
    if rank == 0:
        os.makedirs(cfg["ckpt_dir"], exist_ok=True)

    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        n_full = (len(loader) // accum) * accum
        for i, (s0, forc, target) in enumerate(loader):
            if i >= n_full:
                break
            s0, forc, target = s0.to(device), forc.to(device), target.to(device)
            last_micro = (i + 1) % accum == 0
            if last_micro:
                pred = model(s0, forc, mask)
                loss = (wts[:, None] * (pred - target) ** 2).sum(dim=(-2, -1)).mean() / accum
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            else:
                with model.no_sync():
                    pred = model(s0, forc, mask)
                    loss = (wts[:, None] * (pred - target) ** 2).sum(dim=(-2, -1)).mean() / accum
                    loss.backward()
            if rank == 0 and i % (50 * accum) == 0:
                print(f"epoch {epoch} step {i // accum} loss {loss.item() * accum:.4f}", flush=True)

        # long rollouts on this rank's initial conditions; sums are reduced over ranks
        net = model.module
        net.eval()
        sq = torch.zeros(cfg["val_steps"], c_state, device=device)
        n_ic = torch.zeros((), device=device)
        std_t = torch.as_tensor(std["state"].reshape(-1), device=device, dtype=torch.float32)
        for s0, forc, target in val_loader:
            s0, forc, target = s0.to(device), forc.to(device), target.to(device)
            pred = net.rollout(s0, forc, mask)
            sq += (wts[:, None] * (pred - target) ** 2).sum(dim=(-2, -1)).sum(0)
            n_ic += s0.shape[0]
        dist.all_reduce(sq)
        dist.all_reduce(n_ic)
        rmse = torch.sqrt(sq / n_ic) * std_t  # (lead, channel) in physical units

        if rank == 0:
            for lead in (0, 3, 11, cfg["val_steps"] - 1):
                print(f"epoch {epoch} lead {5 * (lead + 1):4d} d  SST RMSE {rmse[lead, 0]:.3f} K  "
                      f"SSH RMSE {rmse[lead, cfg['zos_channel']]:.3f} m", flush=True)
            tmp = ckpt_path + ".tmp"
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "val_rmse": rmse.cpu()}, tmp)
            os.replace(tmp, ckpt_path)
            print(f"epoch {epoch} done in {time.time() - t0:.0f}s", flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
