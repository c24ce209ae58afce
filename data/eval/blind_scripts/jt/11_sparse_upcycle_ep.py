"""Sparse upcycling: start an expert-parallel MoE from a dense GPT-2 checkpoint.

Every other MLP becomes an MoE layer whose experts are copies of the dense MLP;
the router starts from scratch. Experts are spread over all ranks (EP = world size).

    torchrun --nproc_per_node=8 11_sparse_upcycle_ep.py --dense /models/gpt2-medium --data /data/owt_gpt2
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import GPT2LMHeadModel


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--dense", required=True, help="local HF directory of the dense model")
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="out/upcycled")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top_k", type=int, default=2)
    p.add_argument("--capacity_factor", type=float, default=1.5)
    p.add_argument("--aux_weight", type=float, default=0.01)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--router_lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--eval_every", type=int, default=500)
    return p.parse_args()


class BinDataset(Dataset):
    def __init__(self, path, ctx):
        self.path, self.ctx = path, ctx
        self.n = (os.path.getsize(path) // 2 - 1) // ctx
        self.mm = None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.mm is None:
            self.mm = np.memmap(self.path, dtype=np.uint16, mode="r")
        a = torch.from_numpy(self.mm[i * self.ctx:(i + 1) * self.ctx + 1].astype(np.int64))
        return a[:-1], a[1:]


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x.contiguous())
        return y

    @staticmethod
    def backward(ctx, g):
        return AllToAll.apply(g)


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class UpcycledMoE(nn.Module):
    def __init__(self, d, num_experts, top_k, capacity_factor):
        super().__init__()
        self.ep_size = dist.get_world_size()
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.local = num_experts // self.ep_size
        self.router = nn.Linear(d, num_experts, bias=False)
        nn.init.normal_(self.router.weight, std=0.02)
        self.experts = nn.ModuleList(MLP(d) for _ in range(self.local))
        self.aux = None

    def forward(self, x):
        B, T, D = x.shape
        x = x.reshape(-1, D)
        N = x.size(0)
        probs = self.router(x).float().softmax(-1)
        w, e = probs.topk(self.top_k, -1)
        w = w / w.sum(-1, keepdim=True)
        self.aux = self.num_experts * (F.one_hot(e, self.num_experts).float().sum(1).mean(0) / self.top_k
                                       * probs.mean(0)).sum()
        C = math.ceil(self.capacity_factor * N * self.top_k / self.num_experts)
        e_f, w_f = e.t().reshape(-1), w.t().reshape(-1)
        t_f = torch.arange(N, device=x.device).repeat(self.top_k)
        oh = F.one_hot(e_f, self.num_experts)
        pos = (oh.cumsum(0) * oh).sum(-1) - 1
        keep = pos < C
        slot, tok = e_f[keep] * C + pos[keep], t_f[keep]
        buf = x.new_zeros(self.num_experts * C, D)
        buf[slot] = x[tok]
        h = AllToAll.apply(buf).view(self.ep_size, self.local, C, D)
        h = torch.stack([self.experts[i](h[:, i]) for i in range(self.local)], dim=1)
        h = AllToAll.apply(h.reshape(-1, D))
        y = torch.zeros(N, D, device=x.device, dtype=h.dtype)
        y.index_add_(0, tok, h[slot] * w_f[keep, None].to(h.dtype))
        return y.to(x.dtype).view(B, T, D)


class Block(nn.Module):
    def __init__(self, d, n_head, moe, a):
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.mlp = UpcycledMoE(d, a.experts, a.top_k, a.capacity_factor) if moe else MLP(d)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(D, 2)
        q, k, v = [t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v)]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
        x = x + self.c_proj(y)
        return x + self.mlp(self.ln_2(x))


class MoEGPT2(nn.Module):
    def __init__(self, hf_cfg, a):
        super().__init__()
        d = hf_cfg.n_embd
        self.wte = nn.Embedding(hf_cfg.vocab_size, d)
        self.wpe = nn.Embedding(hf_cfg.n_positions, d)
        self.h = nn.ModuleList(Block(d, hf_cfg.n_head, i % 2 == 1, a) for i in range(hf_cfg.n_layer))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx, tgt):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for b in self.h:
            x = b(x)
        logits = F.linear(self.ln_f(x), self.wte.weight).float()
        ce = F.cross_entropy(logits.view(-1, logits.size(-1)), tgt.view(-1))
        aux = torch.stack([b.mlp.aux for b in self.h if isinstance(b.mlp, UpcycledMoE)]).mean()
        return ce, aux


@torch.no_grad()
def upcycle_from_dense(model, dense_dir):
    dense = GPT2LMHeadModel.from_pretrained(dense_dir, torch_dtype=torch.float32).transformer
    model.wte.weight.copy_(dense.wte.weight)
    model.wpe.weight.copy_(dense.wpe.weight)
    model.ln_f.load_state_dict(dense.ln_f.state_dict())
    for blk, src in zip(model.h, dense.h):
        blk.ln_1.load_state_dict(src.ln_1.state_dict())
        blk.ln_2.load_state_dict(src.ln_2.state_dict())
        # HF GPT-2 uses Conv1D (in, out); nn.Linear wants (out, in)
        blk.c_attn.weight.copy_(src.attn.c_attn.weight.t())
        blk.c_attn.bias.copy_(src.attn.c_attn.bias)
        blk.c_proj.weight.copy_(src.attn.c_proj.weight.t())
        blk.c_proj.bias.copy_(src.attn.c_proj.bias)
        mlps = blk.mlp.experts if isinstance(blk.mlp, UpcycledMoE) else [blk.mlp]
        for m in mlps:
            m.c_fc.weight.copy_(src.mlp.c_fc.weight.t())
            m.c_fc.bias.copy_(src.mlp.c_fc.bias)
            m.c_proj.weight.copy_(src.mlp.c_proj.weight.t())
            m.c_proj.bias.copy_(src.mlp.c_proj.bias)
    return dense.config


def main():
    a = parse()
    from transformers import GPT2Config
    hf_cfg = GPT2Config.from_pretrained(a.dense)
    model = MoEGPT2(hf_cfg, a)
    upcycle_from_dense(model, a.dense)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    model.to(device)
    expert_names = [n for n, _ in model.named_parameters() if ".experts." in n]
    DDP._set_params_and_buffers_to_ignore_for_model(model, expert_names)
    ddp = DDP(model, device_ids=[local_rank])
    expert_params = [p for n, p in model.named_parameters() if n in set(expert_names)]
    router_params = [p for n, p in model.named_parameters() if ".router." in n]
    other = [p for n, p in model.named_parameters() if n not in set(expert_names) and ".router." not in n]
    opt = torch.optim.AdamW([
        {"params": other + expert_params, "lr": a.lr},
        {"params": router_params, "lr": a.router_lr},
    ], betas=(0.9, 0.95), weight_decay=0.1)
    base_lrs = [g["lr"] for g in opt.param_groups]

    train = BinDataset(os.path.join(a.data, "train.bin"), a.ctx)
    val = BinDataset(os.path.join(a.data, "val.bin"), a.ctx)
    ts = DistributedSampler(train, shuffle=True, seed=0, drop_last=True)
    vs = DistributedSampler(val, shuffle=False, drop_last=True)
    train_dl = DataLoader(train, a.batch, sampler=ts, num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val, a.batch, sampler=vs, num_workers=2, pin_memory=True, drop_last=True)
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)

    @torch.no_grad()
    def evaluate(n=50):
        ddp.eval()
        s = torch.zeros(2, device=device)
        for i, (x, y) in enumerate(val_dl):
            if i == n:
                break
            with torch.autocast("cuda", dtype=torch.bfloat16):
                ce, _ = ddp(x.to(device), y.to(device))
            s += torch.stack([ce, torch.ones_like(ce)])
        dist.all_reduce(s)
        ddp.train()
        return (s[0] / s[1]).item()

    step, epoch, t0 = 0, 0, time.time()
    while step < a.steps:
        ts.set_epoch(epoch)
        for x, y in train_dl:
            scale = min(1.0, (step + 1) / a.warmup) * 0.5 * (1 + math.cos(math.pi * step / a.steps))
            for g, base in zip(opt.param_groups, base_lrs):
                g["lr"] = base * scale
            with torch.autocast("cuda", dtype=torch.bfloat16):
                ce, aux = ddp(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
            (ce + a.aux_weight * aux).backward()
            for p in expert_params:
                p.grad.div_(world)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 20 == 0:
                s = torch.stack([ce.detach(), aux.detach()])
                dist.all_reduce(s, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} ce {s[0]:.4f} aux {s[1]:.4f} {(time.time() - t0) / 20:.2f}s/it", flush=True)
                t0 = time.time()
            if step % a.eval_every == 0:
                vl = evaluate()
                sd = model.state_dict()
                if rank == 0:
                    print(f"step {step} val {vl:.4f}", flush=True)
                    torch.save({k: v for k, v in sd.items() if ".experts." not in k},
                               os.path.join(a.out, f"dense_{step}.pt"))
                torch.save({k: v for k, v in sd.items() if ".experts." in k},
                           os.path.join(a.out, f"experts_{step}_ep{rank}of{world}.pt"))
            if step >= a.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
