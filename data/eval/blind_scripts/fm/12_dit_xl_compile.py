"""DiT-XL/2 class-conditional fine-tuning at 512px (latent 64x64), FSDP + torch.compile.

Starts from the 256px checkpoint (pos-embeds re-interpolated) and keeps an EMA of
the local parameter shards.

    torchrun --nproc_per_node=8 12_dit_xl_compile.py --latents /data/in1k_512_latents --init DiT-XL-2-256x256.pt
"""
import argparse
import functools
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from timm.models.vision_transformer import Attention, Mlp, PatchEmbed
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden, freq=256):
        super().__init__()
        self.freq = freq
        self.mlp = nn.Sequential(nn.Linear(freq, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t):
        half = self.freq // 2
        f = torch.exp(-math.log(10000) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        a = t[:, None].float() * f[None]
        return self.mlp(torch.cat([torch.cos(a), torch.sin(a)], dim=-1))


class DiTBlock(nn.Module):
    def __init__(self, hidden, heads, mlp_ratio=4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden, num_heads=heads, qkv_bias=True)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden, int(hidden * mlp_ratio), act_layer=lambda: nn.GELU(approximate="tanh"))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))

    def forward(self, x, c):
        s1, sc1, g1, s2, sc2, g2 = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + g1.unsqueeze(1) * self.attn(modulate(self.norm1(x), s1, sc1))
        x = x + g2.unsqueeze(1) * self.mlp(modulate(self.norm2(x), s2, sc2))
        return x


class DiT(nn.Module):
    def __init__(self, input_size=64, patch=2, in_ch=4, hidden=1152, depth=28, heads=16, num_classes=1000):
        super().__init__()
        self.in_ch, self.patch = in_ch, patch
        self.x_embedder = PatchEmbed(input_size, patch, in_ch, hidden)
        self.t_embedder = TimestepEmbedder(hidden)
        self.y_embedder = nn.Embedding(num_classes + 1, hidden)
        n = self.x_embedder.num_patches
        self.register_buffer("pos_embed", torch.zeros(1, n, hidden))  # fixed sin-cos, loaded from ckpt
        self.blocks = nn.ModuleList([DiTBlock(hidden, heads) for _ in range(depth)])
        self.final_norm = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.final_mod = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))
        self.final_linear = nn.Linear(hidden, patch * patch * in_ch * 2)

    def unpatchify(self, x):
        c, p = self.in_ch * 2, self.patch
        h = w = int(x.shape[1] ** 0.5)
        x = x.reshape(x.shape[0], h, w, p, p, c)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(x.shape[0], c, h * p, w * p)

    def forward(self, x, t, y):
        x = self.x_embedder(x) + self.pos_embed
        c = self.t_embedder(t) + self.y_embedder(y)
        for blk in self.blocks:
            x = blk(x, c)
        shift, scale = self.final_mod(c).chunk(2, dim=1)
        return self.unpatchify(self.final_linear(modulate(self.final_norm(x), shift, scale)))


def load_256_checkpoint(model, path):
    sd = torch.load(path, map_location="cpu")
    pos = sd.pop("pos_embed")  # 1 x 256 x D  ->  1 x 1024 x D
    d = pos.shape[-1]
    g0 = int(pos.shape[1] ** 0.5)
    g1 = int(model.pos_embed.shape[1] ** 0.5)
    pos = pos.reshape(1, g0, g0, d).permute(0, 3, 1, 2)
    pos = F.interpolate(pos, size=(g1, g1), mode="bicubic", align_corners=False)
    sd["pos_embed"] = pos.permute(0, 2, 3, 1).reshape(1, g1 * g1, d)
    sd["final_mod.1.weight"] = sd.pop("final_layer.adaLN_modulation.1.weight")
    sd["final_mod.1.bias"] = sd.pop("final_layer.adaLN_modulation.1.bias")
    sd["final_linear.weight"] = sd.pop("final_layer.linear.weight")
    sd["final_linear.bias"] = sd.pop("final_layer.linear.bias")
    sd["y_embedder.weight"] = sd.pop("y_embedder.embedding_table.weight")
    missing, unexpected = model.load_state_dict(sd, strict=False)
    return missing, unexpected


