"""Continued pretraining of a small Llama on in-house domain text (packed blocks), torchrun + DDP.

Input is a folder of .txt / .md files. Documents are tokenized once, concatenated with
EOS separators and cut into fixed-length blocks, which are cached as .npy so later runs
start immediately.

    torchrun --nproc_per_node=8 09_domain_cpt_packed.py --corpus /data/legal_corpus \
        --cache_dir /data/cache --out runs/llama1b-legal-cpt
"""
import argparse
import glob
import hashlib
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--corpus", required=True)
    p.add_argument("--cache_dir", default="cache")
    p.add_argument("--model", default="meta-llama/Llama-3.2-1B")
    p.add_argument("--out", default="runs/cpt")
    p.add_argument("--seq_len", type=int, default=4096)
    p.add_argument("--micro_bsz", type=int, default=2)
    p.add_argument("--accum", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--val_blocks", type=int, default=256)
    p.add_argument("--ckpt_every", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def list_docs(corpus):
    files = sorted(glob.glob(os.path.join(corpus, "**", "*.txt"), recursive=True)
                   + glob.glob(os.path.join(corpus, "**", "*.md"), recursive=True))
    return files


def build_or_load_blocks(files, tok, seq_len, cache_dir, show_progress):
    key = hashlib.md5(("|".join(files) + tok.name_or_path + str(seq_len)).encode()).hexdigest()[:12]
    path = os.path.join(cache_dir, f"blocks_{key}.npy")
    if os.path.exists(path):
        return np.load(path, mmap_mode="r")

    os.makedirs(cache_dir, exist_ok=True)
    buf = []
    for fn in tqdm(files, desc="tokenizing", disable=not show_progress):
        with open(fn, encoding="utf-8", errors="ignore") as f:
            text = f.read()
        if len(text) < 200:
            continue
        buf.extend(tok(text, add_special_tokens=False)["input_ids"])
        buf.append(tok.eos_token_id)
    n_blocks = len(buf) // seq_len
    arr = np.asarray(buf[: n_blocks * seq_len], dtype=np.uint32).reshape(n_blocks, seq_len)
    np.save(path, arr)
    return arr


class BlockDataset(Dataset):
    def __init__(self, blocks):
        self.blocks = blocks

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        x = torch.from_numpy(np.asarray(self.blocks[i], dtype=np.int64))
        return {"input_ids": x, "labels": x.clone()}


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        acc[0] += loss.float()
        acc[1] += 1
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    files = list_docs(args.corpus)
    blocks = build_or_load_blocks(files, tok, args.seq_len, args.cache_dir, show_progress=rank == 0)

    # last val_blocks blocks are held out; deterministic so all ranks agree
    val_ds = BlockDataset(blocks[-args.val_blocks:])
    train_ds = BlockDataset(blocks[: -args.val_blocks])
    if rank == 0:
        print(f"{len(files)} files -> {len(blocks)} blocks of {args.seq_len} tokens", flush=True)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.micro_bsz, sampler=train_sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.micro_bsz, sampler=val_sampler, num_workers=2)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32,
                                                 attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.to(device)
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    total = (len(train_dl) // args.accum) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, min(500, total // 20), total)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    step = 0
    t0 = time.time()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for i, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            if (i + 1) % args.accum != 0:
                with model.no_sync():
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = model(**batch).loss / args.accum
                    loss.backward()
                continue
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss / args.accum
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                l = loss.detach() * args.accum
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    tps = 10 * args.accum * args.micro_bsz * args.seq_len * world / (time.time() - t0)
                    print(f"step {step}/{total} loss {l.item():.4f} ppl {math.exp(l.item()):.1f} "
                          f"lr {sched.get_last_lr()[0]:.2e} tok/s {tps:,.0f}", flush=True)
                t0 = time.time()

            if step % args.ckpt_every == 0:
                vl = validate(model, val_dl, device)
                if rank == 0:
                    print(f"step {step} val_loss {vl:.4f}", flush=True)
                    model.module.save_pretrained(os.path.join(args.out, f"step_{step}"))
                    tok.save_pretrained(os.path.join(args.out, f"step_{step}"))
                dist.barrier()

    vl = validate(model, val_dl, device)
    if rank == 0:
        print(f"final val_loss {vl:.4f}", flush=True)
        model.module.save_pretrained(os.path.join(args.out, "final"))
        tok.save_pretrained(os.path.join(args.out, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
