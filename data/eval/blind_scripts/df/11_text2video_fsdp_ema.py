"""Text-to-video latent diffusion transformer trained with FSDP (full shard), EMA kept as a second FSDP module.

Inputs are pre-computed VAE latents (T x 4 x 32 x 32, float16 .npy) and T5 caption embeddings (77 x 1024 .npy).
Clips are bucketed by length: each step picks one length for all ranks.

torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29400 \
    11_text2video_fsdp_ema.py --data /lustre/t2v/latents --out /lustre/t2v/runs/st_dit_l
"""
import argparse
import functools
import json
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl, apply_activation_checkpointing,
                                                                         checkpoint_wrapper)
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, MixedPrecision, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

BUCKETS = (8, 12, 16)


class LatentTextClips(Dataset):
    def __init__(self, root, max_frames=16):
        with open(os.path.join(root, "index.jsonl")) as f:
            self.items = [json.loads(l) for l in f]
        self.root, self.max_frames = root, max_frames

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        lat = np.load(os.path.join(self.root, it["latent"]), mmap_mode="r")
        start = np.random.randint(0, max(1, lat.shape[0] - self.max_frames + 1))
        x = torch.from_numpy(np.array(lat[start:start + self.max_frames], dtype=np.float32))
        if x.shape[0] < self.max_frames:  # short videos: hold the last frame
            x = torch.cat([x, x[-1:].repeat(self.max_frames - x.shape[0], 1, 1, 1)])
        txt = torch.from_numpy(np.load(os.path.join(self.root, it["text"])).astype(np.float32))
        return x.transpose(0, 1), txt  # C T H W, 77 x 1024


