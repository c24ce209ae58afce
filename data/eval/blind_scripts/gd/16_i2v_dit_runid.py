"""Image-to-video DiT fine-tuning with Ulysses sequence parallelism.

The first latent frame is the conditioning image (kept clean); the model denoises the
remaining frames. Tokens of one clip are split over --sp ranks.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        16_i2v_dit_runid.py --data /nfs/i2v_latents --output-root /nfs/i2v_runs --sp 4
"""
import argparse
import json
import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnnf
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def heads_all_to_all(x, group, forward):
    """forward=True: [B, S/P, H, D] -> [B, S, H/P, D]; forward=False: the inverse."""
    P = dist.get_world_size(group)
    if forward:
        B, s, H, D = x.shape
        inp = x.reshape(B, s, P, H // P, D).permute(2, 0, 1, 3, 4).contiguous()
    else:
        B, S, h, D = x.shape
        inp = x.reshape(B, P, S // P, h, D).permute(1, 0, 2, 3, 4).contiguous()
    out = dnnf.all_to_all_single(torch.empty_like(inp), inp, group=group)
    if forward:
        return out.permute(1, 0, 2, 3, 4).reshape(B, P * s, H // P, D)
    return out.permute(1, 2, 0, 3, 4).reshape(B, S // P, P * h, D)


class Block(nn.Module):
    def __init__(self, dim, heads, group):
        super().__init__()
        self.heads, self.group = heads, group
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.mod = nn.Linear(dim, 6 * dim)

    def forward(self, x, c):
        sa, ma, ga, sf, mf, gf = self.mod(F.silu(c)).unsqueeze(1).chunk(6, dim=-1)
        h = self.norm1(x) * (1 + ma) + sa
        B, N, C = h.shape
        q, k, v = self.qkv(h).view(B, N, 3, self.heads, C // self.heads).unbind(2)
        q, k, v = (heads_all_to_all(t, self.group, True).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
        o = heads_all_to_all(o, self.group, False).reshape(B, N, C)
        x = x + ga * self.proj(o)
        return x + gf * self.ffn(self.norm2(x) * (1 + mf) + sf)


class I2VDiT(nn.Module):
    def __init__(self, patch_dim, dim, depth, heads, group, n_tok_total):
        super().__init__()
        self.embed = nn.Linear(2 * patch_dim, dim)  # noisy tokens ++ conditioning-frame tokens
        self.pos = nn.Parameter(torch.randn(1, n_tok_total, dim) * 0.02)
        self.t_mlp = nn.Sequential(nn.Linear(256, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, group) for _ in range(depth))
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.out = nn.Linear(dim, patch_dim)
        for b in self.blocks:
            nn.init.zeros_(b.mod.weight)
            nn.init.zeros_(b.mod.bias)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, xt, cond, t, tok_start):
        f = torch.exp(-math.log(10000.0) * torch.arange(128, device=t.device) / 128)
        c = self.t_mlp(torch.cat([(t[:, None] * f).cos(), (t[:, None] * f).sin()], -1))
        h = self.embed(torch.cat([xt, cond], -1)) + self.pos[:, tok_start:tok_start + xt.size(1)]
        for blk in self.blocks:
            h = blk(h, c)
        return self.out(self.norm(h))


class I2VLatents(Dataset):
    def __init__(self, root):
        self.root = root
        self.names = sorted(n for n in os.listdir(root) if n.endswith(".pt"))

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        d = torch.load(os.path.join(self.root, self.names[i]), map_location="cpu")
        return d["video_tokens"].float(), d["first_frame_tokens"].float()  # both [N, patch_dim]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--output-root", required=True)
    ap.add_argument("--name", default="i2v")
    ap.add_argument("--sp", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=13 * 30 * 52)
    ap.add_argument("--patch-dim", type=int, default=16 * 4)
    ap.add_argument("--dim", type=int, default=1536)
    ap.add_argument("--depth", type=int, default=30)
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--init", default="")
    args = ap.parse_args()

    dist.init_process_group(backend="nccl", timeout=timedelta(minutes=30))
    rank, world = dist.get_rank(), dist.get_world_size()

    # one run directory shared by all ranks
    stamp = torch.tensor([int(time.time())], dtype=torch.long, device="cuda")
    dist.broadcast(stamp, src=0)
    run_dir = os.path.join(args.output_root, f"{args.name}-{stamp.item()}")

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)

    sp = args.sp
    sp_group = None
    for s in range(0, world, sp):
        ranks = list(range(s, s + sp))
        g = dist.new_group(ranks)
        if rank in ranks:
            sp_group, leader = g, s
    sp_rank, dp_rank, dp_size = rank - leader, rank // sp, world // sp
    n_loc = args.tokens // sp
    assert args.tokens % sp == 0 and args.heads % sp == 0

    torch.manual_seed(0)
    model = I2VDiT(args.patch_dim, args.dim, args.depth, args.heads, sp_group, args.tokens)
    if args.init:
        missing, unexpected = model.load_state_dict(torch.load(args.init, map_location="cpu"), strict=False)
        if rank == 0:
            print("init:", len(missing), "missing,", len(unexpected), "unexpected", flush=True)
    model = DDP(model.cuda(), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    torch.manual_seed(1000 + rank)

    ds = I2VLatents(args.data)
    sampler = DistributedSampler(ds, num_replicas=dp_size, rank=dp_rank, shuffle=True)
    loader = DataLoader(ds, batch_size=1, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "args.json"), "w") as f:
            json.dump(vars(args) | {"world": world}, f, indent=2)

    sl = slice(sp_rank * n_loc, (sp_rank + 1) * n_loc)
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        tic = time.time()
        for vid, first in loader:
            x0 = vid[:, sl].cuda(non_blocking=True)
            cond = first[:, sl].cuda(non_blocking=True)
            t = torch.rand(x0.size(0), device="cuda")
            dist.broadcast(t, src=leader, group=sp_group)
            noise = torch.randn_like(x0)
            xt = (1 - t[:, None, None]) * x0 + t[:, None, None] * noise
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(xt, cond, t * 1000, sl.start)
            loss = F.mse_loss(pred.float(), noise - x0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1

            if step % 25 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step} loss {l.item():.4f} {(time.time() - tic) / 25:.2f}s/it", flush=True)
                tic = time.time()

        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(run_dir, f"epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
