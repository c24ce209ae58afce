"""
GPT-style MoE pretraining with expert parallelism and hand-written gradient sync.

Dense weights are replicated and all-reduced manually; each rank keeps
num_experts // world_size experts whose gradients stay local. Token dispatch uses
fixed-capacity buffers so every all_to_all has the same shape on every rank.

Launch (one node, 8 GPUs):
    torchrun --nproc_per_node=8 03_ep_moe_lm.py --data data/fineweb10B --experts 64
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
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

parser = argparse.ArgumentParser()
parser.add_argument("--data", default="data/fineweb10B")
parser.add_argument("--ckpt_dir", default="ckpt/ep_moe")
parser.add_argument("--resume", action="store_true")
parser.add_argument("--vocab", type=int, default=50304)
parser.add_argument("--ctx", type=int, default=1024)
parser.add_argument("--dim", type=int, default=1024)
parser.add_argument("--heads", type=int, default=16)
parser.add_argument("--depth", type=int, default=16)
parser.add_argument("--experts", type=int, default=64)
parser.add_argument("--topk", type=int, default=2)
parser.add_argument("--cap", type=float, default=1.25)
parser.add_argument("--eval_cap", type=float, default=2.0)
parser.add_argument("--aux_w", type=float, default=1e-2)
parser.add_argument("--zloss_w", type=float, default=1e-3)
parser.add_argument("--bs", type=int, default=8, help="micro batch per GPU")
parser.add_argument("--accum", type=int, default=4)
parser.add_argument("--lr", type=float, default=4e-4)
parser.add_argument("--warmup", type=int, default=1000)
parser.add_argument("--iters", type=int, default=60000)
parser.add_argument("--eval_every", type=int, default=500)
parser.add_argument("--eval_iters", type=int, default=40)
parser.add_argument("--seed", type=int, default=1337)


class A2A(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        return A2A.apply(g.contiguous(), ctx.group), None


class ExpertMLP(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class EPMoE(nn.Module):
    def __init__(self, dim, n_experts, topk, cap, eval_cap):
        super().__init__()
        self.ws = dist.get_world_size()
        self.n_experts, self.topk, self.cap, self.eval_cap = n_experts, topk, cap, eval_cap
        self.n_local = n_experts // self.ws
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList(ExpertMLP(dim) for _ in range(self.n_local))
        self.stats = {}

    def forward(self, x):
        B, T, D = x.shape
        x = x.view(-1, D)
        N = x.size(0)
        logits = self.router(x).float()
        probs = logits.softmax(-1)
        gates, choice = torch.topk(probs, self.topk, dim=-1)
        gates = gates / gates.sum(-1, keepdim=True)

        load = F.one_hot(choice, self.n_experts).float().sum(1).mean(0) / self.topk
        aux = self.n_experts * (load * probs.mean(0)).sum()
        z = torch.logsumexp(logits, -1).pow(2).mean()

        factor = self.cap if self.training else self.eval_cap
        C = int(math.ceil(factor * N * self.topk / self.n_experts))
        e_flat = choice.t().reshape(-1)
        g_flat = gates.t().reshape(-1)
        t_flat = torch.arange(N, device=x.device).repeat(self.topk)
        onehot = F.one_hot(e_flat, self.n_experts)
        slot_in_expert = (onehot.cumsum(0) * onehot).sum(-1) - 1
        keep = slot_in_expert < C
        dest = e_flat[keep] * C + slot_in_expert[keep]
        t_keep = t_flat[keep]

        buf = x.new_zeros(self.n_experts * C, D)
        buf[dest] = x[t_keep]
        recv = A2A.apply(buf, None).view(self.ws, self.n_local, C, D)
        out = torch.stack([self.experts[i](recv[:, i].reshape(-1, D)).view(self.ws, C, D)
                           for i in range(self.n_local)], dim=1)
        back = A2A.apply(out.reshape(-1, D), None)

        y = torch.zeros(N, D, device=x.device, dtype=back.dtype)
        y.index_add_(0, t_keep, back[dest] * g_flat[keep].unsqueeze(1).to(back.dtype))
        self.stats = {"aux": aux, "z": z, "dropped": 1.0 - keep.float().mean().detach()}
        return y.to(x.dtype).view(B, T, D)


class Layer(nn.Module):
    def __init__(self, a, moe):
        super().__init__()
        self.h = a.heads
        self.n1 = nn.LayerNorm(a.dim)
        self.n2 = nn.LayerNorm(a.dim)
        self.qkv = nn.Linear(a.dim, 3 * a.dim, bias=False)
        self.o = nn.Linear(a.dim, a.dim, bias=False)
        self.ff = EPMoE(a.dim, a.experts, a.topk, a.cap, a.eval_cap) if moe else ExpertMLP(a.dim)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, T, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(B, T, D))
        return x + self.ff(self.n2(x))


class GPTMoE(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.wte = nn.Embedding(a.vocab, a.dim)
        self.wpe = nn.Embedding(a.ctx, a.dim)
        self.layers = nn.ModuleList(Layer(a, moe=(i % 2 == 1)) for i in range(a.depth))
        self.nf = nn.LayerNorm(a.dim)
        self.lm = nn.Linear(a.dim, a.vocab, bias=False)
        self.wte.weight = self.lm.weight
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, tgt):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for l in self.layers:
            x = l(x)
        logits = self.lm(self.nf(x)).float()
        ce = F.cross_entropy(logits.view(-1, logits.size(-1)), tgt.view(-1))
        moes = [l.ff for l in self.layers if isinstance(l.ff, EPMoE)]
        aux = torch.stack([m.stats["aux"] for m in moes]).mean()
        z = torch.stack([m.stats["z"] for m in moes]).mean()
        dropped = torch.stack([m.stats["dropped"] for m in moes]).mean()
        return ce, aux, z, dropped


def get_batch(split, a, gen, device):
    # random windows, nanoGPT style; each rank draws from its own generator
    data = np.memmap(os.path.join(a.data, f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - a.ctx - 1, (a.bs,), generator=gen)
    x = torch.stack([torch.from_numpy(data[i:i + a.ctx].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + a.ctx].astype(np.int64)) for i in ix])
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


def main():
    a = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, ws = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    assert a.experts % ws == 0

    torch.manual_seed(a.seed + rank)
    model = GPTMoE(a).to(device)
    expert_p = [p for n, p in model.named_parameters() if ".experts." in n]
    dense_p = [p for n, p in model.named_parameters() if ".experts." not in n]
    for p in dense_p:  # experts stay rank-specific, everything else starts from rank 0
        dist.broadcast(p.data, src=0)

    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(a.seed * 1000 + rank)
    start = 0

    os.makedirs(a.ckpt_dir, exist_ok=True)
    if a.resume:
        meta = torch.load(os.path.join(a.ckpt_dir, "dense.pt"), map_location=device)
        if meta["world_size"] != ws:
            raise RuntimeError(f"checkpoint has {meta['world_size']} expert shards, running on {ws} ranks")
        shard = torch.load(os.path.join(a.ckpt_dir, f"experts.{rank}.pt"), map_location=device)
        model.load_state_dict({**meta["dense"], **shard["experts"]})
        opt.load_state_dict(shard["opt"])
        gen.set_state(shard["rng"].cpu())
        start = meta["iter"]

    def lr_at(it):
        if it < a.warmup:
            return a.lr * (it + 1) / a.warmup
        return 0.1 * a.lr + 0.45 * a.lr * (1 + math.cos(math.pi * (it - a.warmup) / (a.iters - a.warmup)))

    def sync_and_clip(max_norm=1.0):
        grads = [p.grad for p in dense_p]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat.div_(ws)
        for g, s in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(s)
        for p in expert_p:
            p.grad.div_(ws)
        sq = torch.stack([p.grad.float().norm() ** 2 for p in expert_p]).sum()
        dist.all_reduce(sq)
        sq = sq + flat.float().norm() ** 2
        norm = sq.sqrt()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in model.parameters():
            p.grad.mul_(scale)
        return norm

    @torch.no_grad()
    def estimate_val():
        model.eval()
        acc = torch.zeros(2, device=device)
        for _ in range(a.eval_iters):
            x, y = get_batch("val", a, gen, device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                ce, _, _, dropped = model(x, y)
            acc += torch.stack([ce, dropped])
        dist.all_reduce(acc)
        model.train()
        return (acc / (a.eval_iters * ws)).tolist()

    t = time.time()
    for it in range(start, a.iters):
        for g in opt.param_groups:
            g["lr"] = lr_at(it)
        logs = torch.zeros(4, device=device)
        for _ in range(a.accum):
            x, y = get_batch("train", a, gen, device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                ce, aux, z, dropped = model(x, y)
                loss = ce + a.aux_w * aux + a.zloss_w * z
            (loss / a.accum).backward()
            logs += torch.stack([ce.detach(), aux.detach(), z.detach(), dropped]) / a.accum
        gnorm = sync_and_clip()
        opt.step()
        opt.zero_grad(set_to_none=True)

        if it % 10 == 0:
            dist.all_reduce(logs)
            logs /= ws
            if rank == 0:
                dt, t = time.time() - t, time.time()
                print(f"it {it} ce {logs[0]:.4f} aux {logs[1]:.4f} z {logs[2]:.2f} "
                      f"drop {100 * logs[3]:.2f}% norm {gnorm:.2f} {dt / 10:.2f}s/it", flush=True)

        if (it + 1) % a.eval_every == 0:
            val_ce, val_drop = estimate_val()
            sd = model.state_dict()
            if rank == 0:
                print(f"it {it + 1} val {val_ce:.4f} (drop {100 * val_drop:.2f}%)", flush=True)
                dense = {k: v for k, v in sd.items() if ".experts." not in k}
                torch.save({"dense": dense, "iter": it + 1, "world_size": ws, "args": vars(a)},
                           os.path.join(a.ckpt_dir, "dense.pt.tmp"))
                os.replace(os.path.join(a.ckpt_dir, "dense.pt.tmp"), os.path.join(a.ckpt_dir, "dense.pt"))
            experts = {k: v for k, v in sd.items() if ".experts." in k}
            torch.save({"experts": experts, "opt": opt.state_dict(), "rng": gen.get_state()},
                       os.path.join(a.ckpt_dir, f"experts.{rank}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
