"""Structured attention-head pruning for GPT-2 models, followed by a short
recovery fine-tune.

Head importance is the accumulated |dL/d head_mask| (Michel et al., 2019) over
a calibration set that is split across the GPUs; the scores are summed over
ranks, the lowest-scoring heads are removed with `prune_heads`, and the smaller
model is fine-tuned with DDP on WikiText-103.
"""
import argparse
import itertools
import json
import math
import os
import time

import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from transformers import GPT2LMHeadModel, GPT2TokenizerFast, get_cosine_schedule_with_warmup


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2-large")
    ap.add_argument("--prune_ratio", type=float, default=0.3)
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--calib_batches", type=int, default=64)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--log_every", type=int, default=50)
    ap.add_argument("--eval_every", type=int, default=500)
    ap.add_argument("--out", default="pruned/gpt2-large-h30")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def load_blocks(tok, block):
    raw = load_dataset("wikitext", "wikitext-103-raw-v1")

    def tokenize(b):
        return tok(b["text"])

    def group(b):
        ids = list(itertools.chain(*b["input_ids"]))
        n = (len(ids) // block) * block
        chunks = [ids[i:i + block] for i in range(0, n, block)]
        return {"input_ids": chunks}

    tokd = raw.map(tokenize, batched=True, remove_columns=["text"], num_proc=16)
    tokd = tokd.remove_columns(["attention_mask"])
    blocks = tokd.map(group, batched=True, num_proc=16)
    blocks.set_format("torch")
    return blocks["train"], blocks["validation"]


def compute_head_importance(model, loader, n_batches, device):
    cfg = model.config
    head_mask = torch.ones(cfg.n_layer, cfg.n_head, device=device, requires_grad=True)
    importance = torch.zeros(cfg.n_layer, cfg.n_head, device=device)
    model.eval()
    for i, batch in enumerate(loader):
        if i >= n_batches:
            break
        ids = batch["input_ids"].to(device)
        out = model(ids, labels=ids, head_mask=head_mask)
        out.loss.backward()
        importance += head_mask.grad.abs().detach()
        head_mask.grad = None
        model.zero_grad(set_to_none=True)
    # layer-wise L2 normalisation as in the paper
    importance /= importance.norm(dim=-1, keepdim=True).clamp(min=1e-20)
    return importance


def heads_to_prune(importance, ratio):
    n_layer, n_head = importance.shape
    k = int(ratio * n_layer * n_head)
    order = importance.flatten().argsort()
    plan = {}
    for idx in order[:k].tolist():
        layer, head = divmod(idx, n_head)
        plan.setdefault(layer, []).append(head)
    # never remove every head of a layer
    for layer, heads in plan.items():
        if len(heads) == n_head:
            keep = int(importance[layer].argmax())
            heads.remove(keep)
    return plan


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    for batch in loader:
        ids = batch["input_ids"].to(device)
        loss = model(ids, labels=ids).loss
        acc[0] += loss.double() * ids.numel()
        acc[1] += ids.numel()
    dist.all_reduce(acc)
    model.train()
    return math.exp((acc[0] / acc[1]).item())


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed)

    tok = GPT2TokenizerFast.from_pretrained(args.model)
    if rank != 0:
        dist.barrier()
    train_ds, val_ds = load_blocks(tok, args.block)
    if rank == 0:
        dist.barrier()

    model = GPT2LMHeadModel.from_pretrained(args.model).to(device)

    # ---- 1. head importance on the calibration split, summed over ranks ----
    calib_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    calib_loader = DataLoader(train_ds, batch_size=args.bs, sampler=calib_sampler, num_workers=2)
    importance = compute_head_importance(model, calib_loader, args.calib_batches, device)
    dist.all_reduce(importance)
    plan = heads_to_prune(importance, args.prune_ratio)
    model.prune_heads(plan)
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        removed = sum(len(v) for v in plan.values())
        print(f"pruned {removed} heads, {n_params / 1e6:.1f}M params left", flush=True)

    # ---- 2. recovery fine-tune ----
    model.train()
    model = DDP(model, device_ids=[local_rank])
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed + 1, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    val_shard = Subset(val_ds, range(rank, len(val_ds), world))
    val_loader = DataLoader(val_shard, batch_size=args.bs, num_workers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = get_cosine_schedule_with_warmup(opt, args.warmup, args.steps)

    step, epoch = 0, 0
    t0 = time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            ids = batch["input_ids"].to(device, non_blocking=True)
            loss = model(ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if rank == 0 and step % args.log_every == 0:
                avg = loss.detach().clone()
                dist.all_reduce(avg, op=dist.ReduceOp.AVG)
                dt = (time.time() - t0) / args.log_every
                print(f"step {step:5d} loss {avg.item():.4f} lr {sched.get_last_lr()[0]:.2e} {dt:.3f}s/step",
                      flush=True)
                t0 = time.time()

            if step % args.eval_every == 0:
                ppl = evaluate(model.module, val_loader, device)
                if rank == 0:
                    print(f"[eval] step {step} val ppl {ppl:.2f}", flush=True)
            if step >= args.steps:
                break
        epoch += 1

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        model.module.save_pretrained(args.out)
        tok.save_pretrained(args.out)
        with open(os.path.join(args.out, "pruned_heads.json"), "w") as f:
            json.dump({str(k): v for k, v in plan.items()}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
