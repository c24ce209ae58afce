"""
Text-to-video DiT (spatial-temporal factorised attention) trained with PyTorch FSDP (FULL_SHARD, bf16).

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29400 \
        train_st_dit_fsdp.py --data /lustre/latents/panda70m_17x256 --out /lustre/ckpt/st_dit_xl
"""
import argparse
import copy
import functools
import glob
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import wandb


class STBlock(nn.Module):
    """Spatial attn -> temporal attn -> cross attn -> MLP, adaLN-zero modulated."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norms = nn.ModuleList([nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6) for _ in range(4)])
        self.s_qkv, self.s_out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.t_qkv, self.t_out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.x_q, self.x_kv, self.x_out = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.ada = nn.Linear(dim, 9 * dim)
        nn.init.zeros_(self.ada.weight)
        nn.init.zeros_(self.ada.bias)

    def _attn(self, q, k, v, mask=None):
        q, k, v = (rearrange(z, "b n (h d) -> b h n d", h=self.heads) for z in (q, k, v))
        return rearrange(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), "b h n d -> b n (h d)")

    def forward(self, x, c, ctx, ctx_mask, T):
        B, N, D = x.shape
        S = N // T
        m = self.ada(F.silu(c))[:, None].chunk(9, -1)
        h = self.norms[0](x) * (1 + m[0]) + m[1]
        h = rearrange(h, "b (t s) d -> (b t) s d", t=T)
        h = self._attn(*self.s_qkv(h).chunk(3, -1))
        x = x + m[2] * rearrange(self.s_out(h), "(b t) s d -> b (t s) d", b=B)
        h = self.norms[1](x) * (1 + m[3]) + m[4]
        h = rearrange(h, "b (t s) d -> (b s) t d", t=T)
        h = self._attn(*self.t_qkv(h).chunk(3, -1))
        x = x + m[5] * rearrange(self.t_out(h), "(b s) t d -> b (t s) d", b=B, s=S)
        k, v = self.x_kv(ctx).chunk(2, -1)
        x = x + self.x_out(self._attn(self.x_q(self.norms[2](x)), k, v, ctx_mask[:, None, None]))
        x = x + m[8] * self.mlp(self.norms[3](x) * (1 + m[6]) + m[7])
        return x


class STDiT(nn.Module):
    def __init__(self, in_ch=4, dim=1152, depth=28, heads=16, text_dim=4096, patch=2, max_t=17, max_s=256):
        super().__init__()
        self.patch, self.in_ch = patch, in_ch
        self.x_emb = nn.Linear(in_ch * patch * patch, dim)
        self.pos_s = nn.Parameter(torch.randn(1, 1, max_s, dim) * 0.02)
        self.pos_t = nn.Parameter(torch.randn(1, max_t, 1, dim) * 0.02)
        self.t_emb = nn.Sequential(nn.Linear(256, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.y_emb = nn.Sequential(nn.Linear(text_dim, dim), nn.GELU(approximate="tanh"), nn.Linear(dim, dim))
        self.y_null = nn.Parameter(torch.randn(1, 1, text_dim) / text_dim ** 0.5)
        self.blocks = nn.ModuleList([STBlock(dim, heads) for _ in range(depth)])
        self.final = nn.Sequential(nn.LayerNorm(dim, elementwise_affine=False), nn.Linear(dim, in_ch * patch * patch))
        nn.init.zeros_(self.final[1].weight)
        nn.init.zeros_(self.final[1].bias)

    def forward(self, x, t, y, y_mask, drop_mask=None):
        B, C, T, H, W = x.shape
        p = self.patch
        h = rearrange(x, "b c t (h p) (w q) -> b t (h w) (c p q)", p=p, q=p)
        h = (self.x_emb(h) + self.pos_s[:, :, : h.shape[2]] + self.pos_t[:, :T]).flatten(1, 2)
        if drop_mask is not None:  # per-sample caption dropout, CFG
            y = torch.where(drop_mask[:, None, None], self.y_null.to(y.dtype).expand_as(y), y)
            y_mask = y_mask | drop_mask[:, None]
        freqs = torch.exp(-math.log(10000) * torch.arange(128, device=x.device) / 128)
        c = self.t_emb(torch.cat([torch.cos(t[:, None] * freqs), torch.sin(t[:, None] * freqs)], -1).to(h.dtype))
        ctx = self.y_emb(y)
        for blk in self.blocks:
            h = blk(h, c, ctx, y_mask, T)
        h = self.final(h)
        return rearrange(h, "b (t h w) (c p q) -> b c t (h p) (w q)", t=T, h=H // p, w=W // p, p=p, q=p)


class LatentTextDataset(Dataset):
    def __init__(self, root):
        self.files = sorted(glob.glob(f"{root}/*.pt"))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = torch.load(self.files[i], map_location="cpu")
        return d["latent"], d["t5"], d["t5_mask"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--micro_bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--ema_decay", type=float, default=0.9999)
    ap.add_argument("--cfg_drop", type=float, default=0.1)
    ap.add_argument("--save_every", type=int, default=2000)
    ap.add_argument("--init_from", default=None)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    torch.manual_seed(1234)

    model = STDiT()
    if args.init_from:
        model.load_state_dict(torch.load(args.init_from, map_location="cpu"), strict=False)
    ema = copy.deepcopy(model).requires_grad_(False)

    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={STBlock})
    fsdp_kw = dict(auto_wrap_policy=wrap, sharding_strategy=ShardingStrategy.FULL_SHARD,
                   device_id=torch.cuda.current_device(), sync_module_states=True, limit_all_gathers=True)
    model = FSDP(model, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                       buffer_dtype=torch.float32), **fsdp_kw)
    # EMA is wrapped the same way, so its flat-param shards line up with the model's
    ema = FSDP(ema, **fsdp_kw)
    torch.manual_seed(1234 + rank)  # different noise / timesteps per rank from here on

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.999))
    ds = LatentTextDataset(args.data)
    sampler = DistributedSampler(ds, shuffle=True, seed=42, drop_last=True)
    dl = DataLoader(ds, batch_size=args.micro_bs, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)
    alphas = torch.cos(torch.linspace(0, 1, 1001, device="cuda") * math.pi / 2) ** 2  # cosine schedule

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project="st-dit", config=vars(args))
        print(f"params: {sum(p.numel() for p in model.parameters()) * world / 1e9:.2f}B (sharded x{world})")

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x0, y, y_mask in dl:
            x0, y, y_mask = x0.cuda(non_blocking=True), y.cuda(non_blocking=True), y_mask.cuda(non_blocking=True)
            B = x0.shape[0]
            t = torch.randint(1, 1001, (B,), device="cuda")
            a = alphas[t].view(B, 1, 1, 1, 1)
            noise = torch.randn_like(x0)
            xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
            v_target = a.sqrt() * noise - (1 - a).sqrt() * x0
            drop = torch.rand(B, device="cuda") < args.cfg_drop
            pred = model(xt, t.float() / 1000, y, y_mask.bool(), drop_mask=drop)
            loss = F.mse_loss(pred.float(), v_target)
            loss.backward()
            gnorm = model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                for pe, pm in zip(ema.parameters(), model.parameters()):
                    pe.mul_(args.ema_decay).add_(pm.detach(), alpha=1 - args.ema_decay)
            step += 1

            if step % 20 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l)
                if rank == 0:
                    wandb.log({"loss": l.item() / world, "grad_norm": gnorm.item(), "epoch": epoch,
                               "sec_per_step": (time.time() - t0) / 20}, step=step)
                t0 = time.time()

            if step % args.save_every == 0:
                if rank == 0:
                    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
                    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
                        model_sd = model.state_dict()
                    with FSDP.state_dict_type(ema, StateDictType.FULL_STATE_DICT, cfg):
                        ema_sd = ema.state_dict()
                    torch.save({"model": model_sd, "ema": ema_sd, "step": step, "epoch": epoch},
                               os.path.join(args.out, f"step_{step:08d}.pt"))
                    print(f"saved step {step}")
                dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
