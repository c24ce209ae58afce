"""bf16 MoE decoder pretraining (top-2, 16 experts, replicated) with DDP.

Router logits are kept in fp32 and a z-loss is used, but long runs still hit the
occasional non-finite loss at high learning rates; those batches are skipped.

    torchrun --nproc_per_node=8 15_moe_bf16_pretrain.py --cfg configs/moe_16e_760m.json
"""
import argparse
import json
import logging
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger(__name__)

DEFAULT_CFG = {
    "train_bin": "/data/pile_dedup/train.bin",
    "val_bin": "/data/pile_dedup/val.bin",
    "out_dir": "/ckpt/moe_16e_760m",
    "vocab": 50304, "ctx": 2048, "d_model": 1536, "n_layer": 16, "n_head": 16,
    "n_experts": 16, "top_k": 2, "capacity_factor": 1.25,
    "micro_bs": 4, "lr": 3e-4, "min_lr": 3e-5, "warmup": 2000, "max_iters": 150000,
    "aux_coef": 0.01, "z_coef": 1e-3, "grad_clip": 1.0,
    "log_interval": 10, "eval_interval": 2000, "eval_iters": 40, "ckpt_interval": 2000,
}


class BinDataset(Dataset):
    def __init__(self, path, ctx):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.ctx = ctx

    def __len__(self):
        return (len(self.data) - 1) // self.ctx

    def __getitem__(self, i):
        chunk = np.array(self.data[i * self.ctx: (i + 1) * self.ctx + 1], dtype=np.int64)
        return torch.from_numpy(chunk[:-1]), torch.from_numpy(chunk[1:])


class Top2MoE(nn.Module):
    def __init__(self, d, n_exp, cf):
        super().__init__()
        self.n_exp, self.cf = n_exp, cf
        self.router = nn.Linear(d, n_exp, bias=False)
        self.fc1 = nn.ModuleList(nn.Linear(d, 4 * d, bias=False) for _ in range(n_exp))
        self.fc2 = nn.ModuleList(nn.Linear(4 * d, d, bias=False) for _ in range(n_exp))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n = x.size(0)
        with torch.autocast("cuda", enabled=False):
            logits = self.router(x.float())
        probs = logits.softmax(-1)
        w, idx = probs.topk(2, -1)
        w = w / w.sum(-1, keepdim=True)
        cap = math.ceil(self.cf * 2 * n / self.n_exp)

        e = idx.t().reshape(-1)
        gw = w.t().reshape(-1)
        tok = torch.arange(n, device=x.device).repeat(2)
        pos = (F.one_hot(e, self.n_exp).cumsum(0) - 1).gather(1, e[:, None]).squeeze(1)
        keep = pos < cap
        e, gw, tok = e[keep], gw[keep], tok[keep]
        srt = torch.argsort(e, stable=True)
        e, gw, tok = e[srt], gw[srt], tok[srt]
        sizes = torch.bincount(e, minlength=self.n_exp).tolist()
        outs = [f2(F.gelu(f1(chunk))) for f1, f2, chunk in zip(self.fc1, self.fc2, x[tok].split(sizes))]
        y = torch.zeros_like(x).index_add(0, tok, (torch.cat(outs) * gw[:, None]).to(x.dtype))

        aux = self.n_exp * (F.one_hot(idx[:, 0], self.n_exp).float().mean(0) * probs.mean(0)).sum()
        z = torch.logsumexp(logits, -1).square().mean()
        return y.view(shape), aux, z, 1.0 - keep.float().mean()


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.nh = c["n_head"]
        d = c["d_model"]
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        self.moe = Top2MoE(d, c["n_experts"], c["capacity_factor"])

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.nh, C // self.nh).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        m, aux, z, drop = self.moe(self.ln2(x))
        return x + m, aux, z, drop


class MoEGPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.wte = nn.Embedding(c["vocab"], c["d_model"])
        self.wpe = nn.Embedding(c["ctx"], c["d_model"])
        self.h = nn.ModuleList(Block(c) for _ in range(c["n_layer"]))
        self.ln_f = nn.LayerNorm(c["d_model"])
        self.lm_head = nn.Linear(c["d_model"], c["vocab"], bias=False)
        self.wte.weight = self.lm_head.weight
        for name, prm in self.named_parameters():
            if name.endswith("c_proj.weight") or ".fc2." in name:
                nn.init.normal_(prm, 0.0, 0.02 / math.sqrt(2 * c["n_layer"]))

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        aux = z = drop = 0.0
        for blk in self.h:
            x, a, zz, d = blk(x)
            aux, z, drop = aux + a, z + zz, drop + d
        n = len(self.h)
        return self.lm_head(self.ln_f(x)), aux / n, z / n, drop / n


def get_lr(it, c):
    if it < c["warmup"]:
        return c["lr"] * (it + 1) / c["warmup"]
    if it > c["max_iters"]:
        return c["min_lr"]
    r = (it - c["warmup"]) / (c["max_iters"] - c["warmup"])
    return c["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * r)) * (c["lr"] - c["min_lr"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    c = dict(DEFAULT_CFG)
    ns = ap.parse_args()
    if ns.cfg:
        with open(ns.cfg) as f:
            c.update(json.load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")

    torch.manual_seed(1337)
    model = MoEGPT(c).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=c["lr"], betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    train_ds, val_ds = BinDataset(c["train_bin"], c["ctx"]), BinDataset(c["val_bin"], c["ctx"])
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=1337, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, c["micro_bs"], sampler=train_sampler, num_workers=6, pin_memory=True,
                          drop_last=True)
    val_dl = DataLoader(val_ds, c["micro_bs"], sampler=val_sampler, num_workers=2, pin_memory=True)

    it, epoch = 0, 0
    ckpt = os.path.join(c["out_dir"], "ckpt.pt")
    if os.path.exists(ckpt):
        st = torch.load(ckpt, map_location=device)
        model.module.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        it, epoch = st["iter"], st["epoch"]
        logger.info("resumed at iter %d", it)
    if rank == 0:
        os.makedirs(c["out_dir"], exist_ok=True)

    skipped = 0
    t0 = time.time()
    while it < c["max_iters"]:
        train_sampler.set_epoch(epoch)
        for x, y in train_dl:
            lr = get_lr(it, c)
            for g in opt.param_groups:
                g["lr"] = lr
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, aux, z, drop = model(x)
                ce = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
                loss = ce + c["aux_coef"] * aux + c["z_coef"] * z
            if not torch.isfinite(loss):
                skipped += 1
                logger.warning("non-finite loss at iter %d (skipped %d so far)", it, skipped)
                opt.zero_grad(set_to_none=True)
                continue
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), c["grad_clip"])
            opt.step()
            opt.zero_grad(set_to_none=True)
            it += 1

            if it % c["log_interval"] == 0:
                s = torch.stack([ce.detach(), aux.detach(), z.detach(), drop.detach(), gnorm])
                dist.all_reduce(s, op=dist.ReduceOp.AVG)
                dt = (time.time() - t0) / c["log_interval"]
                t0 = time.time()
                logger.info("iter %d ce %.4f aux %.4f z %.3f drop %.2f%% gnorm %.2f lr %.2e %.0fms",
                            it, s[0], s[1], s[2], 100 * s[3], s[4], lr, 1000 * dt)

            if it % c["eval_interval"] == 0:
                model.eval()
                acc = torch.zeros(2, device=device)
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                    for k, (vx, vy) in enumerate(val_dl):
                        if k >= c["eval_iters"]:
                            break
                        vl, _, _, _ = model(vx.to(device))
                        acc += torch.stack([F.cross_entropy(vl.float().view(-1, vl.size(-1)),
                                                            vy.to(device).view(-1), reduction="sum"),
                                            torch.tensor(float(vy.numel()), device=device)])
                dist.all_reduce(acc)
                model.train()
                logger.info("iter %d val_loss %.4f", it, (acc[0] / acc[1]).item())

            if it % c["ckpt_interval"] == 0 and rank == 0:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "iter": it,
                            "epoch": epoch, "cfg": c}, ckpt)
            if it >= c["max_iters"]:
                break
        epoch += 1

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
