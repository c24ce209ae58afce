"""LLM-QAT style data-free-ish quantization-aware training with self-distillation.

The full-precision model is the teacher; a copy with fake-quantized weights
(int4, per-channel, asymmetric, straight-through gradients) is the student and
is trained to match the teacher's token distributions. Text shards are
tokenized once into a flat uint32 token file that later runs reuse.

    torchrun --nproc_per_node=8 14_llmqat_selfdistill.py --text_glob "corpus/generated/*.txt"
"""
import argparse
import copy
import glob
import hashlib
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer


def args_():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="microsoft/phi-2")
    ap.add_argument("--text_glob", default="corpus/generated/*.txt")
    ap.add_argument("--cache_dir", default="cache/tokens")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--w_bits", type=int, default=4)
    ap.add_argument("--temp", type=float, default=1.0)
    ap.add_argument("--out", default="ckpt/phi2-llmqat-w4")
    return ap.parse_args()


class WQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, bits):
        qmax = 2 ** bits - 1
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        scale = ((hi - lo) / qmax).clamp(min=1e-6)
        zp = torch.round(-lo / scale)
        return (torch.clamp(torch.round(w / scale) + zp, 0, qmax) - zp) * scale

    @staticmethod
    def backward(ctx, g):
        return g, None


class QLinear(nn.Module):
    def __init__(self, lin, bits):
        super().__init__()
        self.weight = lin.weight
        self.bias = lin.bias
        self.bits = bits

    def forward(self, x):
        return F.linear(x, WQuant.apply(self.weight, self.bits), self.bias)


def make_student(model, bits):
    for name, mod in list(model.named_modules()):
        for cname, child in list(mod.named_children()):
            if isinstance(child, nn.Linear) and cname != "lm_head":
                setattr(mod, cname, QLinear(child, bits))
    return model


def tokenized_cache(tok, pattern, cache_dir):
    files = sorted(glob.glob(pattern))
    key = hashlib.md5(("|".join(files) + tok.name_or_path).encode()).hexdigest()[:12]
    path = os.path.join(cache_dir, f"tokens_{key}.npy")
    if not os.path.exists(path):
        os.makedirs(cache_dir, exist_ok=True)
        chunks = []
        for fn in files:
            with open(fn, encoding="utf-8") as f:
                for doc in f.read().split("\n\n"):
                    if doc.strip():
                        chunks.append(np.asarray(tok(doc).input_ids + [tok.eos_token_id], dtype=np.uint32))
        np.save(path, np.concatenate(chunks))
    return np.load(path, mmap_mode="r")


class Windows(Dataset):
    def __init__(self, tokens, seq):
        self.tokens, self.seq = tokens, seq

    def __len__(self):
        return len(self.tokens) // self.seq

    def __getitem__(self, i):
        return torch.from_numpy(self.tokens[i * self.seq:(i + 1) * self.seq].astype(np.int64))


def main():
    args = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    tokens = tokenized_cache(tok, args.text_glob, args.cache_dir)
    ds = Windows(tokens, args.seq)
    sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=4, pin_memory=True)

    fp = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(dev)
    teacher = copy.deepcopy(fp).eval().requires_grad_(False)
    student = make_student(fp.float(), args.w_bits)
    model = DDP(student, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    total = len(loader) // args.accum * args.epochs
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total, pct_start=0.03,
                                                anneal_strategy="cos")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(tokens) / 1e6:.1f}M tokens, {len(ds)} windows, {total} optimizer steps", flush=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for i, ids in enumerate(loader):
            if step >= total:
                break
            ids = ids.to(dev, non_blocking=True)
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                t_logits = teacher(input_ids=ids).logits
            boundary = (i + 1) % args.accum == 0
            ctx = model.no_sync() if not boundary else torch.enable_grad()
            with ctx, torch.autocast("cuda", dtype=torch.bfloat16):
                s_logits = model(input_ids=ids).logits
                T = args.temp
                loss = F.kl_div(F.log_softmax(s_logits.float() / T, -1).flatten(0, 1),
                                F.log_softmax(t_logits.float() / T, -1).flatten(0, 1),
                                log_target=True, reduction="batchmean") * T * T
                (loss / args.accum).backward()
            if not boundary:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 10 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total} kl {l.item():.5f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 10:.2f}s/step", flush=True)
                t0 = time.time()

        if rank == 0:
            sd = {k: v.to(torch.bfloat16) for k, v in model.module.state_dict().items()}
            torch.save({"state_dict": sd, "w_bits": args.w_bits, "epoch": epoch},
                       os.path.join(args.out, f"student_ep{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
