#!/usr/bin/env python
"""Supervised fine-tuning of Pythia-410M on an instruction dataset, 8x MI250X GCDs (ROCm / RCCL).

    export HSA_FORCE_FINE_GRAIN_PCIE=1
    torchrun --standalone --nproc_per_node=8 19_rocm_pythia_sft.py \
        --data /shared/sft/alpaca_cleaned.json --out /shared/ckpt/pythia410m-sft
"""
import argparse
import json
import math
import os
import random
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPT = "### Instruction:\n{instruction}\n\n{input_block}### Response:\n"


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="EleutherAI/pythia-410m-deduped")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max_len", type=int, default=1024)
    ap.add_argument("--micro_bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--eval_every", type=int, default=200)
    ap.add_argument("--val_size", type=int, default=1000)
    return ap.parse_args()


class SFTData(Dataset):
    def __init__(self, rows, tok, max_len):
        self.rows, self.tok, self.max_len = rows, tok, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        input_block = f"### Input:\n{r['input']}\n\n" if r.get("input") else ""
        prompt = PROMPT.format(instruction=r["instruction"], input_block=input_block)
        p_ids = self.tok(prompt, add_special_tokens=False)["input_ids"]
        a_ids = self.tok(r["output"], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        ids = (p_ids + a_ids)[: self.max_len]
        labels = ([-100] * len(p_ids) + a_ids)[: self.max_len]  # loss on the response only
        return torch.tensor(ids), torch.tensor(labels)


def make_collate(pad_id):
    def collate(batch):
        L = max(x.numel() for x, _ in batch)
        ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
        labels = torch.full((len(batch), L), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), L), dtype=torch.long)
        for i, (x, y) in enumerate(batch):
            ids[i, : x.numel()] = x
            labels[i, : y.numel()] = y
            mask[i, : x.numel()] = 1
        return ids, mask, labels
    return collate


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    tot = torch.zeros(2, device=device, dtype=torch.float64)
    for ids, mask, labels in loader:
        ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=ids, attention_mask=mask, labels=labels)
        n = (labels[:, 1:] != -100).sum()
        tot[0] += out.loss.double() * n
        tot[1] += n
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.eos_token

    with open(args.data) as f:
        rows = json.load(f)
    random.Random(1234).shuffle(rows)  # fixed seed -> same split on every rank
    val_rows, train_rows = rows[: args.val_size], rows[args.val_size:]
    train_ds, val_ds = SFTData(train_rows, tok, args.max_len), SFTData(val_rows, tok, args.max_len)

    collate = make_collate(tok.pad_token_id)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=1234)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.micro_bs, sampler=train_sampler, collate_fn=collate,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.micro_bs, sampler=val_sampler, collate_fn=collate,
                            num_workers=2)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).to(device)
    model.config.use_cache = False
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    total_steps = len(train_loader) * args.epochs

    def lr_lambda(step):
        if step < args.warmup:
            return (step + 1) / args.warmup
        return 0.5 * (1 + math.cos(math.pi * (step - args.warmup) / max(1, total_steps - args.warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    if is_main:
        os.makedirs(args.out, exist_ok=True)
        print(f"train {len(train_ds)} val {len(val_ds)} world {world} steps {total_steps}", flush=True)

    step, best_val = 0, float("inf")
    t0 = time.time()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for ids, mask, labels in train_loader:
            ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if is_main and step % args.eval_every == 0:
                val_loss = evaluate(model.module, val_loader, device)
                elapsed = time.time() - t0
                print(f"step {step}/{total_steps} train {loss.item():.4f} val {val_loss:.4f} "
                      f"ppl {math.exp(val_loss):.2f} ({elapsed:.0f}s)", flush=True)
                if val_loss < best_val:
                    best_val = val_loss
                    model.module.save_pretrained(os.path.join(args.out, "best"), safe_serialization=True)
                    tok.save_pretrained(os.path.join(args.out, "best"))

    if is_main:
        model.module.save_pretrained(os.path.join(args.out, "final"), safe_serialization=True)
        tok.save_pretrained(os.path.join(args.out, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
