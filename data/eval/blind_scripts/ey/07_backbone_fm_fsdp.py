"""Large non-equivariant transformer for CA-backbone flow matching (Proteina-style), sharded with FSDP.

Random global rotations are used as augmentation instead of an equivariant architecture.

    torchrun --nnodes=1 --nproc_per_node=8 07_backbone_fm_fsdp.py --train data/afdb_ca_train.pt \
        --ckpt /mnt/shared/ckpt/backbone_fm_fsdp/full.pt
"""
import argparse
import functools
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import (FullOptimStateDictConfig, FullStateDictConfig, MixedPrecision,
                                    ShardingStrategy, StateDictType)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class CASet(Dataset):
    def __init__(self, path, crop=384):
        self.chains = torch.load(path)  # list of [L, 3] float tensors, Angstrom
        self.crop = crop

    def __len__(self):
        return len(self.chains)

    def __getitem__(self, i):
        ca = self.chains[i]
        L = ca.shape[0]
        if L > self.crop:
            s = torch.randint(0, L - self.crop + 1, (1,)).item()
            ca, L = ca[s:s + self.crop], self.crop
        x = torch.zeros(self.crop, 3)
        m = torch.zeros(self.crop, dtype=torch.bool)
        x[:L] = (ca - ca.mean(0)) / 10.0
        m[:L] = True
        return x, m


def random_rotation(B, device):
    q = F.normalize(torch.randn(B, 4, device=device), dim=-1)
    w, x, y, z = q.unbind(-1)
    return torch.stack([
        1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w),
        2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w),
        2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)], -1).view(B, 3, 3)


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.ada = nn.Linear(d, 2 * d)

    def forward(self, h, c, pad):
        scale, shift = self.ada(c).unsqueeze(1).chunk(2, -1)
        y = self.ln1(h) * (1 + scale) + shift
        h = h + self.attn(y, y, y, key_padding_mask=pad, need_weights=False)[0]
        return h + self.mlp(self.ln2(h))


class CAFlowTransformer(nn.Module):
    def __init__(self, d=768, depth=16, heads=12, max_len=384):
        super().__init__()
        self.inp = nn.Linear(3, d)
        self.pos = nn.Parameter(torch.zeros(1, max_len, d))
        self.t_mlp = nn.Sequential(nn.Linear(64, d), nn.SiLU(), nn.Linear(d, d))
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(depth)])
        self.out = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 3))
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, x, t, m):
        half = torch.exp(-math.log(10000) * torch.arange(32, device=t.device) / 32)
        temb = torch.cat([(t[:, None] * 1000 * half).sin(), (t[:, None] * 1000 * half).cos()], -1)
        c = self.t_mlp(temb.to(x.dtype))
        h = self.inp(x) + self.pos[:, : x.shape[1]]
        for blk in self.blocks:
            h = blk(h, c, ~m)
        return self.out(h) * m[..., None]


def fm_loss(model, x1, m):
    B = x1.shape[0]
    x1 = torch.einsum("bij,blj->bli", random_rotation(B, x1.device), x1) * m[..., None]
    x0 = torch.randn_like(x1) * m[..., None]
    t = torch.rand(B, device=x1.device)
    xt = (1 - t[:, None, None]) * x0 + t[:, None, None] * x1
    v = model(xt, t, m).float()
    return (((v - (x1 - x0)) ** 2).sum(-1) * m).sum() / m.sum()


@torch.no_grad()
def euler_sample(model, m, steps):
    x = torch.randn(*m.shape, 3, device=m.device) * m[..., None]
    for i in range(steps):
        t = torch.full((m.shape[0],), i / steps, device=m.device)
        x = x + model(x, t, m).float() / steps
    return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--bs", type=int, default=12)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=5000)
    ap.add_argument("--sample_every", type=int, default=5)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1000)

    ds = CASet(args.train)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)

    model = CAFlowTransformer()
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.float32),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.cuda.current_device(),
        sync_module_states=True,
        use_orig_params=True,
    )
    # identical init above; per-rank streams for noise / timesteps from here on
    torch.manual_seed(1000 + rank)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))

    full_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    optim_cfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)

    start_epoch = 0
    if os.path.exists(args.ckpt):
        ck = torch.load(args.ckpt, map_location="cpu")
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(rank0_only=False),
                                  FullOptimStateDictConfig(rank0_only=False)):
            model.load_state_dict(ck["model"])
            opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, ck["optim"]))
        sched.load_state_dict(ck["sched"])
        start_epoch = ck["epoch"] + 1
        del ck

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        stats = torch.zeros(2, device="cuda")
        for x, m in dl:
            x, m = x.cuda(non_blocking=True), m.cuda(non_blocking=True)
            loss = fm_loss(model, x, m)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            stats += torch.stack([loss.detach(), torch.ones((), device="cuda")])
        dist.all_reduce(stats)
        if rank == 0:
            print(f"epoch {epoch} loss {(stats[0] / stats[1]).item():.4f} {time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % args.sample_every == 0:
            model.eval()
            # same shapes and step count on every rank: FSDP all-gathers inside each forward
            L = torch.tensor([64, 96, 128, 192], device="cuda")
            m = torch.arange(ds.crop, device="cuda")[None] < L[:, None]
            xs = euler_sample(model, m, steps=200) * 10.0
            bond = (xs[:, 1:] - xs[:, :-1]).norm(dim=-1)
            bm = (m[:, 1:] & m[:, :-1]).float()
            geo = torch.stack([((bond - 3.8).abs() * bm).sum(), bm.sum()])
            dist.all_reduce(geo)
            if rank == 0:
                print(f"epoch {epoch} sampled CA-CA |d-3.8| = {(geo[0] / geo[1]).item():.3f} A", flush=True)

        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, full_cfg, optim_cfg):
            msd = model.state_dict()
            osd = FSDP.optim_state_dict(model, opt)
        if rank == 0:
            os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
            torch.save({"model": msd, "optim": osd, "sched": sched.state_dict(), "epoch": epoch},
                       args.ckpt + ".tmp")
            os.replace(args.ckpt + ".tmp", args.ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
