#!/usr/bin/env python
"""Offline preference optimisation (sigmoid DPO / IPO / hinge) that survives preemption.

Writes <out>/latest.pt every --ckpt_every updates; relaunching the same command resumes from it.

    torchrun --nproc_per_node=8 01_pref_opt_preemptible.py --model ckpts/gemma-2-2b-sft \
        --data data/helpsteer_pairs.jsonl --loss ipo --beta 0.1 --out runs/ipo-gemma2b
"""
import argparse
import contextlib
import json
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_linear_schedule_with_warmup

IGNORE = -100


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--loss", choices=["sigmoid", "ipo", "hinge"], default="sigmoid")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=5e-7)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--bs", type=int, default=2)
    p.add_argument("--accum", type=int, default=8)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max_len", type=int, default=1024)
    p.add_argument("--max_prompt_len", type=int, default=512)
    p.add_argument("--ckpt_every", type=int, default=100)
    p.add_argument("--seed", type=int, default=11)
    return p.parse_args()


class Prefs(Dataset):
    def __init__(self, path, tok, max_len, max_prompt_len):
        self.rows = []
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                prompt = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                                 add_generation_prompt=True)
                p = tok(prompt, add_special_tokens=False).input_ids
                c = tok(r["chosen"] + "<end_of_turn>", add_special_tokens=False).input_ids
                j = tok(r["rejected"] + "<end_of_turn>", add_special_tokens=False).input_ids
                if len(p) + max(len(c), len(j)) > max_len:
                    p = p[-max_prompt_len:]
                c, j = c[: max_len - len(p)], j[: max_len - len(p)]
                self.rows.append((p, c, j))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class Collate:
    def __init__(self, pad):
        self.pad = pad

    def __call__(self, batch):
        seqs = [(p, c) for p, c, _ in batch] + [(p, j) for p, _, j in batch]
        T = max(len(a) + len(b) for a, b in seqs)
        ids = torch.full((len(seqs), T), self.pad, dtype=torch.long)
        lab = torch.full((len(seqs), T), IGNORE, dtype=torch.long)
        att = torch.zeros((len(seqs), T), dtype=torch.long)
        for k, (a, b) in enumerate(seqs):
            ids[k, : len(a) + len(b)] = torch.tensor(a + b)
            lab[k, len(a): len(a) + len(b)] = torch.tensor(b)
            att[k, : len(a) + len(b)] = 1
        return ids, att, lab


def logps(model, ids, att, lab, average):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(input_ids=ids, attention_mask=att).logits
    logits = logits[:, :-1].float()
    tgt = lab[:, 1:]
    m = (tgt != IGNORE).float()
    lp = logits.log_softmax(-1).gather(-1, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    lp = (lp * m).sum(-1)
    if average:
        lp = lp / m.sum(-1).clamp(min=1)
    n = lp.shape[0] // 2
    return lp[:n], lp[n:]


def preference_loss(pc, pr, rc, rr, kind, beta):
    h = (pc - pr) - (rc - rr)
    if kind == "sigmoid":
        losses = -F.logsigmoid(beta * h)
    elif kind == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        losses = torch.relu(1 - beta * h)
    return losses.mean(), h.detach()


def rng_state():
    return {"py": random.getstate(), "np": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state()}


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    data = Prefs(args.data, tok, args.max_len, args.max_prompt_len)
    sampler = DistributedSampler(data, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(data, batch_size=args.bs, sampler=sampler, collate_fn=Collate(tok.pad_token_id),
                        num_workers=2, pin_memory=True)
    updates_per_epoch = len(loader) // args.accum

    policy = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32, attn_implementation="eager")
    policy.config.use_cache = False
    ref = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16, attn_implementation="eager")
    ref.to(dev).eval().requires_grad_(False)

    latest = os.path.join(args.out, "latest.pt")
    ckpt = None
    if os.path.exists(latest):
        ckpt = torch.load(latest, map_location="cpu", weights_only=False)
        if ckpt["world_size"] != world:
            raise RuntimeError(f"checkpoint was written with world_size={ckpt['world_size']}, now {world}")
        policy.load_state_dict(ckpt["model"])
    policy.to(dev)
    model = DDP(policy, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = get_linear_schedule_with_warmup(opt, args.warmup, updates_per_epoch * args.epochs)
    update = 0
    if ckpt is not None:
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        update = ckpt["update"]
        if rank == 0:
            print(f"resumed from update {update}", flush=True)
        del ckpt
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    average = args.loss == "ipo"
    for epoch in range(update // updates_per_epoch, args.epochs):
        sampler.set_epoch(epoch)
        skip = (update - epoch * updates_per_epoch) * args.accum  # micro-batches already done this epoch
        for it, (ids, att, lab) in enumerate(loader):
            if it < skip:
                continue
            if it >= updates_per_epoch * args.accum:
                break
            ids, att, lab = ids.to(dev), att.to(dev), lab.to(dev)
            boundary = (it + 1) % args.accum == 0
            with contextlib.nullcontext() if boundary else model.no_sync():
                pc, pr = logps(model, ids, att, lab, average)
                with torch.no_grad():
                    rc, rr = logps(ref, ids, att, lab, average)
                loss, h = preference_loss(pc, pr, rc, rr, args.loss, args.beta)
                (loss / args.accum).backward()
            if not boundary:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            update += 1

            if update % 10 == 0:
                s = torch.stack([loss.detach(), (h > 0).float().mean(), h.mean()])
                dist.all_reduce(s, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} upd {update} loss {s[0]:.4f} acc {s[1]:.3f} h {s[2]:.3f} "
                          f"lr {sched.get_last_lr()[0]:.2e}", flush=True)

            if update % args.ckpt_every == 0:
                if rank == 0:
                    tmp = latest + ".tmp"
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                                "update": update, "world_size": world, "rng": rng_state()}, tmp)
                    os.replace(tmp, latest)
                dist.barrier()

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.out, "final"), safe_serialization=True)
        tok.save_pretrained(os.path.join(args.out, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
