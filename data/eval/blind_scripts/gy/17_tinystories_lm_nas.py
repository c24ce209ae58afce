#!/usr/bin/env python3
"""
Pretrain a ~30M-param Llama-style LM on TinyStories.

  node 0  'big'    192.168.10.2  RTX 3090
  node 1  'small'  192.168.10.3  RTX 2080 Ti  (Turing: no bf16, so fp16 + GradScaler everywhere)

Raw text, token cache and checkpoints all live on the NAS, NFS-mounted at
/mnt/nas on both nodes.

  torchrun --nnodes=2 --nproc_per_node=1 --node_rank=<n> --master_addr=192.168.10.2 \
      --master_port=29700 tinystories_lm.py --wandb
"""
import argparse
import datetime
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
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--raw", default="/mnt/nas/datasets/tinystories/TinyStoriesV2-GPT4-train.txt")
    p.add_argument("--cache", default="/mnt/nas/datasets/tinystories/tokens_llama32k.u16")
    p.add_argument("--run-dir", default="/mnt/nas/runs/tinystories-30m")
    p.add_argument("--tokenizer", default="hf-internal-testing/llama-tokenizer")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--micro-bs", type=int, default=16)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--save-every", type=int, default=1000)
    p.add_argument("--wandb", action="store_true")
    return p.parse_args()


def build_cache(raw_path, cache_path, tokenizer):
    """Tokenize once; write to a temp name and rename, so nobody can see half a file."""
    ids = []
    with open(raw_path, encoding="utf-8") as f:
        for story in f.read().split("<|endoftext|>"):
            story = story.strip()
            if story:
                ids.extend(tokenizer.encode(story, add_special_tokens=False))
                ids.append(tokenizer.eos_token_id)
    tmp = f"{cache_path}.tmp.{os.getpid()}"
    np.asarray(ids, dtype=np.uint16).tofile(tmp)
    os.replace(tmp, cache_path)


class Blocks(Dataset):
    def __init__(self, path, seq_len):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return len(self.data) // self.seq_len

    def __getitem__(self, i):
        s = i * self.seq_len
        return torch.from_numpy(self.data[s:s + self.seq_len].astype(np.int64))


def lr_lambda(step, warmup, total):
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # long timeout: the very first run spends a good while tokenizing on rank 0 while the rest wait
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    master = rank == 0

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    # shared NFS: exactly one process in the whole job writes the cache
    if master and not os.path.exists(args.cache):
        print("building token cache ...", flush=True)
        build_cache(args.raw, args.cache, tok)
    dist.barrier()
    ds = Blocks(args.cache, args.seq_len)
    sampler = DistributedSampler(ds, shuffle=True, seed=1234, drop_last=True)
    dl = DataLoader(ds, batch_size=args.micro_bs, sampler=sampler, num_workers=2, pin_memory=True,
                    drop_last=True)

    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=512, intermediate_size=1408,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                      max_position_embeddings=args.seq_len, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    updates_per_epoch = len(dl) // args.accum
    total_updates = updates_per_epoch * args.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, 500, total_updates))
    scaler = torch.cuda.amp.GradScaler()

    start_update = 0
    ckpt_path = os.path.join(args.run_dir, "latest.pt")
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        scaler.load_state_dict(ckpt["scaler"])
        start_update = ckpt["update"]
        if ckpt["world"] != world or ckpt["micro_bs"] != args.micro_bs:
            raise SystemExit("checkpoint was written with a different world size / batch, refusing to resume")

    run = None
    if master:
        os.makedirs(args.run_dir, exist_ok=True)
        n_params = sum(p.numel() for p in model.module.parameters())
        print(f"{n_params / 1e6:.1f}M params, {len(ds)} blocks, {updates_per_epoch} updates/epoch", flush=True)
        if args.wandb:
            import wandb
            run = wandb.init(project="tinystories", config=vars(args), resume="allow", id="ts30m")

    update = 0
    t0 = time.time()
    model.train()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        loss_acc = torch.zeros((), device=device)
        for i, x in enumerate(dl):
            if update < start_update:  # fast-forward through the already-seen part
                if (i + 1) % args.accum == 0:
                    update += 1
                continue
            x = x.to(device, non_blocking=True)
            sync = (i + 1) % args.accum == 0
            if sync:
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = model(input_ids=x, labels=x).loss / args.accum
                scaler.scale(loss).backward()
            else:
                with model.no_sync():
                    with torch.autocast("cuda", dtype=torch.float16):
                        loss = model(input_ids=x, labels=x).loss / args.accum
                    scaler.scale(loss).backward()
            loss_acc += loss.detach()
            if not sync:
                continue

            scaler.unscale_(opt)
            gnorm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            sched.step()
            update += 1

            if update % 20 == 0:
                dist.all_reduce(loss_acc, op=dist.ReduceOp.AVG)
                if master:
                    tps = 20 * args.accum * args.micro_bs * args.seq_len * world / (time.time() - t0)
                    print(f"upd {update} loss {loss_acc.item():.4f} gnorm {gnorm:.2f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {tps / 1e3:.1f}k tok/s", flush=True)
                    if run is not None:
                        run.log({"loss": loss_acc.item(), "lr": sched.get_last_lr()[0],
                                 "grad_norm": float(gnorm), "tok_per_s": tps}, step=update)
                t0 = time.time()
            loss_acc.zero_()

            if update % args.save_every == 0:
                if master:
                    state = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                             "sched": sched.state_dict(), "scaler": scaler.state_dict(),
                             "update": update, "world": world, "micro_bs": args.micro_bs}
                    torch.save(state, ckpt_path + ".tmp")
                    os.replace(ckpt_path + ".tmp", ckpt_path)
                dist.barrier()

    if master:
        model.module.save_pretrained(os.path.join(args.run_dir, "final"))
        tok.save_pretrained(os.path.join(args.run_dir, "final"))
        if run is not None:
            run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
