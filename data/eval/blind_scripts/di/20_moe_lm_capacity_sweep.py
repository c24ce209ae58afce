"""Top-k MoE LM with an eval-time capacity-factor sweep.

Trains with a fixed training capacity factor and, at every eval, measures the
validation loss and token drop rate at several eval capacity factors (the
"train small / eval big" capacity trick from the Switch paper).

    torchrun --nproc_per_node=8 20_moe_lm_capacity_sweep.py --data /data/openwebtext --out ckpt/capsweep
"""
import argparse
import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


@dataclass
class TrainConfig:
    data: str = "/data/openwebtext"
    out: str = "ckpt/capsweep"
    device: str = "cuda:0"
    dtype: str = "bfloat16"
    vocab: int = 50304
    block: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_experts: int = 8
    top_k: int = 2
    train_cf: float = 1.0
    eval_cfs: list = field(default_factory=lambda: [0.5, 1.0, 1.25, 2.0, 4.0])
    batch: int = 12
    lr: float = 6e-4
    warmup: int = 2000
    max_iters: int = 60000
    aux_coef: float = 0.01
    z_coef: float = 1e-3
    eval_interval: int = 2000
    eval_batches: int = 20


def parse_config():
    ap = argparse.ArgumentParser()
    for f in dataclasses.fields(TrainConfig):
        if f.name == "eval_cfs":
            ap.add_argument("--eval-cfs", type=float, nargs="+", default=None)
        else:
            ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    ns = vars(ap.parse_args())
    cfg = TrainConfig(**{k: v for k, v in ns.items() if v is not None})
    return cfg


class Blocks(Dataset):
    def __init__(self, path, block):
        self.d = np.memmap(path, dtype=np.uint16, mode="r")
        self.block = block

    def __len__(self):
        return (len(self.d) - 1) // self.block

    def __getitem__(self, i):
        t = torch.from_numpy(self.d[i * self.block:(i + 1) * self.block + 1].astype(np.int64))
        return t[:-1], t[1:]


class MoE(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.E, self.k = c.n_experts, c.top_k
        self.capacity_factor = c.train_cf
        self.router = nn.Linear(c.n_embd, c.n_experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(c.n_embd, 4 * c.n_embd), nn.GELU(), nn.Linear(4 * c.n_embd, c.n_embd))
            for _ in range(c.n_experts))

    def forward(self, x):
        B, T, C = x.shape
        h = x.view(-1, C)
        n = h.size(0)
        logits = self.router(h).float()
        probs = logits.softmax(-1)
        w, e = probs.topk(self.k, -1)
        w = w / w.sum(-1, keepdim=True)
        cap = max(1, math.ceil(self.capacity_factor * self.k * n / self.E))
        ef, wf = e.t().reshape(-1), w.t().reshape(-1)
        tf = torch.arange(n, device=x.device).repeat(self.k)
        pos = (F.one_hot(ef, self.E).cumsum(0) - 1).gather(1, ef[:, None]).squeeze(1)
        keep = pos < cap
        ef, wf, tf = ef[keep], wf[keep], tf[keep]
        srt = ef.argsort(stable=True)
        ef, wf, tf = ef[srt], wf[srt], tf[srt]
        chunks = h[tf].split(torch.bincount(ef, minlength=self.E).tolist())
        y = torch.cat([ex(ch) for ex, ch in zip(self.experts, chunks)])
        out = torch.zeros_like(h).index_add(0, tf, (y * wf[:, None]).to(h.dtype))
        aux = self.E * (F.one_hot(e[:, 0], self.E).float().mean(0) * probs.mean(0)).sum()
        z = logits.logsumexp(-1).pow(2).mean()
        return out.view(B, T, C), aux, z, (~keep).float().mean()


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.nh = c.n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(c.n_embd), nn.LayerNorm(c.n_embd)
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd)
        self.moe = MoE(c)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.nh, -1).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.c_proj(a)
        m, aux, z, drop = self.moe(self.ln_2(x))
        return x + m, aux, z, drop


class MoEGPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.wte = nn.Embedding(c.vocab, c.n_embd)
        self.wpe = nn.Embedding(c.block, c.n_embd)
        self.h = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.lm_head = nn.Linear(c.n_embd, c.vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def set_capacity_factor(self, cf):
        for blk in self.h:
            blk.moe.capacity_factor = cf

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        aux = z = drop = 0.0
        for blk in self.h:
            x, a, zz, d = blk(x)
            aux, z, drop = aux + a, z + zz, drop + d
        L = len(self.h)
        return self.lm_head(self.ln_f(x)), aux / L, z / L, drop / L


@torch.no_grad()
def capacity_sweep(raw_model, loader, cfg, device, world):
    raw_model.eval()
    results = {}
    for cf in cfg.eval_cfs:
        raw_model.set_capacity_factor(cf)
        acc = torch.zeros(3, device=device)
        for i, (x, y) in enumerate(loader):
            if i == cfg.eval_batches:
                break
            x, y = x.to(device), y.to(device)
            with torch.autocast("cuda", dtype=getattr(torch, cfg.dtype)):
                logits, _, _, drop = raw_model(x)
            acc[0] += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
            acc[1] += y.numel()
            acc[2] += drop.float()
        dist.all_reduce(acc)
        results[cf] = {"val_loss": (acc[0] / acc[1]).item(), "drop": (acc[2] / (world * cfg.eval_batches)).item()}
    raw_model.set_capacity_factor(cfg.train_cf)
    raw_model.train()
    return results


def main():
    cfg = parse_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = cfg.device

    train_ds = Blocks(os.path.join(cfg.data, "train.bin"), cfg.block)
    val_ds = Blocks(os.path.join(cfg.data, "val.bin"), cfg.block)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=1337, drop_last=True)
    loader = DataLoader(train_ds, cfg.batch, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, cfg.batch, sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True),
                            num_workers=2, pin_memory=True)

    torch.manual_seed(1337)
    raw = MoEGPT(cfg).to(device)
    model = DDP(raw, device_ids=[local_rank])
    opt = torch.optim.AdamW(raw.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)

    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
        with open(os.path.join(cfg.out, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=2)
    sweep_log = []

    it, epoch = 0, 0
    t0 = time.time()
    while it < cfg.max_iters:
        sampler.set_epoch(epoch)
        for x, y in loader:
            lr = cfg.lr * min(1.0, (it + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * it / cfg.max_iters))
            for g in opt.param_groups:
                g["lr"] = lr
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=getattr(torch, cfg.dtype)):
                logits, aux, z, drop = model(x)
                ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                loss = ce + cfg.aux_coef * aux + cfg.z_coef * z
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
            opt.step()
            it += 1

            if it % 50 == 0:
                rep = torch.stack([ce.detach(), aux.detach(), drop.detach()])
                dist.all_reduce(rep, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"it {it} ce {rep[0]:.4f} aux {rep[1]:.4f} drop@{cfg.train_cf} {rep[2]:.2%} "
                          f"lr {lr:.2e} {(time.time() - t0) / 50:.3f}s/it", flush=True)
                t0 = time.time()

            if it % cfg.eval_interval == 0:
                res = capacity_sweep(raw, val_loader, cfg, device, world)
                if rank == 0:
                    sweep_log.append({"iter": it, **{str(k): v for k, v in res.items()}})
                    print("  capacity sweep: " + ", ".join(
                        f"cf={k}: loss {v['val_loss']:.4f} drop {v['drop']:.2%}" for k, v in res.items()), flush=True)
                    with open(os.path.join(cfg.out, "capacity_sweep.json"), "w") as f:
                        json.dump(sweep_log, f, indent=2)
                    torch.save({"model": raw.state_dict(), "opt": opt.state_dict(), "iter": it,
                                "config": dataclasses.asdict(cfg)}, os.path.join(cfg.out, "ckpt.pt"))
                dist.barrier()
            if it >= cfg.max_iters:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