class Block(nn.Module):
    def __init__(self, dim, heads, ctx_dim):
        super().__init__()
        self.heads = heads
        self.n1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.o1 = nn.Linear(dim, dim)
        self.n2 = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(ctx_dim, 2 * dim)
        self.o2 = nn.Linear(dim, dim)
        self.n3 = nn.LayerNorm(dim, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.ada = nn.Linear(dim, 6 * dim)
        nn.init.zeros_(self.ada.weight)
        nn.init.zeros_(self.ada.bias)

    def _split(self, x):
        b, n, c = x.shape
        return x.view(b, n, self.heads, c // self.heads).transpose(1, 2)

    def forward(self, x, ctx, c):
        s1, g1, b1, s2, g2, b2 = self.ada(F.silu(c)).unsqueeze(1).chunk(6, -1)
        h = self.n1(x) * (1 + g1) + b1
        q, k, v = self.qkv(h).chunk(3, -1)
        a = F.scaled_dot_product_attention(self._split(q), self._split(k), self._split(v))
        x = x + s1 * self.o1(a.transpose(1, 2).flatten(2))
        k, v = self.kv(ctx).chunk(2, -1)
        a = F.scaled_dot_product_attention(self._split(self.q(self.n2(x))), self._split(k), self._split(v))
        x = x + self.o2(a.transpose(1, 2).flatten(2))
        return x + s2 * self.mlp(self.n3(x) * (1 + g2) + b2)


class SpaceTimeDiT(nn.Module):
    def __init__(self, dim=1024, depth=24, heads=16, ctx_dim=1024, patch=2, in_ch=4, max_frames=16, size=32):
        super().__init__()
        self.patch, self.in_ch = patch, in_ch
        self.g = size // patch
        self.embed = nn.Linear(in_ch * patch * patch, dim)
        self.pos = nn.Parameter(torch.randn(1, max_frames, self.g * self.g, dim) * 0.02)
        self.tmlp = nn.Sequential(nn.Linear(256, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList([Block(dim, heads, ctx_dim) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.head = nn.Linear(dim, in_ch * patch * patch)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, x, t, ctx):
        b, c, f, h, w = x.shape
        p, g = self.patch, self.g
        x = x.view(b, c, f, g, p, g, p).permute(0, 2, 3, 5, 1, 4, 6).reshape(b, f, g * g, c * p * p)
        x = (self.embed(x) + self.pos[:, :f]).flatten(1, 2)
        half = 128
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=x.device) / half)
        t = t.float()[:, None]  # integer timesteps, so the root FSDP input cast leaves them alone
        temb = torch.cat([torch.cos(t * freqs), torch.sin(t * freqs)], -1)
        cond = self.tmlp(temb.to(x.dtype))
        for blk in self.blocks:
            x = blk(x, ctx, cond)
        x = self.head(self.norm(x)).view(b, f, g, g, c, p, p)
        return x.permute(0, 4, 1, 2, 5, 3, 6).reshape(b, c, f, h, w)


def full_state(model):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        return model.state_dict()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--init", default="", help="image-pretrained weights (rank 0 loads, FSDP broadcasts)")
    ap.add_argument("--batch_per_gpu", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--steps", type=int, default=200000)
    ap.add_argument("--ema", type=float, default=0.9999)
    ap.add_argument("--text_drop", type=float, default=0.1)
    ap.add_argument("--save_every", type=int, default=5000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    net = SpaceTimeDiT()
    if args.init and rank == 0:
        missing, unexpected = net.load_state_dict(torch.load(args.init, map_location="cpu"), strict=False)
        print(f"init from {args.init}: {len(missing)} missing (temporal pos), {len(unexpected)} unexpected")
    ema_net = SpaceTimeDiT()
    ema_net.load_state_dict(net.state_dict())
    ema_net.requires_grad_(False)

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
    model = FSDP(net, auto_wrap_policy=policy, mixed_precision=mp, device_id=local_rank, sync_module_states=True,
                 limit_all_gathers=True)
    ema = FSDP(ema_net, auto_wrap_policy=policy, device_id=local_rank, sync_module_states=True)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, Block))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)

    step = 0
    last = os.path.join(args.out, "last.pt")
    if os.path.exists(last):
        ck = torch.load(last, map_location="cpu")
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(),
                                  FullOptimStateDictConfig()):
            model.load_state_dict(ck["model"])
            opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, ck["opt"]))
        with FSDP.state_dict_type(ema, StateDictType.FULL_STATE_DICT, FullStateDictConfig()):
            ema.load_state_dict(ck["ema"])
        step = ck["step"]
        del ck

    ds = LatentTextClips(args.data)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_per_gpu, sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True, persistent_workers=True)
    bucket_rng = np.random.default_rng(1234 + step)  # same stream on every rank
    alphas = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64), 0).float().to(device)
    torch.manual_seed(step + 7919 * rank)

    epoch = step // len(loader)
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x0, txt in loader:
            f = int(bucket_rng.choice(BUCKETS))
            x0 = x0[:, :, :f].to(device, non_blocking=True) * 0.18215
            txt = txt.to(device, non_blocking=True)
            drop = torch.rand(txt.shape[0], device=device) < args.text_drop
            txt = torch.where(drop[:, None, None], torch.zeros_like(txt), txt)
            t = torch.randint(0, 1000, (x0.shape[0],), device=device)
            noise = torch.randn_like(x0)
            a = alphas[t].view(-1, 1, 1, 1, 1)
            pred = model(a.sqrt() * x0 + (1 - a).sqrt() * noise, t, txt)
            loss = F.mse_loss(pred.float(), noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            with torch.no_grad():
                for pe, pm in zip(ema.parameters(), model.parameters()):
                    pe.lerp_(pm, 1 - args.ema)
            step += 1

            if step % 50 == 0:
                stat = loss.detach().reshape(1)
                dist.all_reduce(stat, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} frames {f} loss {stat.item():.4f}", flush=True)

            if step % args.save_every == 0 or step == args.steps:
                model_sd = full_state(model)
                ema_sd = full_state(ema)
                with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(),
                                          FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)):
                    opt_sd = FSDP.optim_state_dict(model, opt)
                if rank == 0:
                    os.makedirs(args.out, exist_ok=True)
                    torch.save({"model": model_sd, "ema": ema_sd, "opt": opt_sd, "step": step}, last + ".tmp")
                    os.replace(last + ".tmp", last)
                    torch.save(ema_sd, os.path.join(args.out, f"ema_{step:07d}.pt"))
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
