"""
Multi-epoch MoE pretraining on a (small) code corpus. Config in YAML via OmegaConf,
CLI overrides as key=value.

    torchrun --nproc_per_node=8 19_code_moe_omegaconf.py configs/code_moe.yaml train.epochs=8
"""
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEFAULT_CFG = OmegaConf.create({
    "data": {"root": "/data/the_stack_py_tok", "seq_len": 2048, "num_workers": 6},
    "model": {"vocab": 49152, "dim": 1024, "layers": 16, "heads": 16, "experts": 16, "top_k": 2,
              "capacity_factor": 1.25, "aux_coef": 0.01, "z_coef": 0.001},
    "train": {"epochs": 6, "batch_size": 4, "lr": 3e-4, "min_lr": 3e-5, "warmup_steps": 1000,
              "weight_decay": 0.1, "clip": 1.0, "log_every": 20, "out_dir": "runs/code_moe"},
})


class CodeTokens(Dataset):
    def __init__(self, path, seq_len):
        self.path, self.seq_len = path, seq_len
        self.n = (os.path.getsize(path) // 2 - 1) // seq_len
        self.mm = None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.mm is None:
            self.mm = np.memmap(self.path, dtype=np.uint16, mode="r")
        t = torch.from_numpy(self.mm[i * self.seq_len:(i + 1) * self.seq_len + 1].astype(np.int64))
        return {"input_ids": t[:-1], "labels": t[1:]}


class GroupedExperts(nn.Module):
    """All experts as one batched weight; tokens are packed into [experts, capacity, dim]."""

    def __init__(self, dim, n, k, cf):
        super().__init__()
        self.n, self.k, self.cf = n, k, cf
        self.router = nn.Linear(dim, n, bias=False)
        self.w13 = nn.Parameter(torch.empty(n, dim, 2 * 4 * dim))
        self.w2 = nn.Parameter(torch.empty(n, 4 * dim, dim))
        nn.init.trunc_normal_(self.w13, std=0.02)
        nn.init.trunc_normal_(self.w2, std=0.02)
        self.losses = None

    def forward(self, x):
        B, T, D = x.shape
        x = x.reshape(-1, D)
        N = x.size(0)
        logits = self.router(x).float()
        probs = logits.softmax(-1)
        w, e = probs.topk(self.k, -1)
        w = w / w.sum(-1, keepdim=True)
        aux = self.n * (F.one_hot(e, self.n).float().mean((0, 1)) * probs.mean(0)).sum()
        z = logits.logsumexp(-1).pow(2).mean()
        self.losses = (aux, z)
        C = math.ceil(self.cf * N * self.k / self.n)
        ef, wf = e.t().reshape(-1), w.t().reshape(-1)
        tf = torch.arange(N, device=x.device).repeat(self.k)
        oh = F.one_hot(ef, self.n)
        pos = (oh.cumsum(0) * oh).sum(-1) - 1
        keep = pos < C
        slot = ef[keep] * C + pos[keep]
        buf = x.new_zeros(self.n * C, D)
        buf[slot] = x[tf[keep]]
        g, u = torch.bmm(buf.view(self.n, C, D), self.w13).chunk(2, dim=-1)
        out = torch.bmm(F.silu(g) * u, self.w2).view(-1, D)
        y = torch.zeros(N, D, device=x.device, dtype=out.dtype)
        y.index_add_(0, tf[keep], out[slot] * wf[keep, None].to(out.dtype))
        return y.to(x.dtype).view(B, T, D)


class Layer(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.heads = m.heads
        self.norm1 = nn.LayerNorm(m.dim, bias=False)
        self.norm2 = nn.LayerNorm(m.dim, bias=False)
        self.qkv = nn.Linear(m.dim, 3 * m.dim, bias=False)
        self.o = nn.Linear(m.dim, m.dim, bias=False)
        self.experts = GroupedExperts(m.dim, m.experts, m.top_k, m.capacity_factor)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D))
        return x + self.experts(self.norm2(x))


class CodeMoE(nn.Module):
    def __init__(self, m, seq_len):
        super().__init__()
        self.embed = nn.Embedding(m.vocab, m.dim)
        self.pos = nn.Embedding(seq_len, m.dim)
        self.layers = nn.ModuleList(Layer(m) for _ in range(m.layers))
        self.norm = nn.LayerNorm(m.dim, bias=False)
        self.head = nn.Linear(m.dim, m.vocab, bias=False)
        self.aux_coef, self.z_coef = m.aux_coef, m.z_coef

    def forward(self, input_ids, labels):
        x = self.embed(input_ids) + self.pos(torch.arange(input_ids.size(1), device=input_ids.device))
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x)).float()
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        aux = torch.stack([l.experts.losses[0] for l in self.layers]).mean()
        z = torch.stack([l.experts.losses[1] for l in self.layers]).mean()
        return ce, ce + self.aux_coef * aux + self.z_coef * z


def main():
    cfg = DEFAULT_CFG
    args = sys.argv[1:]
    if args and args[0].endswith(".yaml"):
        cfg = OmegaConf.merge(cfg, OmegaConf.load(args.pop(0)))
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(args))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_ds = CodeTokens(os.path.join(cfg.data.root, "train.bin"), cfg.data.seq_len)
    val_ds = CodeTokens(os.path.join(cfg.data.root, "val.bin"), cfg.data.seq_len)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=world, rank=rank, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg.train.batch_size, sampler=train_sampler,
                              num_workers=cfg.data.num_workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=cfg.train.batch_size, sampler=val_sampler, num_workers=2)

    model = DDP(CodeMoE(cfg.model, cfg.data.seq_len).to(device), device_ids=[local_rank])
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.train.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=cfg.train.lr, betas=(0.9, 0.95))
    total = cfg.train.epochs * len(train_loader)

    def lr_lambda(s):
        if s < cfg.train.warmup_steps:
            return (s + 1) / cfg.train.warmup_steps
        p = (s - cfg.train.warmup_steps) / max(1, total - cfg.train.warmup_steps)
        lo = cfg.train.min_lr / cfg.train.lr
        return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * p))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    if rank == 0:
        os.makedirs(cfg.train.out_dir, exist_ok=True)
        OmegaConf.save(cfg, os.path.join(cfg.train.out_dir, "config.yaml"))
        print(f"{len(train_ds)} train sequences, {len(train_loader)} steps/epoch/rank, {total} steps total")

    step = 0
    for epoch in range(cfg.train.epochs):
        model.train()
        t0 = time.time()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                ce, loss = model(**batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.clip)
            opt.step()
            sched.step()
            step += 1
            if step % cfg.train.log_every == 0:
                c = ce.detach().clone()
                dist.all_reduce(c, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{total} ce {c.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                          f"{(time.time() - t0) / cfg.train.log_every:.3f}s/it", flush=True)
                t0 = time.time()

        model.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for batch in val_loader:
                batch = {k: v.to(device) for k, v in batch.items()}
                ce, _ = model(**batch)
                acc += torch.stack([ce.float(), torch.ones((), device=device)])
        dist.all_reduce(acc)
        if rank == 0:
            vl = (acc[0] / acc[1]).item()
            print(f"epoch {epoch} val ce {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "cfg": OmegaConf.to_container(cfg)},
                       os.path.join(cfg.train.out_dir, f"epoch_{epoch}.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