@torch.no_grad()
def full_state_dict(fsdp_model, swap_in=None):
    """Consolidated state dict on rank 0; with swap_in, of those shards instead of the live ones."""
    backup = None
    if swap_in is not None:
        backup = [p.detach().clone() for p in fsdp_model.parameters()]
        for p, s in zip(fsdp_model.parameters(), swap_in):
            p.copy_(s)
    with FSDP.state_dict_type(fsdp_model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        sd = fsdp_model.state_dict()
    if backup is not None:
        for p, b in zip(fsdp_model.parameters(), backup):
            p.copy_(b)
    return sd


class NpyLatents(Dataset):
    def __init__(self, root):
        self.x = np.load(os.path.join(root, "latents.npy"), mmap_mode="r")
        self.y = np.load(os.path.join(root, "labels.npy"))

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return torch.from_numpy(np.ascontiguousarray(self.x[i])).float(), int(self.y[i])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--latents", required=True)
    ap.add_argument("--init", required=True)
    ap.add_argument("--out", default="results/dit-xl-512")
    ap.add_argument("--global-batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=200_000)
    ap.add_argument("--ema", type=float, default=0.9999)
    ap.add_argument("--ckpt-every", type=int, default=10_000)
    ap.add_argument("--log-every", type=int, default=100)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(rank)
    torch.backends.cuda.matmul.allow_tf32 = True

    model = DiT()
    missing, unexpected = load_256_checkpoint(model, args.init)
    if rank == 0:
        print(f"init: missing={missing} unexpected={unexpected}")

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={DiTBlock})
    model = FSDP(model, auto_wrap_policy=policy, device_id=device, sync_module_states=True,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.float32))
    # EMA of the local shards (same layout as the optimizer sees)
    ema_shards = [p.detach().clone().float() for p in model.parameters()]
    train_model = torch.compile(model)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    betas = torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64)
    alphas_cumprod = torch.cumprod(1 - betas, dim=0).float().to(device)

    ds = NpyLatents(args.latents)
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=args.global_batch_size // world, sampler=sampler,
                        num_workers=8, pin_memory=True, drop_last=True)

    step, epoch = 0, 0
    log_loss = torch.zeros((), device=device)
    t0 = time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            y = torch.where(torch.rand_like(y, dtype=torch.float) < 0.1, torch.full_like(y, 1000), y)
            t = torch.randint(0, 1000, (x.shape[0],), device=device)
            noise = torch.randn_like(x)
            ac = alphas_cumprod[t].view(-1, 1, 1, 1)
            xt = ac.sqrt() * x + (1 - ac).sqrt() * noise
            out = train_model(xt, t, y)
            loss = F.mse_loss(out[:, :4].float(), noise)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                for e, p in zip(ema_shards, model.parameters()):
                    e.lerp_(p.detach().float(), 1 - args.ema)
            step += 1
            log_loss += loss.detach()

            if step % args.log_every == 0:
                dist.all_reduce(log_loss)
                if rank == 0:
                    sps = args.log_every / (time.time() - t0)
                    print(f"step {step:07d} loss {log_loss.item() / (world * args.log_every):.4f} {sps:.2f} it/s",
                          flush=True)
                log_loss.zero_()
                t0 = time.time()

            if step % args.ckpt_every == 0:
                sd = full_state_dict(model)
                ema_sd = full_state_dict(model, swap_in=ema_shards)
                if rank == 0:
                    os.makedirs(args.out, exist_ok=True)
                    torch.save({"model": sd, "ema": ema_sd, "step": step},
                               os.path.join(args.out, f"{step:07d}.pt"))
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
