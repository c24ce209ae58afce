#!/usr/bin/env python
"""Reward model on HelpSteer2: per-response attribute scores -> preference pairs.

For each prompt, every two responses whose weighted score differs by at least --min_gap
form a pair (higher = chosen). 5% of the pairs are held out for validation.

    torchrun --nproc_per_node=8 16_rm_helpsteer_pairs.py --base ckpts/llama3.2-3b-sft --out runs/rm-hs2
"""
import argparse
import itertools
import os
import random
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

WEIGHTS = {"helpfulness": 0.65, "correctness": 0.8, "coherence": 0.45, "complexity": 0.55, "verbosity": -0.4}


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--min_gap", type=float, default=0.5)
    ap.add_argument("--val_frac", type=float, default=0.05)
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-6)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--seed", type=int, default=1)
    return ap.parse_args()


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_pairs(rows, min_gap):
    by_prompt = defaultdict(list)
    for r in rows:
        score = sum(w * r[k] for k, w in WEIGHTS.items())
        by_prompt[r["prompt"]].append((score, r["response"]))
    pairs = []
    for prompt, resps in by_prompt.items():
        for (s1, a), (s2, b) in itertools.combinations(resps, 2):
            if abs(s1 - s2) < min_gap:
                continue
            pairs.append((prompt, a, b) if s1 > s2 else (prompt, b, a))
    return pairs


class Pairs(Dataset):
    def __init__(self, pairs, tok, max_len):
        self.pairs, self.tok, self.max_len = pairs, tok, max_len

    def __len__(self):
        return len(self.pairs)

    def enc(self, prompt, resp):
        ids = self.tok.apply_chat_template([{"role": "user", "content": prompt},
                                            {"role": "assistant", "content": resp}], tokenize=True)
        return ids[-self.max_len:]

    def __getitem__(self, i):
        prompt, chosen, rejected = self.pairs[i]
        return self.enc(prompt, chosen), self.enc(prompt, rejected)


class Pad:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        seqs = [c for c, _ in batch] + [r for _, r in batch]
        L = max(map(len, seqs))
        ids = torch.full((len(seqs), L), self.pad_id, dtype=torch.long)
        att = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            att[i, : len(s)] = 1
        return ids, att


def rewards(model, ids, att):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return model(input_ids=ids, attention_mask=att).logits.squeeze(-1).float()


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    s = torch.zeros(3, device=device)
    for ids, att in loader:
        r = rewards(model, ids.to(device), att.to(device))
        n = r.numel() // 2
        s += torch.stack([(r[:n] > r[n:]).float().sum(), (r[:n] - r[n:]).sum(), s.new_tensor(n)])
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    seed_all(args.seed + rank)

    tok = AutoTokenizer.from_pretrained(args.base)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    hs = load_dataset("nvidia/HelpSteer2", split="train")
    pairs = build_pairs(hs, args.min_gap)
    random.shuffle(pairs)
    n_val = int(len(pairs) * args.val_frac)
    val_pairs, train_pairs = pairs[:n_val], pairs[n_val:]

    train_ds, val_ds = Pairs(train_pairs, tok, args.max_len), Pairs(val_pairs, tok, args.max_len)
    tr_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    va_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    pad = Pad(tok.pad_token_id)
    tr_loader = DataLoader(train_ds, batch_size=args.bs, sampler=tr_sampler, collate_fn=pad, num_workers=4,
                           pin_memory=True)
    va_loader = DataLoader(val_ds, batch_size=args.bs * 2, sampler=va_sampler, collate_fn=pad, num_workers=2)

    model = AutoModelForSequenceClassification.from_pretrained(args.base, num_labels=1, torch_dtype=torch.float32)
    model.config.pad_token_id = tok.pad_token_id
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    total = len(tr_loader) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, args.warmup, total)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"pairs: train {len(train_pairs)} val {len(val_pairs)}; steps {total}", flush=True)

    best, step = 0.0, 0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        for ids, att in tr_loader:
            r = rewards(model, ids.to(device, non_blocking=True), att.to(device, non_blocking=True))
            n = r.numel() // 2
            loss = -F.logsigmoid(r[:n] - r[n:]).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 20 == 0:
                m = torch.stack([loss.detach(), (r[:n] > r[n:]).float().mean().detach()])
                dist.all_reduce(m, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total} loss {m[0]:.4f} acc {m[1]:.3f}", flush=True)

        acc, margin = validate(model, va_loader, device)
        if rank == 0:
            print(f"[val] epoch {epoch} acc {acc:.4f} margin {margin:.3f}", flush=True)
            if acc > best:
                best = acc
                model.module.save_pretrained(os.path.join(args.out, "best"))
                tok.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
