"""
Unrolled MoDL-style reconstruction for 3D Cartesian knee MRI (mridata.org FSE, 8 coils),
with 2D variable-density random undersampling in (ky, kz).

The readout direction is fully sampled, so volumes are inverse-FFT'd along kx and each x-slice
is a 2D (ky, kz) multi-coil problem. Sensitivity maps (ESPIRiT) are precomputed in the .h5 files.

Unrolls have unshared weights (wide residual denoisers), ~190M parameters for K=10,
so the model is sharded with FSDP.

    torchrun --nproc_per_node=8 12_modl3d_fsdp_poisson.py --data /data/mridata_knee --unrolls 10
"""
import argparse
import os
from pathlib import Path

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import (FullOptimStateDictConfig, FullStateDictConfig, ShardingStrategy,
                                    StateDictType)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def fft2c(x):
    return torch.fft.fftshift(torch.fft.fft2(torch.fft.ifftshift(x, dim=(-2, -1)), norm="ortho"), dim=(-2, -1))


def ifft2c(x):
    return torch.fft.fftshift(torch.fft.ifft2(torch.fft.ifftshift(x, dim=(-2, -1)), norm="ortho"), dim=(-2, -1))


def vd_mask_2d(ny, nz, accel, calib, rng, power=2.0):
    """Variable-density random (ky, kz) pattern with a fully sampled calibration box
    (a cheap stand-in for the Poisson-disc masks of the original acquisitions)."""
    yy, zz = np.meshgrid(np.linspace(-1, 1, ny), np.linspace(-1, 1, nz), indexing="ij")
    pdf = (1 - np.clip(np.sqrt(yy ** 2 + zz ** 2) / np.sqrt(2), 0, 1)) ** power
    cy, cz = ny // 2, nz // 2
    mask = np.zeros((ny, nz), bool)
    mask[cy - calib // 2: cy + calib // 2, cz - calib // 2: cz + calib // 2] = True
    n_extra = max(int(ny * nz / accel) - int(mask.sum()), 0)
    p = np.where(mask, 0, pdf).ravel()
    idx = rng.choice(ny * nz, size=n_extra, replace=False, p=p / p.sum())
    mask.ravel()[idx] = True
    return mask.astype(np.float32)


class KneeXSlices(Dataset):
    def __init__(self, files, accel, calib=20, val=False):
        self.index = []
        for f in files:
            with h5py.File(f, "r") as hf:
                self.index += [(str(f), x) for x in range(hf["kspace_hybrid"].shape[0])]
        self.accel, self.calib, self.val = accel, calib, val

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        f, x = self.index[i]
        with h5py.File(f, "r") as hf:
            k = torch.from_numpy(hf["kspace_hybrid"][x])   # (coils, ky, kz) complex64
            s = torch.from_numpy(hf["maps"][x])            # (coils, ky, kz) complex64
        rng = np.random.default_rng(1000 + i) if self.val else np.random.default_rng()
        m = torch.from_numpy(vd_mask_2d(k.shape[1], k.shape[2], self.accel, self.calib, rng))
        target = (ifft2c(k) * s.conj()).sum(0)
        scale = target.abs().max()
        return k * m / scale, s, m, target / scale


class ResDenoiser(nn.Module):
    def __init__(self, ch=128, n_blocks=8):
        super().__init__()
        self.inp = nn.Conv2d(2, ch, 3, padding=1)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Conv2d(ch, ch, 3, padding=1), nn.ReLU(True),
                                                   nn.Conv2d(ch, ch, 3, padding=1)) for _ in range(n_blocks)])
        self.out = nn.Conv2d(ch, 2, 3, padding=1)

    def forward(self, x):
        h = self.inp(torch.view_as_real(x).permute(0, 3, 1, 2))
        for b in self.blocks:
            h = h + 0.1 * b(h)
        return torch.view_as_complex(self.out(h).permute(0, 2, 3, 1).contiguous())


