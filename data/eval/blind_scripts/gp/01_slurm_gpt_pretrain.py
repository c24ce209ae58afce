#!/usr/bin/env python3
"""GPT-style pretraining on pre-tokenized shards, launched from Slurm.

Submitted with scripts/pretrain.sbatch:

    #!/bin/bash
    #SBATCH --job-name=gpt-small
    #SBATCH --nodes=4
    #SBATCH --ntasks-per-node=8
    #SBATCH --gpus-per-node=8
    #SBATCH --cpus-per-task=8
    #SBATCH --time=48:00:00
    #SBATCH --output=logs/%x-%j.out

    srun python pretrain.py --config configs/gpt_small.yaml

The same file is the launcher and the training entry point: started by srun it
works out the rendezvous from the Slurm environment and hands over to torchrun,
which starts one worker per GPU on the node.
"""
import argparse
import math
import os
import subprocess
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


# --------------------------------------------------------------------------- #
# Slurm -> torchrun
# --------------------------------------------------------------------------- #
def slurm_hostnames():
    nodelist = os.environ["SLURM_JOB_NODELIST"]
    out = subprocess.check_output(["scontrol", "show", "hostnames", nodelist], text=True)
    return out.split()


def launch_torchrun(argv):
    hosts = slurm_hostnames()
    nnodes = int(os.environ["SLURM_NNODES"])
    node_rank = int(os.environ["SLURM_NODEID"])
    gpus_per_node = int(os.environ.get("SLURM_GPUS_ON_NODE", "8"))
    master_addr = hosts[0]
    master_port = 20000 + int(os.environ["SLURM_JOB_ID"]) % 10000
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc_per_node={gpus_per_node}",
        f"--node_rank={node_rank}",
        f"--master_addr={master_addr}",
        f"--master_port={master_port}",
        os.path.abspath(__file__),
        *argv,
    ]
    print(f"[{hosts[node_rank]}] exec: {' '.join(cmd)}", flush=True)
    os.execv(sys.executable, cmd)


# --------------------------------------------------------------------------- #
# Model
# --------------------------------------------------------------------------- #
class Block(nn.Module):
    def __init__(self, d_model, n_head, dropout):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, n_head, dropout=dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x, mask):
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, seq_len, d_model, n_layer, n_head, dropout=0.0):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList([Block(d_model, n_head, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok.weight
        mask = torch.triu(torch.full((seq_len, seq_len), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, idx):
        t = idx.size(1)
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x, self.mask[:t, :t])
        return self.head(self.ln_f(x))


# --------------------------------------------------------------------------- #
# Data
# --------------------------------------------------------------------------- #
class TokenChunks(Dataset):
    def __init__(self, path, seq_len):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len
        self.n = (len(self.data) - 1) // seq_len

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        s = i * self.seq_len
        chunk = torch.from_numpy(self.data[s:s + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


def lr_at(step, cfg):
    if step < cfg["warmup_steps"]:
        return cfg["lr"] * (step + 1) / cfg["warmup_steps"]
    progress = (step - cfg["warmup_steps"]) / max(1, cfg["max_steps"] - cfg["warmup_steps"])
    return cfg["min_lr"] + 0.5 * (cfg["lr"] - cfg["min_lr"]) * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model, loader, device, max_batches):
    model.eval()
    tot = torch.zeros(2, device=device)
    for i, (x, y) in enumerate(loader):
        if i >= max_batches:
            break
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1), reduction="sum")
        tot[0] += loss
        tot[1] += y.numel()
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def train(args):
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.get("seed", 1337))

    micro = cfg["micro_batch_size"]
    accum = cfg["global_batch_size"] // (micro * world)
    assert accum * micro * world == cfg["global_batch_size"], "global batch must divide evenly"

    train_ds = TokenChunks(os.path.join(cfg["data_dir"], "train.bin"), cfg["seq_len"])
    val_ds = TokenChunks(os.path.join(cfg["data_dir"], "val.bin"), cfg["seq_len"])
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.get("seed", 1337))
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=micro, sampler=train_sampler,
                          num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=micro, sampler=val_sampler, num_workers=2, pin_memory=True)

    model = GPT(cfg["vocab_size"], cfg["seq_len"], cfg["d_model"], cfg["n_layer"], cfg["n_head"],
                cfg.get("dropout", 0.0)).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95),
                            weight_decay=cfg.get("weight_decay", 0.1), fused=True)

    out_dir = cfg["out_dir"]
    ckpt_path = os.path.join(out_dir, "ckpt.pt")
    step, epoch = 0, 0
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        step, epoch = ckpt["step"], ckpt["epoch"]
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        print(f"world={world} micro={micro} accum={accum} resume_step={step}", flush=True)

    model.train()
    t0 = time.time()
    while step < cfg["max_steps"]:
        train_sampler.set_epoch(epoch)
        it = iter(train_dl)
        n_batches = len(train_dl) // accum
        for _ in range(n_batches):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg)
            for micro_step in range(accum):
                x, y = next(it)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                sync = micro_step == accum - 1
                ctx = model.no_sync() if not sync else torch.enable_grad()
                with ctx:
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        logits = model(x)
                        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
                    (loss / accum).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.get("grad_clip", 1.0))
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if rank == 0 and step % cfg.get("log_every", 20) == 0:
                dt = time.time() - t0
                t0 = time.time()
                print(f"step {step} loss {loss.item():.4f} lr {lr_at(step, cfg):.2e} {dt:.1f}s", flush=True)

            if step % cfg.get("eval_every", 1000) == 0:
                val_loss = evaluate(model, val_dl, device, cfg.get("eval_batches", 50))
                if rank == 0:
                    print(f"step {step} val_loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}", flush=True)
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "step": step, "epoch": epoch, "cfg": cfg}, ckpt_path + ".tmp")
                    os.replace(ckpt_path + ".tmp", ckpt_path)
                dist.barrier()
            if step >= cfg["max_steps"]:
                break
        epoch += 1

    dist.destroy_process_group()


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    return p.parse_args()


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:
        train(parse_args())
    else:
        launch_torchrun(sys.argv[1:])
