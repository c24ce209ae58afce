# Expert-parallel MoE LM: every GPU owns n_experts / world_size experts, tokens
# are exchanged with all_to_all (variable split sizes). Dense weights are
# replicated and their gradients averaged by hand after backward.
#
#   torchrun --nproc_per_node=8 09_expert_parallel_lm.py --data /data/redpajama_sample_tok
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEFAULTS = dict(
    vocab_size=32000, seq_len=1024, d_model=1024, n_layers=12, n_heads=16, d_ff=4096,
    n_experts=32, top_k=2, capacity_factor=1.25, aux_coef=0.01, z_coef=1e-3,
    batch_size=8, lr=4e-4, min_lr=4e-5, warmup=1500, max_steps=60000,
    log_every=20, eval_every=1000, save_every=2000,
)


def get_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="ckpt/ep_moe_lm")
    ap.add_argument("--config", default=None, help="json file overriding DEFAULTS")
    args = ap.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(json.load(f))
    cfg["data"], cfg["out"] = args.data, args.out
    return argparse.Namespace(**cfg)


class Tokens(Dataset):
    def __init__(self, path, seq_len):
        self.mm = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return (len(self.mm) - 1) // self.seq_len

    def __getitem__(self, i):
        s = i * self.seq_len
        t = torch.from_numpy(self.mm[s:s + self.seq_len + 1].astype(np.int64))
        return t[:-1], t[1:]


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, send_splits, recv_splits):
        ctx.send_splits, ctx.recv_splits = send_splits, recv_splits
        out = inp.new_empty(sum(recv_splits), *inp.shape[1:])
        dist.all_to_all_single(out, inp.contiguous(), recv_splits, send_splits)
        return out

    @staticmethod
    def backward(ctx, g):
        gin = g.new_empty(sum(ctx.send_splits), *g.shape[1:])
        dist.all_to_all_single(gin, g.contiguous(), ctx.send_splits, ctx.recv_splits)
        return gin, None, None


class MoE(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.world = dist.get_world_size()
        assert c.n_experts % self.world == 0
        self.E, self.k, self.cf = c.n_experts, c.top_k, c.capacity_factor
        self.local = c.n_experts // self.world
        self.router = nn.Linear(c.d_model, c.n_experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(self.local, c.d_model, c.d_ff) * 0.02)
        self.w2 = nn.Parameter(torch.randn(self.local, c.d_ff, c.d_model) * 0.02)

    def forward(self, x):
        shp = x.shape
        x = x.reshape(-1, shp[-1])
        n = x.size(0)
        logits = self.router(x).float()
        p = logits.softmax(-1)
        topv, topi = p.topk(self.k, -1)
        topv = topv / topv.sum(-1, keepdim=True)
        aux = self.E * (F.one_hot(topi[:, 0], self.E).float().mean(0) * p.mean(0)).sum()
        z = logits.logsumexp(-1).square().mean()

        cap = math.ceil(self.cf * self.k * n / self.E)
        e = topi.t().flatten()
        w = topv.t().flatten()
        tok = torch.arange(n, device=x.device).repeat(self.k)
        slot = (F.one_hot(e, self.E).cumsum(0) - 1).gather(1, e[:, None]).squeeze(1)
        keep = slot < cap
        dropped = (~keep).float().mean()
        e, w, tok = e[keep], w[keep], tok[keep]
        order = e.argsort(stable=True)
        e, w, tok = e[order], w[order], tok[order]

        cnt = torch.bincount(e, minlength=self.E)
        cnt_in = torch.empty_like(cnt)
        dist.all_to_all_single(cnt_in, cnt)
        cnt_in = cnt_in.view(self.world, self.local)
        send = cnt.view(self.world, self.local).sum(1).tolist()
        recv = cnt_in.sum(1).tolist()

        xr = AllToAll.apply(x[tok], send, recv)
        local_e = torch.arange(self.local, device=x.device).repeat(self.world).repeat_interleave(cnt_in.flatten())
        perm = local_e.argsort(stable=True)
        sizes = cnt_in.sum(0).tolist()
        outs = []
        for j, chunk in enumerate(xr[perm].split(sizes)):
            outs.append(F.gelu(chunk @ self.w1[j].to(chunk.dtype)) @ self.w2[j].to(chunk.dtype))
        yr = torch.cat(outs)[perm.argsort()]
        y = AllToAll.apply(yr, recv, send)
        out = torch.zeros_like(x).index_add(0, tok, (y * w[:, None]).to(x.dtype))
        return out.view(shp), aux, z, dropped


class Layer(nn.Module):
    def __init__(self, c, moe):
        super().__init__()
        self.c = c
        self.ln1, self.ln2 = nn.LayerNorm(c.d_model), nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.o = nn.Linear(c.d_model, c.d_model)
        self.is_moe = moe
        self.ff = MoE(c) if moe else nn.Sequential(nn.Linear(c.d_model, c.d_ff), nn.GELU(),
                                                  nn.Linear(c.d_ff, c.d_model))

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.c.n_heads, -1).permute(2, 0, 3, 1, 4)
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D))
        if self.is_moe:
            h, aux, z, dr = self.ff(self.ln2(x))
            return x + h, aux, z, dr
        zero = x.new_zeros((), dtype=torch.float32)
        return x + self.ff(self.ln2(x)), zero, zero, None


