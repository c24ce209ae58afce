"""Sequence-parallel DNA encoder pretraining (masked base modelling) on 524 kb windows.

A non-overlapping conv stem (kernel = stride = 8) turns bases into 65,536 tokens;
tokens are split across an SP group and attention uses Ulysses all-to-all.
The same model class is used later for expression-track fine-tuning.

    torchrun --nproc_per_node=8 11_dna_encoder_multitask.py --config configs/dna_enc_524k.yaml
"""
import argparse
import math
import os
import time

import numpy as np
import pyfaidx
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

BASES = {"A": 0, "C": 1, "G": 2, "T": 3}
STEM = 8


class _A2A(torch.autograd.Function):
    """[B, S/P, H, D] <-> [B, S, H/P, D] using a single all_to_all_single."""

    @staticmethod
    def _run(x, group, to_heads):
        P = dist.get_world_size(group)
        B, S, H, D = x.shape
        if to_heads:
            x = x.reshape(B, S, P, H // P, D).permute(2, 0, 1, 3, 4).contiguous()
        else:
            x = x.reshape(B, P, S // P, H, D).permute(1, 0, 2, 3, 4).contiguous()
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x, group=group)
        if to_heads:
            return y.permute(1, 0, 2, 3, 4).reshape(B, P * S, H // P, D)
        return y.permute(1, 2, 0, 3, 4).reshape(B, S // P, P * H, D)

    @staticmethod
    def forward(ctx, x, group, to_heads):
        ctx.group, ctx.to_heads = group, to_heads
        return _A2A._run(x, group, to_heads)

    @staticmethod
    def backward(ctx, g):
        return _A2A._run(g.contiguous(), ctx.group, not ctx.to_heads), None, None


class EncoderLayer(nn.Module):
    def __init__(self, dim, heads, group, dropout):
        super().__init__()
        self.heads, self.group = heads, group
        self.norm_a, self.norm_f = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        B, S, C = x.shape
        q, k, v = self.qkv(self.norm_a(x)).view(B, S, 3, self.heads, C // self.heads).unbind(2)
        q, k, v = (_A2A.apply(t, self.group, True).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
        a = _A2A.apply(a.contiguous(), self.group, False).reshape(B, S, C)
        x = x + self.drop(self.proj(a))
        return x + self.drop(self.ffn(self.norm_f(x)))


class DNAEncoder(nn.Module):
    def __init__(self, cfg, group):
        super().__init__()
        d = cfg["dim"]
        self.embed = nn.Embedding(6, 64)  # A C G T N MASK
        self.stem = nn.Conv1d(64, d, kernel_size=STEM, stride=STEM)
        self.pos = nn.Embedding(cfg["window"] // STEM, d)
        self.layers = nn.ModuleList(EncoderLayer(d, cfg["heads"], group, cfg["dropout"]) for _ in range(cfg["depth"]))
        self.norm = nn.LayerNorm(d)
        # masked-base head: predict the 8 bases under each token
        self.mlm_head = nn.Linear(d, STEM * 4)
        # expression head: per-token coverage for each track (fine-tuning)
        self.track_head = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, cfg["n_tracks"]), nn.Softplus())

    def forward(self, bases, tok_offset, task="mlm"):
        h = self.stem(self.embed(bases).transpose(1, 2)).transpose(1, 2)
        pos = torch.arange(tok_offset, tok_offset + h.size(1), device=h.device)
        h = h + self.pos(pos)[None]
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h)
        if task == "mlm":
            return self.mlm_head(h).view(h.size(0), -1, 4)
        return self.track_head(h)


class RefWindows(Dataset):
    def __init__(self, fasta, bed, window, mask_rate):
        self.fasta_path, self.window, self.mask_rate = fasta, window, mask_rate
        self.fa = None
        self.regions = []
        with open(bed) as f:
            for line in f:
                c, s, e = line.split()[:3]
                self.regions.append((c, int(s)))

    def __len__(self):
        return len(self.regions)

    def __getitem__(self, i):
        if self.fa is None:
            self.fa = pyfaidx.Fasta(self.fasta_path, sequence_always_upper=True)
        chrom, start = self.regions[i]
        s = str(self.fa[chrom][start:start + self.window])
        ids = np.frombuffer(s.encode(), dtype=np.uint8)
        lut = np.full(256, 4, dtype=np.int64)
        for b, j in BASES.items():
            lut[ord(b)] = j
        tgt = torch.from_numpy(lut[ids])
        # mask whole 8-bp tokens
        tok_mask = torch.rand(self.window // STEM) < self.mask_rate
        base_mask = tok_mask.repeat_interleave(STEM) & (tgt < 4)
        inp = tgt.masked_fill(tok_mask.repeat_interleave(STEM), 5)
        tgt = tgt.masked_fill(~base_mask, -100)
        return inp, tgt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    args = ap.parse_args()
    cfg = yaml.safe_load(open(args.config))

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    sp = cfg["sp_size"]
    n_tok = cfg["window"] // STEM
    assert world % sp == 0 and n_tok % sp == 0 and cfg["heads"] % sp == 0

    sp_group = None
    for b in range(0, world, sp):
        g = dist.new_group(list(range(b, b + sp)))
        if b <= rank < b + sp:
            sp_group = g
    sp_rank, dp_rank, dp_size = rank % sp, rank // sp, world // sp
    tok_local = n_tok // sp
    base_local = tok_local * STEM

    torch.manual_seed(cfg["seed"])
    model = DNAEncoder(cfg, sp_group).cuda()
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])

    ds = RefWindows(cfg["fasta"], cfg["train_bed"], cfg["window"], cfg["mask_rate"])
    sampler = DistributedSampler(ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=cfg["seed"])
    loader = DataLoader(ds, batch_size=cfg["batch_size"], sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True, persistent_workers=True)
    total = cfg["epochs"] * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, s / cfg["warmup"]) * max(0.0, 0.5 * (1 + math.cos(math.pi * s / total))))

    out_dir = cfg["out_dir"]
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)

    step = 0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for inp, tgt in loader:
            inp = inp[:, sp_rank * base_local:(sp_rank + 1) * base_local].cuda(non_blocking=True)
            tgt = tgt[:, sp_rank * base_local:(sp_rank + 1) * base_local].cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(inp, sp_rank * tok_local, task="mlm")
            loss_sum = F.cross_entropy(logits.float().reshape(-1, 4), tgt.reshape(-1), ignore_index=-100,
                                       reduction="sum")
            cnt = (tgt != -100).sum().float()
            dist.all_reduce(cnt, group=sp_group)
            loss = loss_sum / cnt.clamp(min=1.0) * sp

            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
            opt.step()
            sched.step()
            step += 1

            if step % cfg["log_every"] == 0:
                rep = torch.stack([loss_sum.detach(), (tgt != -100).sum().float()])
                dist.all_reduce(rep)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{total} mlm_loss {(rep[0] / rep[1]).item():.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - tic) / cfg['log_every']:.2f}s/it",
                          flush=True)
                tic = time.time()

        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "cfg": cfg},
                       os.path.join(out_dir, f"dna_enc_ep{epoch:02d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
