"""Multi-physics pretraining of a transformer surrogate on PDEBench 2D data (MPP-style).

Several PDE families (compressible NS, shallow water, diffusion-reaction, incompressible
NS) are mixed; every sample is a short history of fields on a 128x128 grid, the model
predicts the next step. Fields of a family are padded to a common set of channels.
~700M parameters, sharded with FSDP.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
        17_fsdp_pde_foundation_pretrain.py --config configs/mpp_L.yaml
"""
import argparse
import functools
import glob
import math
import os
import random
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_CHANNELS = 6  # union: rho, vx, vy, pressure, h / u, v (unused channels zero)


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().config))
    cfg.setdefault("history", 4)
    cfg.setdefault("patch", 8)
    cfg.setdefault("dim", 1280)
    cfg.setdefault("depth", 32)
    cfg.setdefault("heads", 16)
    cfg.setdefault("batch_size", 4)
    cfg.setdefault("lr", 2e-4)
    cfg.setdefault("warmup_steps", 1000)
    cfg.setdefault("total_steps", 200000)
    cfg.setdefault("save_every", 2000)
    cfg.setdefault("out_dir", "/shared/mpp/runs/L")
    return argparse.Namespace(**cfg)


class PDEBenchFamily(Dataset):
    def __init__(self, path, fields, channel_slots, history):
        self.path, self.fields, self.slots, self.history = path, fields, channel_slots, history
        with h5py.File(path, "r") as f:
            n, t = f[fields[0]].shape[:2]
            arr = np.stack([f[k][: min(n, 64)].astype(np.float32) for k in fields])
        self.mean = arr.mean(axis=(1, 2, 3, 4))
        self.std = arr.std(axis=(1, 2, 3, 4)) + 1e-6
        self.n, self.t = n, t
        self.h5 = None

    def __len__(self):
        return self.n * (self.t - self.history)

    def __getitem__(self, idx):
        if self.h5 is None:
            self.h5 = h5py.File(self.path, "r")
        i, t = divmod(idx, self.t - self.history)
        out = np.zeros((self.history + 1, N_CHANNELS, 128, 128), dtype=np.float32)
        for k, (name, slot) in enumerate(zip(self.fields, self.slots)):
            out[:, slot] = (self.h5[name][i, t:t + self.history + 1] - self.mean[k]) / self.std[k]
        return torch.from_numpy(out[:-1]), torch.from_numpy(out[-1])


class TransformerBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        y = self.n1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.ff(self.n2(x))


class Surrogate(nn.Module):
    def __init__(self, history, patch, dim, depth, heads, grid=128):
        super().__init__()
        self.p, self.g = patch, grid // patch
        self.embed = nn.Conv2d(history * N_CHANNELS, dim, patch, patch)
        self.pos = nn.Parameter(torch.randn(1, self.g * self.g, dim) * 0.02)
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, N_CHANNELS * patch * patch)

    def forward(self, hist):
        B = hist.shape[0]
        x = self.embed(hist.flatten(1, 2)).flatten(2).transpose(1, 2) + self.pos
        for blk in self.blocks:
            x = blk(x)
        x = self.out(self.norm(x)).view(B, self.g, self.g, N_CHANNELS, self.p, self.p)
        delta = x.permute(0, 3, 1, 4, 2, 5).reshape(B, N_CHANNELS, self.g * self.p, self.g * self.p)
        return hist[:, -1] + delta


def build_datasets(cfg):
    fams = []
    for spec in cfg.families:  # [{glob:, fields:, slots:}, ...]
        for path in sorted(glob.glob(spec["glob"])):
            fams.append(PDEBenchFamily(path, spec["fields"], spec["slots"], cfg.history))
    return ConcatDataset(fams)


def lr_lambda(cfg):
    def f(step):
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        prog = min(1.0, (step - cfg.warmup_steps) / (cfg.total_steps - cfg.warmup_steps))
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * prog))
    return f


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    random.seed(0)

    dataset = build_datasets(cfg)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler, num_workers=6, pin_memory=True,
                        drop_last=True, persistent_workers=True)

    net = Surrogate(cfg.history, cfg.patch, cfg.dim, cfg.depth, cfg.heads)
    n_params = sum(p.numel() for p in net.parameters())
    model = FSDP(net,
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                    transformer_layer_cls={TransformerBlock}),
                 sharding_strategy=ShardingStrategy.FULL_SHARD,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.float32),
                 device_id=device, use_orig_params=True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "pos" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "pos" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        print(f"params {n_params / 1e6:.0f}M | samples {len(dataset)} | world {world}", flush=True)

    save_policy = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    step, epoch = 0, 0
    t0 = time.time()
    while step < cfg.total_steps:
        sampler.set_epoch(epoch)
        for hist, target in loader:
            hist = hist.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            model.train()
            pred = model(hist)
            active = (target.abs().sum(dim=(-1, -2), keepdim=True) > 0).float()  # skip padded channels
            loss = (((pred.float() - target) ** 2) * active).sum() / (active.sum() * 128 * 128).clamp(min=1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            step += 1

            if step % 50 == 0:
                red = loss.detach().clone()
                dist.all_reduce(red, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} | loss {red.item():.4e} | lr {scheduler.get_last_lr()[0]:.2e} "
                          f"| {(time.time() - t0) / 50:.2f} s/step", flush=True)
                t0 = time.time()

            if step % cfg.save_every == 0 or step == cfg.total_steps:
                if rank == 0:
                    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_policy):
                        cpu_state = model.state_dict()
                    torch.save({"model": cpu_state, "step": step, "config": vars(cfg)},
                               os.path.join(cfg.out_dir, f"model_step{step:07d}.pt"))
                dist.barrier()
            if step >= cfg.total_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