class Model(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.emb = nn.Embedding(c.vocab_size, c.d_model)
        self.pos = nn.Parameter(torch.randn(c.seq_len, c.d_model) * 0.01)
        self.layers = nn.ModuleList(Layer(c, i % 2 == 1) for i in range(c.n_layers))
        self.ln = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)

    def forward(self, idx):
        x = self.emb(idx) + self.pos[: idx.size(1)]
        aux = z = 0.0
        drops = []
        for l in self.layers:
            x, a, zz, d = l(x)
            aux, z = aux + a, z + zz
            if d is not None:
                drops.append(d)
        return self.head(self.ln(x)), aux, z, torch.stack(drops).mean()


def is_expert_param(name):
    return name.endswith(".ff.w1") or name.endswith(".ff.w2")


def allreduce_dense_grads(model, world):
    grads = [p.grad for n, p in model.named_parameters() if not is_expert_param(n)]
    buf = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(buf)
    buf /= world
    i = 0
    for g in grads:
        g.copy_(buf[i:i + g.numel()].view_as(g))
        i += g.numel()
    # expert grads already hold every rank's contribution (the backward all_to_all sums them)
    for n, p in model.named_parameters():
        if is_expert_param(n):
            p.grad /= world


@torch.no_grad()
def evaluate(model, loader, device, max_batches=50):
    model.eval()
    nll, cnt = 0.0, 0
    for i, (x, y) in enumerate(loader):
        if i == max_batches:
            break
        x, y = x.to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, _, _, _ = model(x)
        nll += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").item()
        cnt += y.numel()
    model.train()
    return nll / cnt


def main():
    c = get_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    torch.manual_seed(0)
    model = Model(c)
    # dense weights are identical on every rank; give each rank's experts their own init
    gen = torch.Generator().manual_seed(1000 + rank)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if is_expert_param(n):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=c.lr, betas=(0.9, 0.95), weight_decay=0.1)

    train = Tokens(os.path.join(c.data, "train.bin"), c.seq_len)
    sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    loader = DataLoader(train, batch_size=c.batch_size, sampler=sampler, num_workers=4, pin_memory=True,
                        drop_last=True)
    val_loader = DataLoader(Tokens(os.path.join(c.data, "val.bin"), c.seq_len), batch_size=c.batch_size,
                            shuffle=False, num_workers=2)

    os.makedirs(c.out, exist_ok=True)
    shard_path = os.path.join(c.out, f"rank{rank}.pt")
    step = 0
    if os.path.exists(shard_path):
        st = torch.load(shard_path, map_location=device)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step = st["step"]

    def lr_at(s):
        if s < c.warmup:
            return c.lr * (s + 1) / c.warmup
        r = (s - c.warmup) / (c.max_steps - c.warmup)
        return c.min_lr + (c.lr - c.min_lr) * 0.5 * (1 + math.cos(math.pi * min(r, 1.0)))

    epoch = step // len(loader)
    t0 = time.time()
    while step < c.max_steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, aux, z, dropped = model(x)
                ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                loss = ce + c.aux_coef * aux + c.z_coef * z
            opt.zero_grad(set_to_none=True)
            loss.backward()
            allreduce_dense_grads(model, world)
            opt.step()
            step += 1

            if step % c.log_every == 0:
                m = torch.stack([ce.detach(), aux.detach(), dropped])
                dist.all_reduce(m)
                m /= world
                if rank == 0:
                    print(f"step {step} ce {m[0]:.4f} aux {m[1]:.4f} dropped {m[2]:.2%} "
                          f"lr {lr_at(step):.2e} {(time.time() - t0) / c.log_every:.3f}s/step", flush=True)
                t0 = time.time()

            if step % c.eval_every == 0:
                if rank == 0:
                    vl = evaluate(model, val_loader, device)
                    print(f"step {step} val_loss {vl:.4f} val_ppl {math.exp(vl):.2f}", flush=True)
                dist.barrier()

            if step % c.save_every == 0:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, shard_path)

            if step >= c.max_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
