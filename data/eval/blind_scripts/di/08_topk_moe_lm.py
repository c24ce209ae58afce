"""Noisy top-k gated MoE language model (Shazeer et al. 2017 gating) -- DDP trainer.

usage:
    torchrun --nproc_per_node=8 08_topk_moe_lm.py --train data/wiki103/train.u16 --valid data/wiki103/valid.u16
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


class LMWindows(Dataset):
    def __init__(self, path, bptt):
        self.ids = np.fromfile(path, dtype=np.uint16)
        self.bptt = bptt

    def __len__(self):
        return (len(self.ids) - 1) // self.bptt

    def __getitem__(self, i):
        s = i * self.bptt
        w = torch.from_numpy(self.ids[s:s + self.bptt + 1].astype(np.int64))
        return w[:-1], w[1:]


class NoisyTopKGate(nn.Module):
    def __init__(self, d, n_exp, k, noise_eps=1e-2):
        super().__init__()
        self.k, self.n_exp = k, n_exp
        self.w_gate = nn.Parameter(torch.zeros(d, n_exp))
        self.w_noise = nn.Parameter(torch.zeros(d, n_exp))
        self.noise_eps = noise_eps

    @staticmethod
    def cv_squared(v):
        return v.float().var() / (v.float().mean() ** 2 + 1e-10)

    def forward(self, x):
        clean = x.float() @ self.w_gate.float()
        if self.training:
            std = F.softplus(x.float() @ self.w_noise.float()) + self.noise_eps
            logits = clean + torch.randn_like(clean) * std
        else:
            logits = clean
        top_logits, top_idx = logits.topk(self.k, dim=-1)
        top_gates = top_logits.softmax(-1)
        gates = torch.zeros_like(logits).scatter(1, top_idx, top_gates)
        importance = gates.sum(0)
        load = (gates > 0).float().sum(0)
        aux = self.cv_squared(importance) + self.cv_squared(load)
        z = torch.logsumexp(clean, -1).pow(2).mean()
        return gates, top_idx, aux, z


class MoEFeedForward(nn.Module):
    def __init__(self, d, d_ff, n_exp, k, capacity_factor):
        super().__init__()
        self.gate = NoisyTopKGate(d, n_exp, k)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, d_ff), nn.GELU(), nn.Linear(d_ff, d)) for _ in range(n_exp))
        self.capacity_factor = capacity_factor
        self.aux_loss = None
        self.z_loss = None
        self.drop_frac = None

    def forward(self, x):
        B, T, D = x.shape
        xf = x.reshape(-1, D)
        gates, top_idx, aux, z = self.gate(xf)
        n_exp = len(self.experts)
        capacity = int(math.ceil(self.capacity_factor * xf.size(0) * top_idx.size(1) / n_exp))
        y = torch.zeros_like(xf)
        kept = 0
        for e, expert in enumerate(self.experts):
            rows = torch.nonzero(gates[:, e] > 0, as_tuple=True)[0][:capacity]
            kept += rows.numel()
            y.index_add_(0, rows, (expert(xf[rows]) * gates[rows, e:e + 1]).to(y.dtype))
        self.aux_loss, self.z_loss = aux, z
        self.drop_frac = 1.0 - kept / top_idx.numel()
        return y.view(B, T, D)


class Block(nn.Module):
    def __init__(self, d, h, d_ff, moe_cfg=None, dropout=0.1):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, h, dropout=dropout, batch_first=True)
        self.ff = MoEFeedForward(d, d_ff, **moe_cfg) if moe_cfg else nn.Sequential(
            nn.Linear(d, d_ff), nn.GELU(), nn.Linear(d_ff, d))
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.drop(self.attn(h, h, h, attn_mask=mask, need_weights=False)[0])
        return x + self.drop(self.ff(self.ln2(x)))


class MoETransformerLM(nn.Module):
    def __init__(self, vocab, d=512, n_layers=8, heads=8, d_ff=2048, n_exp=16, k=4, capacity_factor=1.25,
                 bptt=512):
        super().__init__()
        moe_cfg = dict(n_exp=n_exp, k=k, capacity_factor=capacity_factor)
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(bptt, d)
        self.blocks = nn.ModuleList(Block(d, heads, d_ff, moe_cfg if i % 2 else None) for i in range(n_layers))
        self.ln = nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab)
        mask = torch.full((bptt, bptt), float("-inf")).triu(1)
        self.register_buffer("mask", mask, persistent=False)

    def moe_layers(self):
        return [b.ff for b in self.blocks if isinstance(b.ff, MoEFeedForward)]

    def aux_loss(self):
        layers = self.moe_layers()
        aux = sum(m.aux_loss for m in layers) / len(layers)
        z = sum(m.z_loss for m in layers) / len(layers)
        return aux, z

    def forward(self, idx):
        T = idx.size(1)
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x, self.mask[:T, :T])
        return self.out(self.ln(x))


class Trainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        torch.manual_seed(args.seed)

        self.train_ds = LMWindows(args.train, args.bptt)
        self.valid_ds = LMWindows(args.valid, args.bptt)
        self.sampler = DistributedSampler(self.train_ds, shuffle=True, seed=args.seed, drop_last=True)
        self.train_dl = DataLoader(self.train_ds, args.batch_size, sampler=self.sampler, num_workers=4,
                                   pin_memory=True, drop_last=True)
        self.valid_dl = DataLoader(self.valid_ds, args.batch_size,
                                   sampler=DistributedSampler(self.valid_ds, shuffle=False, drop_last=True),
                                   num_workers=2, pin_memory=True)

        net = MoETransformerLM(args.vocab, d=args.d_model, n_layers=args.layers, n_exp=args.experts, k=args.k,
                               capacity_factor=args.capacity_factor, bptt=args.bptt).to(self.device)
        self.model = DDP(net, device_ids=[self.local_rank])
        self.opt = torch.optim.Adam(self.model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9)
        total = args.epochs * len(self.train_dl)
        self.sched = torch.optim.lr_scheduler.OneCycleLR(self.opt, max_lr=args.lr, total_steps=total,
                                                         pct_start=0.05, anneal_strategy="cos")
        self.start_epoch = 0
        self.ckpt_path = os.path.join(args.save_dir, "moe_lm.pt")
        if os.path.exists(self.ckpt_path):
            st = torch.load(self.ckpt_path, map_location=self.device)
            self.model.module.load_state_dict(st["model"])
            self.opt.load_state_dict(st["opt"])
            self.sched.load_state_dict(st["sched"])
            self.start_epoch = st["epoch"] + 1

    def train_epoch(self, epoch):
        a = self.args
        self.model.train()
        self.sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (x, y) in enumerate(self.train_dl):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = self.model(x)
                nll = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
                aux, z = self.model.aux_loss()
                loss = nll + a.aux_weight * aux + a.z_weight * z
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), a.clip)
            self.opt.step()
            self.sched.step()
            if i % a.log_every == 0:
                drops = [m.drop_frac for m in self.model.module.moe_layers()]
                s = torch.tensor([nll.item(), aux.item(), sum(drops) / len(drops)], device=self.device)
                dist.all_reduce(s)
                s /= self.world
                if self.rank == 0:
                    print(f"| epoch {epoch:3d} | {i:5d}/{len(self.train_dl)} | nll {s[0]:.3f} | ppl {math.exp(s[0]):8.2f}"
                          f" | aux {s[1]:.3f} | drop {s[2]:.3f} | lr {self.sched.get_last_lr()[0]:.2e}"
                          f" | {(time.time() - t0) * 1000 / (i + 1):.0f} ms/b", flush=True)

    @torch.no_grad()
    def validate(self):
        self.model.eval()
        tot = torch.zeros(2, device=self.device)
        for x, y in self.valid_dl:
            x, y = x.to(self.device), y.to(self.device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = self.model(x)
            tot[0] += F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1), reduction="sum")
            tot[1] += y.numel()
        dist.all_reduce(tot)
        return (tot[0] / tot[1]).item()

    def fit(self):
        best = float("inf")
        for epoch in range(self.start_epoch, self.args.epochs):
            self.train_epoch(epoch)
            val = self.validate()
            if self.rank == 0:
                print(f"=== epoch {epoch} valid loss {val:.4f} ppl {math.exp(val):.2f}", flush=True)
                os.makedirs(self.args.save_dir, exist_ok=True)
                torch.save({"model": self.model.module.state_dict(), "opt": self.opt.state_dict(),
                            "sched": self.sched.state_dict(), "epoch": epoch, "val": val}, self.ckpt_path)
                if val < best:
                    best = val
                    torch.save(self.model.module.state_dict(), os.path.join(self.args.save_dir, "best_model.pt"))
            dist.barrier()
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--valid", required=True)
    p.add_argument("--save-dir", default="ckpt/topk_moe")
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--bptt", type=int, default=512)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--clip", type=float, default=0.25)
    p.add_argument("--aux-weight", type=float, default=0.01)
    p.add_argument("--z-weight", type=float, default=1e-3)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=1111)
    Trainer(p.parse_args()).fit()


if __name__ == "__main__":
    main()