class Unroll(nn.Module):
    def __init__(self, cg_iters=8):
        super().__init__()
        self.denoiser = ResDenoiser()
        self.log_lam = nn.Parameter(torch.tensor(-2.0))
        self.cg_iters = cg_iters

    def forward(self, x, atb, sens, mask):
        z = x + self.denoiser(x)
        lam = self.log_lam.exp()

        def AhA(v):
            k = fft2c(sens * v[:, None]) * mask[:, None]
            return (ifft2c(k) * sens.conj()).sum(1) + lam * v

        rhs = atb + lam * z
        sol, r = x.clone(), rhs - AhA(x)
        p, rs = r.clone(), (r.conj() * r).real.sum(dim=(-2, -1), keepdim=True)
        for _ in range(self.cg_iters):
            ap = AhA(p)
            alpha = rs / ((p.conj() * ap).real.sum(dim=(-2, -1), keepdim=True) + 1e-10)
            sol, r = sol + alpha * p, r - alpha * ap
            rs_new = (r.conj() * r).real.sum(dim=(-2, -1), keepdim=True)
            p, rs = r + rs_new / (rs + 1e-10) * p, rs_new
        return sol


class MoDL(nn.Module):
    def __init__(self, unrolls):
        super().__init__()
        self.unrolls = nn.ModuleList([Unroll() for _ in range(unrolls)])

    def forward(self, ksp, sens, mask):
        atb = (ifft2c(ksp) * sens.conj()).sum(1)
        x = atb
        for u in self.unrolls:
            x = u(x, atb, sens, mask)
        return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("ckpt/modl3d"))
    ap.add_argument("--unrolls", type=int, default=10)
    ap.add_argument("--accel", type=float, default=8.0)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--resume", type=Path, default=None)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    dev = torch.device("cuda", local_rank)

    files = sorted(args.data.glob("*.h5"))
    train_ds = KneeXSlices(files[:-3], args.accel)
    val_ds = KneeXSlices(files[-3:], args.accel, val=True)
    t_s = DistributedSampler(train_ds, shuffle=True)
    v_s = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    t_l = DataLoader(train_ds, args.bs, sampler=t_s, num_workers=8, pin_memory=True, drop_last=True)
    v_l = DataLoader(val_ds, args.bs, sampler=v_s, num_workers=8)

    model = FSDP(MoDL(args.unrolls), auto_wrap_policy=ModuleWrapPolicy({Unroll}),
                 sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=dev, use_orig_params=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    full_sd = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    full_osd = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)

    start = 0
    if args.resume is not None:
        # every rank reads the full checkpoint on CPU, FSDP keeps only its shard
        ckpt = torch.load(args.resume, map_location="cpu")
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=False),
                                  FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=False)):
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, ckpt["optim"]))
        start = ckpt["epoch"] + 1
        del ckpt

    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)

    for epoch in range(start, args.epochs):
        t_s.set_epoch(epoch)
        model.train()
        for it, (k, s, m, tgt) in enumerate(t_l):
            k, s, m, tgt = k.to(dev), s.to(dev), m.to(dev), tgt.to(dev)
            rec = model(k, s, m)
            loss = (rec - tgt).abs().mean() + 0.1 * ((rec - tgt).abs() ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            if rank == 0 and it % 50 == 0:
                print(f"epoch {epoch} it {it}/{len(t_l)} loss {loss.item():.5f}", flush=True)

        model.eval()
        acc = torch.zeros(2, device=dev)
        with torch.no_grad():
            for k, s, m, tgt in v_l:
                k, s, m, tgt = k.to(dev), s.to(dev), m.to(dev), tgt.to(dev)
                rec = model(k, s, m).abs()
                mse = ((rec - tgt.abs()) ** 2).flatten(1).mean(1)
                peak = tgt.abs().flatten(1).amax(1)
                acc += torch.stack([(10 * torch.log10(peak ** 2 / mse)).sum(), torch.tensor(float(len(mse)), device=dev)])
        dist.all_reduce(acc)

        # all ranks take part in gathering the full state; only rank 0 ends up with it
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, full_sd, full_osd):
            model_sd = model.state_dict()
            optim_sd = FSDP.optim_state_dict(model, opt)
        if rank == 0:
            print(f"epoch {epoch} val PSNR {(acc[0] / acc[1]).item():.2f} dB", flush=True)
            torch.save({"epoch": epoch, "model": model_sd, "optim": optim_sd}, args.out / f"modl_e{epoch:02d}.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
