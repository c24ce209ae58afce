"""Character-level causal DNA LM on hg38 (HyenaDNA-style data, GPT-NeoX backbone).

Training intervals come from the HyenaDNA bed file (chrom, start, end, split). The reference
is encoded once to uint8 arrays (one .npy per chromosome) in --cache_dir so later runs
skip FASTA parsing.

    torchrun --nproc_per_node=8 13_hg38_charlm_cache.py --fasta /data/hg38/hg38.ml.fa \
        --bed /data/hg38/human-sequences.bed --cache_dir /data/hg38/cache --seq_len 16384
"""
import argparse
import math
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from pyfaidx import Fasta
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

# 0 pad, 1 bos, 2 eos, 3..7 = A C G T N
LUT = np.full(256, 7, dtype=np.uint8)
for i, c in enumerate("ACGT"):
    LUT[ord(c)] = LUT[ord(c.lower())] = 3 + i
COMP = np.array([0, 1, 2, 6, 5, 4, 3, 7], dtype=np.uint8)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fasta", required=True)
    ap.add_argument("--bed", required=True)
    ap.add_argument("--cache_dir", required=True)
    ap.add_argument("--out", default="runs/hg38_charlm")
    ap.add_argument("--seq_len", type=int, default=16384)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--max_steps", type=int, default=50000)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--d_model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    return ap.parse_args()


def build_genome_cache(fasta_path, chroms, cache_dir):
    os.makedirs(cache_dir, exist_ok=True)
    fa = None
    for c in chroms:
        path = os.path.join(cache_dir, f"{c}.npy")
        if os.path.exists(path):
            continue
        if fa is None:
            fa = Fasta(fasta_path, sequence_always_upper=False, as_raw=True)
        raw = np.frombuffer(fa[c][:].encode("ascii"), dtype=np.uint8)
        np.save(path, LUT[raw])


class GenomeIntervals(Dataset):
    def __init__(self, bed, split, cache_dir, seq_len, rc_aug):
        df = bed[bed["split"] == split].reset_index(drop=True)
        self.chrom, self.start, self.end = df["chrom"].values, df["start"].values, df["end"].values
        self.genome = {c: np.load(os.path.join(cache_dir, f"{c}.npy"), mmap_mode="r") for c in set(self.chrom)}
        self.seq_len, self.rc_aug = seq_len, rc_aug

    def __len__(self):
        return len(self.chrom)

    def __getitem__(self, i):
        g = self.genome[self.chrom[i]]
        mid = (self.start[i] + self.end[i]) // 2
        s = max(0, mid - self.seq_len // 2)
        e = min(len(g), s + self.seq_len - 1)
        x = np.asarray(g[s:e])
        if self.rc_aug and np.random.rand() < 0.5:
            x = COMP[x[::-1]]
        x = np.concatenate([[1], x]).astype(np.int64)
        if len(x) < self.seq_len:
            x = np.pad(x, (0, self.seq_len - len(x)))
        return torch.from_numpy(x)


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * step / args.warmup
    t = (step - args.warmup) / max(1, args.max_steps - args.warmup)
    return args.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


@torch.no_grad()
def eval_ppl(model, loader, device, limit=64):
    model.eval()
    tot = torch.zeros(2, device=device, dtype=torch.float64)
    for k, x in enumerate(loader):
        if k == limit:
            break
        x = x.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=x).logits[:, :-1]
        y = x[:, 1:]
        tot[0] += F.cross_entropy(logits.float().transpose(1, 2), y, ignore_index=0, reduction="sum")
        tot[1] += (y != 0).sum()
    dist.all_reduce(tot)
    model.train()
    return math.exp(tot[0].item() / tot[1].item())


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    bed = pd.read_csv(args.bed, sep="\t", names=["chrom", "start", "end", "split"])
    chroms = sorted(bed["chrom"].unique())
    build_genome_cache(args.fasta, chroms, args.cache_dir)

    train_ds = GenomeIntervals(bed, "train", args.cache_dir, args.seq_len, rc_aug=True)
    valid_ds = GenomeIntervals(bed, "valid", args.cache_dir, args.seq_len, rc_aug=False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=4, pin_memory=True,
                        drop_last=True, persistent_workers=True)
    valid_loader = DataLoader(valid_ds, args.batch_size, num_workers=2,
                              sampler=DistributedSampler(valid_ds, shuffle=False, drop_last=True))

    cfg = GPTNeoXConfig(vocab_size=8, hidden_size=args.d_model, num_hidden_layers=args.layers,
                        num_attention_heads=args.d_model // 64, intermediate_size=4 * args.d_model,
                        max_position_embeddings=args.seq_len, rotary_pct=1.0, bos_token_id=1, eos_token_id=2,
                        use_parallel_residual=False)
    model = GPTNeoXForCausalLM(cfg).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_ds)} train intervals, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params",
              flush=True)
    step, epoch, t0 = 0, 0, time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for x in loader:
            x = x.to(device, non_blocking=True)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=x).logits[:, :-1]
            loss = F.cross_entropy(logits.float().transpose(1, 2), x[:, 1:], ignore_index=0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            if rank == 0 and step % 50 == 0:
                tok_s = 50 * args.batch_size * args.seq_len * dist.get_world_size() / (time.time() - t0)
                print(f"step {step} loss {loss.item():.4f} {tok_s / 1e6:.2f}M tok/s", flush=True)
                t0 = time.time()
            if step % 2000 == 0:
                ppl = eval_ppl(model, valid_loader, device)
                if rank == 0:
                    print(f"step {step} valid ppl {ppl:.4f}", flush=True)
                    torch.save({"model": model.module.state_dict(), "step": step, "cfg": cfg.to_dict()},
                               os.path.join(args.out, "last.pt"))
                dist.barrier()
            if step >= args.max_steps:
                break
        epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
