"""Wide 3D FNO for forced isotropic turbulence (64^3, 3 velocity components), sharded with FSDP.

With 16 modes per direction the spectral weights are ~0.5B parameters; with Adam
state and the activations of a 3-step rollout at 64^3 this does not fit next to a
DDP replica, so the model is sharded (FULL_SHARD, one FSDP unit per Fourier block).

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29500 \
        05_fno3d_isotropic_fsdp.py --data /lustre/turb/hit64.h5 --ckpt /lustre/$USER/fno3d_hit
"""
import argparse
import math
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--ckpt", required=True, help="directory on shared storage")
    p.add_argument("--modes", type=int, default=16)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--unroll", type=int, default=3, help="time steps in the rollout loss")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--n-val", type=int, default=30)
    return p.parse_args()


class HITWindows(Dataset):
    """(u_t, u_{t+1}, ..., u_{t+K}) windows from u[N, T, 3, X, Y, Z]."""

    def __init__(self, path, traj_ids, unroll):
        self.path, self.unroll = path, unroll
        with h5py.File(path, "r") as f:
            T = f["u"].shape[1]
        self.items = [(n, t) for n in traj_ids for t in range(T - unroll)]
        self._f = None

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        if self._f is None:
            self._f = h5py.File(self.path, "r")
        n, t = self.items[i]
        return torch.from_numpy(self._f["u"][n, t:t + self.unroll + 1].astype(np.float32))


class SpectralConv3d(nn.Module):
    def __init__(self, cin, cout, m):
        super().__init__()
        self.m = m
        scale = 1.0 / (cin * cout)
        # 4 corners of the (kx, ky) plane, kz is one-sided after rfft; stored as real pairs
        self.weight = nn.Parameter(scale * torch.randn(4, cin, cout, m, m, m, 2))

    def forward(self, x):
        b, c, X, Y, Z = x.shape
        m = self.m
        w = torch.view_as_complex(self.weight)
        xf = torch.fft.rfftn(x.float(), dim=(-3, -2, -1))
        out = torch.zeros(b, w.shape[2], X, Y, Z // 2 + 1, dtype=torch.cfloat, device=x.device)
        out[..., :m, :m, :m] = torch.einsum("bixyz,ioxyz->boxyz", xf[..., :m, :m, :m], w[0])
        out[..., -m:, :m, :m] = torch.einsum("bixyz,ioxyz->boxyz", xf[..., -m:, :m, :m], w[1])
        out[..., :m, -m:, :m] = torch.einsum("bixyz,ioxyz->boxyz", xf[..., :m, -m:, :m], w[2])
        out[..., -m:, -m:, :m] = torch.einsum("bixyz,ioxyz->boxyz", xf[..., -m:, -m:, :m], w[3])
        return torch.fft.irfftn(out, s=(X, Y, Z), dim=(-3, -2, -1))


class FNOBlock3d(nn.Module):
    def __init__(self, width, modes):
        super().__init__()
        self.spec = SpectralConv3d(width, width, modes)
        self.skip = nn.Conv3d(width, width, 1)
        self.mlp = nn.Sequential(nn.Conv3d(width, width, 1), nn.GELU(), nn.Conv3d(width, width, 1))

    def forward(self, x):
        return x + self.mlp(F.gelu(self.spec(x) + self.skip(x)))


class FNO3d(nn.Module):
    def __init__(self, width, modes, layers):
        super().__init__()
        self.lift = nn.Conv3d(3 + 3, width, 1)
        self.blocks = nn.ModuleList([FNOBlock3d(width, modes) for _ in range(layers)])
        self.proj = nn.Sequential(nn.Conv3d(width, 4 * width, 1), nn.GELU(), nn.Conv3d(4 * width, 3, 1))

    def forward(self, u):
        b, _, X, Y, Z = u.shape
        axes = [torch.linspace(0, 2 * math.pi, n + 1, device=u.device)[:-1] for n in (X, Y, Z)]
        grid = torch.stack(torch.meshgrid(*axes, indexing="ij")).unsqueeze(0).expand(b, -1, -1, -1, -1)
        h = self.lift(torch.cat([u, torch.sin(grid)], dim=1))
        for blk in self.blocks:
            h = blk(h)
        return u + self.proj(h)


def rel_l2(pred, target):
    b = pred.shape[0]
    return ((pred - target).reshape(b, -1).norm(dim=1) / target.reshape(b, -1).norm(dim=1)).mean()


def rollout_loss(model, window):
    u = window[:, 0]
    loss = 0.0
    for k in range(1, window.shape[1]):
        u = model(u)
        loss = loss + rel_l2(u, window[:, k])
    return loss / (window.shape[1] - 1)


def save(model, opt, sched, epoch, path, rank):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    ocfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg, ocfg):
        msd = model.state_dict()
        osd = FSDP.optim_state_dict(model, opt)
    if rank == 0:
        torch.save({"model": msd, "optim": osd, "sched": sched.state_dict(), "epoch": epoch}, path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.barrier()


@torch.no_grad()
def validate(model, ds, rank, world, device):
    # Every rank must run the same number of forwards (FSDP all-gathers parameters in
    # each one), so the index list is padded to a multiple of world and padded
    # entries get weight 0.
    n = len(ds)
    n_pad = math.ceil(n / world) * world
    tot = torch.zeros(2, device=device, dtype=torch.float64)
    for i in range(rank, n_pad, world):
        w = ds[i if i < n else 0].unsqueeze(0).to(device)
        weight = 1.0 if i < n else 0.0
        tot[0] += weight * rollout_loss(model, w).double()
        tot[1] += weight
    dist.all_reduce(tot)
    return (tot[0] / tot[1]).item()


def main():
    args = cli()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    with h5py.File(args.data, "r") as f:
        n_traj = f["u"].shape[0]
    train_ds = HITWindows(args.data, range(0, n_traj - args.n_val), args.unroll)
    val_ds = HITWindows(args.data, range(n_traj - args.n_val, n_traj), args.unroll)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                        pin_memory=True, persistent_workers=True)

    torch.manual_seed(0)
    net = FNO3d(args.width, args.modes, args.layers)
    ckpt_path = os.path.join(args.ckpt, "fno3d_full.pt")
    ckpt = None
    if os.path.exists(ckpt_path):
        # full (unsharded) state, loaded on CPU on every rank before wrapping
        ckpt = torch.load(ckpt_path, map_location="cpu")
        net.load_state_dict(ckpt["model"])

    model = FSDP(net, auto_wrap_policy=ModuleWrapPolicy({FNOBlock3d}),
                 sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=device, limit_all_gathers=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs, eta_min=1e-6)
    start_epoch = 0
    if ckpt is not None:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            osd = FSDP.optim_state_dict_to_load(model, opt, ckpt["optim"])
        opt.load_state_dict(osd)
        sched.load_state_dict(ckpt["sched"])
        start_epoch = ckpt["epoch"] + 1
        del ckpt
    if rank == 0:
        os.makedirs(args.ckpt, exist_ok=True)
        print(f"world={world}  train windows={len(train_ds)}  val windows={len(val_ds)}  start={start_epoch}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for window in loader:
            window = window.to(device, non_blocking=True)
            loss = rollout_loss(model, window)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(run)

        model.eval()
        val = validate(model, val_ds, rank, world, device)
        if rank == 0:
            print(f"[{epoch:3d}] {time.time() - t0:7.1f}s train {run[0].item() / run[1].item():.4f} "
                  f"val rollout rel-L2 {val:.4f}", flush=True)
        save(model, opt, sched, epoch, ckpt_path, rank)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
