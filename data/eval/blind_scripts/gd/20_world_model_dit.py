"""Action-conditioned video world model (latent DiT) with Ulysses sequence parallelism.

Context frames are given clean, future frames are noised; the model sees all frames'
tokens at once, sharded over an SP group.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        20_world_model_dit.py --data /shared/robot_latents --sp 4 --ckpt-dir /shared/ckpt/wm
"""
import argparse
import glob
import math
import os
import time
from copy import deepcopy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def all_to_all_4d(x, group, scatter_dim, gather_dim):
    world = dist.get_world_size(group)
    inputs = [c.contiguous() for c in torch.tensor_split(x, world, dim=scatter_dim)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(world)]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_dim)


class SeqAllToAll4D(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, x, scatter_dim, gather_dim):
        ctx.group, ctx.sd, ctx.gd = group, scatter_dim, gather_dim
        return all_to_all_4d(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, g):
        return None, all_to_all_4d(g, ctx.group, ctx.gd, ctx.sd), None, None


class WMBlock(nn.Module):
    def __init__(self, dim, heads, group):
        super().__init__()
        self.heads, self.group = heads, group
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.ada = nn.Linear(dim, 6 * dim)
        nn.init.zeros_(self.ada.weight)
        nn.init.zeros_(self.ada.bias)

    def forward(self, x, c):
        # c: [B, N_local, dim] per-token conditioning (timestep differs for context vs future frames)
        s1, m1, g1, s2, m2, g2 = self.ada(F.silu(c)).chunk(6, -1)
        h = self.norm1(x) * (1 + m1) + s1
        B, N, C = h.shape
        q, k, v = self.qkv(h).view(B, N, 3, self.heads, C // self.heads).unbind(2)
        q, k, v = (SeqAllToAll4D.apply(self.group, t, 2, 1).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v)
        o = SeqAllToAll4D.apply(self.group, o.transpose(1, 2), 1, 2).reshape(B, N, C)
        x = x + g1 * self.proj(o)
        return x + g2 * self.mlp(self.norm2(x) * (1 + m2) + s2)


class WorldModel(nn.Module):
    def __init__(self, patch_dim, dim, depth, heads, action_dim, n_frames, tok_per_frame, group):
        super().__init__()
        self.tok_per_frame = tok_per_frame
        self.x_in = nn.Linear(patch_dim, dim)
        self.t_mlp = nn.Sequential(nn.Linear(256, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.a_mlp = nn.Sequential(nn.Linear(action_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.frame_pos = nn.Parameter(torch.zeros(n_frames, dim))
        self.space_pos = nn.Parameter(torch.zeros(tok_per_frame, dim))
        nn.init.normal_(self.frame_pos, std=0.02)
        nn.init.normal_(self.space_pos, std=0.02)
        self.blocks = nn.ModuleList(WMBlock(dim, heads, group) for _ in range(depth))
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.x_out = nn.Linear(dim, patch_dim)
        nn.init.zeros_(self.x_out.weight)
        nn.init.zeros_(self.x_out.bias)

    def forward(self, x, tok_idx, t_frame, actions):
        # x: [B, N_local, patch_dim]; tok_idx: global token ids of this shard; t_frame/actions: per frame
        frame = tok_idx // self.tok_per_frame
        f = torch.exp(-math.log(10000) * torch.arange(128, device=x.device) / 128)
        ang = t_frame[:, frame, None] * f  # [B, N_local, 128]
        c = self.t_mlp(torch.cat([ang.cos(), ang.sin()], -1)) + self.a_mlp(actions)[:, frame]
        h = self.x_in(x) + self.frame_pos[frame] + self.space_pos[tok_idx % self.tok_per_frame]
        for blk in self.blocks:
            h = blk(h, c)
        return self.x_out(self.norm(h))


class Episodes(Dataset):
    def __init__(self, root):
        self.files = sorted(glob.glob(os.path.join(root, "**", "*.pt"), recursive=True))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = torch.load(self.files[i], map_location="cpu")
        return d["tokens"].float(), d["actions"].float()  # [F * tok_per_frame, patch_dim], [F, action_dim]


def save_checkpoint(ckpt_dir, step, model, ema, opt, keep=3):
    os.makedirs(ckpt_dir, exist_ok=True)
    torch.save({"model": model.module.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(), "step": step},
               os.path.join(ckpt_dir, f"wm_{step:08d}.pt"))
    ckpts = sorted(glob.glob(os.path.join(ckpt_dir, "wm_*.pt")))
    for old in ckpts[:-keep]:
        os.remove(old)


def latest_checkpoint(ckpt_dir):
    ckpts = sorted(glob.glob(os.path.join(ckpt_dir, "wm_*.pt")))
    return ckpts[-1] if ckpts else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--sp", type=int, default=4)
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--context-frames", type=int, default=4)
    ap.add_argument("--tok-per-frame", type=int, default=32 * 32)
    ap.add_argument("--patch-dim", type=int, default=16 * 2 * 2)
    ap.add_argument("--action-dim", type=int, default=7)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=300000)
    ap.add_argument("--save-every", type=int, default=5000)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    sp = args.sp
    sp_group = None
    for b in range(0, world, sp):
        g = dist.new_group(list(range(b, b + sp)))
        if b <= rank < b + sp:
            sp_group, sp_src = g, b
    sp_rank, dp_rank, dp_size = rank - sp_src, rank // sp, world // sp
    N = args.frames * args.tok_per_frame
    n_loc = N // sp
    tok_idx = torch.arange(sp_rank * n_loc, (sp_rank + 1) * n_loc, device="cuda")

    torch.manual_seed(0)
    model = WorldModel(args.patch_dim, args.dim, args.depth, args.heads, args.action_dim,
                       args.frames, args.tok_per_frame, sp_group).cuda()
    ema = deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    step = 0
    last = latest_checkpoint(args.ckpt_dir)
    if last is not None:
        ck = torch.load(last, map_location="cpu")
        model.load_state_dict(ck["model"])
        ema.load_state_dict(ck["ema"])
        opt.load_state_dict(ck["opt"])
        step = ck["step"]
    model = DDP(model, device_ids=[local_rank])
    torch.manual_seed(step * world + rank)

    ds = Episodes(args.data)
    sampler = DistributedSampler(ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=1, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    future = (tok_idx // args.tok_per_frame >= args.context_frames)[None, :, None].float()

    epoch = step // len(loader)
    tic = time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for tokens, actions in loader:
            x0 = tokens[:, sp_rank * n_loc:(sp_rank + 1) * n_loc].cuda(non_blocking=True)
            actions = actions.cuda(non_blocking=True)
            B = x0.size(0)
            t = torch.rand(B, device="cuda")
            dist.broadcast(t, src=sp_src, group=sp_group)
            # context frames stay clean (t = 0), future frames share the sampled t
            t_frame = torch.zeros(B, args.frames, device="cuda")
            t_frame[:, args.context_frames:] = t[:, None]
            noise = torch.randn_like(x0)
            tt = t[:, None, None] * future
            xt = (1 - tt) * x0 + tt * noise
            with torch.autocast("cuda", dtype=torch.bfloat16):
                v = model(xt, tok_idx, t_frame * 1000, actions)
            # shards that hold only context frames contribute no loss terms, so normalise by
            # the number of future elements of the whole clip, not of this shard
            err = (v.float() - (noise - x0)) ** 2 * future
            n_fut = future.sum() * x0.size(-1) * B
            dist.all_reduce(n_fut, group=sp_group)
            loss = err.sum() / n_fut * sp
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            with torch.no_grad():
                for pe, pm in zip(ema.parameters(), model.module.parameters()):
                    pe.mul_(0.9995).add_(pm, alpha=0.0005)
            step += 1

            if step % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {l.item():.4f} {(time.time() - tic) / 50:.2f}s/it", flush=True)
                tic = time.time()
            if step % args.save_every == 0:
                save_checkpoint(args.ckpt_dir, step, model, ema, opt)
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
