"""Long-clip (129 frames) latent video DiT with Ulysses sequence parallelism.

SP groups of --sp-size consecutive ranks share one clip; the token sequence
(T/4 * H/16 * W/16 latent patches) is sharded across the group.

    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:29500 \
        13_long_video_dit_sp.py --data /shared/latents/long_clips --sp-size 8 --exp-dir /shared/exp/ldit
"""
import argparse
import json
import logging
import math
import os
import time
from copy import deepcopy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

logger = logging.getLogger("ldit")


def a2a_single(x, group, to_heads):
    P = dist.get_world_size(group)
    if to_heads:  # [B, S/P, H, D] -> [B, S, H/P, D]
        B, s, H, D = x.shape
        x = x.view(B, s, P, H // P, D).permute(2, 0, 1, 3, 4).contiguous()
    else:  # [B, S, H/P, D] -> [B, S/P, H, D]
        B, S, h, D = x.shape
        x = x.view(B, P, S // P, h, D).permute(1, 0, 2, 3, 4).contiguous()
    y = torch.empty_like(x)
    dist.all_to_all_single(y, x, group=group)
    if to_heads:
        return y.permute(1, 0, 2, 3, 4).reshape(B, P * s, H // P, D)
    return y.permute(1, 2, 0, 3, 4).reshape(B, S // P, P * h, D)


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, to_heads):
        ctx.group, ctx.to_heads = group, to_heads
        return a2a_single(x, group, to_heads)

    @staticmethod
    def backward(ctx, g):
        return a2a_single(g.contiguous(), ctx.group, not ctx.to_heads), None, None


class Attention(nn.Module):
    def __init__(self, dim, heads, group):
        super().__init__()
        self.heads, self.group = heads, group
        self.qkv = nn.Linear(dim, 3 * dim)
        self.qn, self.kn = nn.RMSNorm(dim // heads), nn.RMSNorm(dim // heads)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, rope):
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, -1).unbind(2)
        q, k = self.qn(q), self.kn(k)
        cos, sin = rope
        q = q * cos + torch.stack([-q[..., 1::2], q[..., ::2]], -1).flatten(-2) * sin
        k = k * cos + torch.stack([-k[..., 1::2], k[..., ::2]], -1).flatten(-2) * sin
        q, k, v = (AllToAll.apply(t.to(v.dtype), self.group, True).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v)
        o = AllToAll.apply(o.transpose(1, 2).contiguous(), self.group, False)
        return self.out(o.reshape(B, N, C))


class Block(nn.Module):
    def __init__(self, dim, heads, group):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(dim, heads, group)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x, c, rope):
        s1, m1, g1, s2, m2, g2 = self.mod(c)[:, None].chunk(6, -1)
        x = x + g1 * self.attn(self.norm1(x) * (1 + m1) + s1, rope)
        return x + g2 * self.mlp(self.norm2(x) * (1 + m2) + s2)


class LongDiT(nn.Module):
    def __init__(self, cfg, group):
        super().__init__()
        d = cfg["hidden"]
        self.proj_in = nn.Linear(cfg["patch_dim"], d)
        self.t_embed = nn.Sequential(nn.Linear(256, d), nn.SiLU(), nn.Linear(d, d))
        self.txt = nn.Linear(cfg["text_dim"], d)
        self.blocks = nn.ModuleList(Block(d, cfg["heads"], group) for _ in range(cfg["depth"]))
        self.norm = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.proj_out = nn.Linear(d, cfg["patch_dim"])
        nn.init.zeros_(self.proj_out.weight)
        nn.init.zeros_(self.proj_out.bias)

    def forward(self, x, t, txt, rope):
        half = 128
        fr = torch.exp(-math.log(10000) * torch.arange(half, device=x.device) / half)
        c = self.t_embed(torch.cat([(t[:, None] * fr).cos(), (t[:, None] * fr).sin()], -1)) + self.txt(txt)
        h = self.proj_in(x)
        for b in self.blocks:
            h = b(h, c, rope)
        return self.proj_out(self.norm(h))


def rope_3d(T, H, W, head_dim, device):
    """Axial RoPE over (t, h, w); returns cos/sin of shape [T*H*W, head_dim] (interleaved pairs)."""
    dims = [head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8]
    grids = torch.meshgrid(torch.arange(T), torch.arange(H), torch.arange(W), indexing="ij")
    angs = []
    for d, g in zip(dims, grids):
        inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
        angs.append(g.reshape(-1, 1).float() * inv)
    ang = torch.cat(angs, -1).repeat_interleave(2, -1)
    return ang.cos().to(device), ang.sin().to(device)


class LatentClips(Dataset):
    def __init__(self, root):
        with open(os.path.join(root, "index.jsonl")) as f:
            self.items = [json.loads(l) for l in f]
        self.root = root

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        z = torch.load(os.path.join(self.root, it["latent"]), map_location="cpu")  # [N, patch_dim], patchified
        txt = torch.load(os.path.join(self.root, it["text"]), map_location="cpu")  # [text_dim]
        return z.float(), txt.float()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--exp-dir", required=True)
    ap.add_argument("--sp-size", type=int, default=8)
    ap.add_argument("--grid", type=int, nargs=3, default=[33, 30, 40])
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--depth", type=int, default=24)
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--max-steps", type=int, default=100000)
    ap.add_argument("--ema", type=float, default=0.9999)
    ap.add_argument("--seed", type=int, default=3407)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    sp = args.sp_size

    sp_group = None
    for start in range(0, world, sp):
        g = dist.new_group(list(range(start, start + sp)))
        if start <= rank < start + sp:
            sp_group, sp_leader = g, start
    sp_rank = rank - sp_leader

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="%(asctime)s %(message)s")
    cfg = dict(patch_dim=16 * 1 * 2 * 2, hidden=args.hidden, heads=args.heads, depth=args.depth, text_dim=4096)
    T, H, W = args.grid
    N = T * H * W
    assert N % sp == 0 and args.heads % sp == 0, (N, sp)
    n_loc = N // sp

    torch.manual_seed(args.seed)
    model = LongDiT(cfg, sp_group).cuda()
    ema = deepcopy(model).eval().requires_grad_(False)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)

    cos, sin = rope_3d(T, H, W, args.hidden // args.heads, "cuda")
    rope = (cos[sp_rank * n_loc:(sp_rank + 1) * n_loc][None, :, None], sin[sp_rank * n_loc:(sp_rank + 1) * n_loc][None, :, None])

    # every rank of an SP group has to load the same clip, so shuffle with a shared generator
    ds = LatentClips(args.data)
    loader = DataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=4, pin_memory=True,
                        drop_last=True, generator=torch.Generator().manual_seed(args.seed))
    torch.manual_seed(args.seed + rank)

    if rank == 0:
        os.makedirs(args.exp_dir, exist_ok=True)
        logger.info("params %.1fM, tokens %d (%d per rank), world %d, sp %d",
                    sum(p.numel() for p in model.parameters()) / 1e6, N, n_loc, world, sp)

    step = 0
    tic = time.time()
    while step < args.max_steps:
        for z, txt in loader:
            z = z[:, sp_rank * n_loc:(sp_rank + 1) * n_loc].cuda(non_blocking=True)
            txt = txt.cuda(non_blocking=True)
            # rectified flow: x_t = (1 - t) x0 + t eps, predict eps - x0
            t = torch.sigmoid(torch.randn(z.size(0), device="cuda"))
            dist.broadcast(t, src=sp_leader, group=sp_group)
            eps = torch.randn_like(z)
            xt = (1 - t[:, None, None]) * z + t[:, None, None] * eps
            with torch.autocast("cuda", dtype=torch.bfloat16):
                v = model(xt, t * 1000, txt, rope)
            loss = F.mse_loss(v.float(), eps - z)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            with torch.no_grad():
                for pe, pm in zip(ema.parameters(), model.module.parameters()):
                    pe.lerp_(pm, 1 - args.ema)
            step += 1

            if step % 50 == 0:
                lv = loss.detach()
                dist.all_reduce(lv, op=dist.ReduceOp.AVG)
                logger.info("step %d loss %.4f gnorm %.3f %.2fs/it", step, lv.item(), gnorm.item(), (time.time() - tic) / 50)
                tic = time.time()
            if step % 2000 == 0:
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "ema": ema.state_dict(),
                                "opt": opt.state_dict(), "step": step}, os.path.join(args.exp_dir, f"{step:07d}.pt"))
                dist.barrier()
            if step >= args.max_steps:
                break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
