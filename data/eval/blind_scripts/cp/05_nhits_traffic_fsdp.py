"""Wide N-HiTS on PeMS traffic (862 sensors), sharded with FSDP.

The widened MLP stacks (~2B params with --width 8192 --depth 4
--blocks_per_stack 3) do not fit next to Adam state on one card, so the
blocks are FSDP-wrapped.

    torchrun --nnodes=1 --nproc_per_node=8 05_nhits_traffic_fsdp.py \
        --width 8192 --depth 4 --blocks_per_stack 3
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
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--npy", default="/shared/data/traffic/traffic.npy", help="(T, N) float array")
    ap.add_argument("--ckpt_dir", default="/shared/ckpt/nhits_traffic")
    ap.add_argument("--input_size", type=int, default=720)
    ap.add_argument("--horizon", type=int, default=720)
    ap.add_argument("--pool", type=str, default="16,8,1")
    ap.add_argument("--freq_downsample", type=str, default="168,24,1")
    ap.add_argument("--blocks_per_stack", type=int, default=1)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--batch_size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--max_steps", type=int, default=20000)
    ap.add_argument("--eval_every", type=int, default=1000)
    ap.add_argument("--val_origins", type=int, default=4, help="rolling-origin folds")
    return ap.parse_args()


class SensorWindows(Dataset):
    def __init__(self, arr, L, H, t_start, t_end, stride=1):
        self.arr, self.L, self.H = arr, L, H
        self.t = np.arange(t_start, t_end - L - H + 1, stride)
        self.N = arr.shape[1]

    def __len__(self):
        return len(self.t) * self.N

    def __getitem__(self, i):
        t0 = self.t[i // self.N]
        n = i % self.N
        w = self.arr[t0:t0 + self.L + self.H, n]
        return torch.from_numpy(w[:self.L].copy()), torch.from_numpy(w[self.L:].copy())


class EvalShard(Dataset):
    """Equal-length shard per rank (FSDP needs the same number of forwards on every
    rank); the tail is filled with a dummy window that carries weight 0."""

    def __init__(self, ds, rank, world):
        self.ds = ds
        self.per = math.ceil(len(ds) / world)
        self.off = rank * self.per

    def __len__(self):
        return self.per

    def __getitem__(self, i):
        j = self.off + i
        if j < len(self.ds):
            x, y = self.ds[j]
            return x, y, torch.tensor(1.0)
        x, y = self.ds[0]
        return x, y, torch.tensor(0.0)


class NHiTSBlock(nn.Module):
    def __init__(self, L, H, pool, n_theta, width, depth):
        super().__init__()
        self.L, self.H = L, H
        self.pool = nn.MaxPool1d(pool, stride=pool, ceil_mode=True)
        d_in = math.ceil(L / pool)
        layers = [nn.Linear(d_in, width), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.mlp = nn.Sequential(*layers)
        self.n_theta = n_theta
        self.back = nn.Linear(width, L)
        self.fore = nn.Linear(width, n_theta)

    def forward(self, x):
        h = self.mlp(self.pool(x.unsqueeze(1)).squeeze(1))
        theta_f = self.fore(h).unsqueeze(1)
        fc = F.interpolate(theta_f, size=self.H, mode="linear", align_corners=False).squeeze(1)
        return self.back(h), fc


class NHiTS(nn.Module):
    def __init__(self, L, H, pools, freqs, blocks_per_stack, width, depth):
        super().__init__()
        blocks = []
        for p, f in zip(pools, freqs):
            for _ in range(blocks_per_stack):
                blocks.append(NHiTSBlock(L, H, p, max(1, H // f), width, depth))
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        level = x[:, -1:].clone()
        resid = x - level
        fc = 0
        for b in self.blocks:
            back, f = b(resid)
            resid = resid - back
            fc = fc + f
        return fc + level


@torch.no_grad()
def evaluate(model, loaders, device):
    model.eval()
    out = []
    for dl in loaders:
        acc = torch.zeros(3, device=device, dtype=torch.float64)
        for x, y, w in dl:
            x, y, w = x.to(device), y.to(device), w.to(device).unsqueeze(1)
            p = model(x).float()
            acc += torch.stack([(w * (p - y) ** 2).sum().double(), (w * (p - y).abs()).sum().double(),
                                (w.sum() * y.shape[1]).double()])
        dist.all_reduce(acc)
        out.append(((acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()))
    model.train()
    return out


def save_full(model, opt, step, path, rank):
    if rank == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        torch.save({"model": state, "step": step}, path)


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(17)

    arr = np.load(args.npy, mmap_mode="r")
    T = arr.shape[0]
    n_test = int(0.2 * T)
    n_val = int(0.1 * T)
    t_train = T - n_test - n_val
    mu = np.asarray(arr[:t_train].mean(0), np.float32)
    sd = np.asarray(arr[:t_train].std(0), np.float32) + 1e-5
    data = ((np.asarray(arr) - mu) / sd).astype(np.float32)

    L, H = args.input_size, args.horizon
    train_ds = SensorWindows(data, L, H, 0, t_train)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True, seed=17)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                          num_workers=8, pin_memory=True, drop_last=True)
    # rolling origins over the validation period, each fold one horizon further
    fold_len = max(1, n_val // args.val_origins)
    val_dls = []
    for k in range(args.val_origins):
        lo = t_train - L + k * fold_len
        ds = SensorWindows(data, L, H, lo, min(T - n_test, lo + L + H + fold_len), stride=H)
        val_dls.append(DataLoader(EvalShard(ds, rank, world), batch_size=512, num_workers=2))

    model = NHiTS(L, H, [int(v) for v in args.pool.split(",")],
                  [int(v) for v in args.freq_downsample.split(",")],
                  args.blocks_per_stack, args.width, args.depth)
    if rank == 0:
        print(f"params: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M")
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({NHiTSBlock}),
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                reduce_dtype=torch.float32,
                                                buffer_dtype=torch.float32),
                 device_id=local_rank, use_orig_params=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.max_steps)

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
    step, epoch, best = 0, 0, float("inf")
    t0 = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.l1_loss(model(x).float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"step {step} loss {loss.item():.4f} {(time.time() - t0) / 100:.3f}s/it", flush=True)
                t0 = time.time()
            if step % args.eval_every == 0:
                folds = evaluate(model, val_dls, device)
                val_mae = float(np.mean([f[1] for f in folds]))
                if rank == 0:
                    print("val folds (mse, mae):", [(round(a, 4), round(b, 4)) for a, b in folds])
                if val_mae < best:
                    best = val_mae
                    save_full(model, opt, step, os.path.join(args.ckpt_dir, "best.pt"), rank)
                dist.barrier()
            if step >= args.max_steps:
                break
        epoch += 1

    if rank == 0:
        print(f"done, best rolling-origin val MAE {best:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
