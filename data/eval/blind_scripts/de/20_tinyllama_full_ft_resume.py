#!/usr/bin/env python
"""Full fine-tuning of TinyLlama-1.1B-Chat on a function-calling SFT set (DDP, bf16 autocast).

Writes a resumable checkpoint (model + optimizer + scheduler) every --ckpt_every steps, keeps the
best one by eval loss, and exports the best weights in HF format at the end.

    torchrun --nproc_per_node 8 20_tinyllama_full_ft_resume.py --data_dir data/fncall --out runs/tinyllama-fncall
    # after a preemption:
    torchrun --nproc_per_node 8 20_tinyllama_full_ft_resume.py --data_dir data/fncall --out runs/tinyllama-fncall \
        --resume runs/tinyllama-fncall/last.pt
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="TinyLlama/TinyLlama-1.1B-Chat-v1.0")
    ap.add_argument("--data_dir", default="data/fncall")
    ap.add_argument("--out", default="runs/tinyllama-fncall")
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--ckpt_every", type=int, default=500)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--seed", type=int, default=5)
    return ap.parse_args()


def tokenize(rec, tok, max_len):
    msgs = rec["messages"]
    if rec.get("tools"):
        tool_block = "You can call these functions:\n" + json.dumps(rec["tools"], indent=1)
        msgs = [{"role": "system", "content": tool_block}] + [m for m in msgs if m["role"] != "system"]
    ids = tok.apply_chat_template(msgs)
    labels = [-100] * len(ids)
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            a = len(tok.apply_chat_template(msgs[:i], add_generation_prompt=True))
            b = len(tok.apply_chat_template(msgs[: i + 1]))
            labels[a:b] = ids[a:b]
    return ids[:max_len], labels[:max_len]


def load_split(path, tok, max_len):
    with open(path) as f:
        data = [tokenize(json.loads(l), tok, max_len) for l in f]
    return [d for d in data if any(x != -100 for x in d[1])]


def collate(batch, pad_id):
    T = max(len(i) for i, _ in batch)
    ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
    lab = torch.full((len(batch), T), -100, dtype=torch.long)
    att = torch.zeros((len(batch), T), dtype=torch.long)
    for r, (i, l) in enumerate(batch):
        ids[r, : len(i)] = torch.tensor(i)
        lab[r, : len(l)] = torch.tensor(l)
        att[r, : len(i)] = 1
    return ids, lab, att


class Collate:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        return collate(batch, self.pad_id)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    for ids, lab, att in loader:
        ids, lab, att = ids.to(device), lab.to(device), att.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
        n = (lab[:, 1:] != -100).sum()
        acc[0] += loss.double() * n
        acc[1] += n
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def save_ckpt(path, model, opt, sched, step, epoch, best):
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "step": step, "epoch": epoch, "best": best}, path)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    tok = AutoTokenizer.from_pretrained(args.model)
    train = load_split(os.path.join(args.data_dir, "train.jsonl"), tok, args.max_len)
    val = load_split(os.path.join(args.data_dir, "val.jsonl"), tok, args.max_len)
    train_sampler = DistributedSampler(train, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train, batch_size=args.bs, sampler=train_sampler, collate_fn=Collate(tok.pad_token_id),
                          num_workers=4, pin_memory=True, persistent_workers=True)
    val_dl = DataLoader(val, batch_size=args.bs, sampler=DistributedSampler(val, shuffle=False),
                        collate_fn=Collate(tok.pad_token_id), num_workers=2)

    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa")
    model.config.use_cache = False
    opt_state = sched_state = None
    step, start_epoch, best = 0, 0, float("inf")
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        opt_state, sched_state = ckpt["optimizer"], ckpt["scheduler"]
        step, start_epoch, best = ckpt["step"], ckpt["epoch"], ckpt["best"]
        del ckpt
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    steps_per_epoch = len(train_dl)
    sched = get_cosine_schedule_with_warmup(opt, args.warmup, args.epochs * steps_per_epoch)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
        sched.load_state_dict(sched_state)
        if rank == 0:
            print(f"resumed at step {step} (epoch {start_epoch})", flush=True)

    t0 = time.time()
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        done_in_epoch = step - epoch * steps_per_epoch
        for i, (ids, lab, att) in enumerate(train_dl):
            if i < done_in_epoch:
                continue
            ids, lab, att = ids.to(device), lab.to(device), att.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 25 == 0:
                r = loss.detach().clone()
                dist.all_reduce(r, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step} loss {r.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                          f"{(time.time() - t0) / 25:.2f}s/step", flush=True)
                t0 = time.time()

            if step % args.ckpt_every == 0:
                vl = evaluate(model, val_dl, device)
                if rank == 0:
                    print(f"[eval] step {step} loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)
                    if vl < best:
                        best = vl
                        save_ckpt(os.path.join(args.out, "best.pt"), model, opt, sched, step, epoch, best)
                    save_ckpt(os.path.join(args.out, "last.pt"), model, opt, sched, step, epoch, best)
                dist.barrier()

    vl = evaluate(model, val_dl, device)
    if rank == 0:
        print(f"[final] val loss {vl:.4f} (best {min(best, vl):.4f})", flush=True)
        if vl < best:
            model.module.save_pretrained(os.path.join(args.out, "hf_best"))
        else:
            export = AutoModelForCausalLM.from_pretrained(args.model)
            export.load_state_dict(torch.load(os.path.join(args.out, "best.pt"), map_location="cpu")["model"])
            export.save_pretrained(os.path.join(args.out, "hf_best"))
        tok.save_pretrained(os.path.join(args.out, "hf_best"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
