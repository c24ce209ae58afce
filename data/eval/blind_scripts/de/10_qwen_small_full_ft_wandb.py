#!/usr/bin/env python
"""Full fine-tune of Qwen2-1.5B on a math word-problem SFT set, DDP + bf16 autocast, tracked in W&B.

    torchrun --nproc_per_node 8 10_qwen_small_full_ft_wandb.py --train data/gsm8k_sft_train.jsonl \
        --test data/gsm8k_sft_test.jsonl --wandb_project math-sft
"""
import argparse
import json
import math
import os
import re
import time

import torch
import torch.distributed as dist
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_constant_schedule_with_warmup

SYSTEM_PROMPT = "Solve the problem step by step. Put the final answer after '####'."


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2-1.5B-Instruct")
    p.add_argument("--train", default="data/gsm8k_sft_train.jsonl")
    p.add_argument("--test", default="data/gsm8k_sft_test.jsonl")
    p.add_argument("--out", default="ckpt/qwen2-1.5b-gsm8k")
    p.add_argument("--max_len", type=int, default=1024)
    p.add_argument("--bs", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--n_samples", type=int, default=16)
    p.add_argument("--wandb_project", default="math-sft")
    p.add_argument("--run_name", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def to_messages(rec):
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": rec["question"]},
        {"role": "assistant", "content": rec["answer"]},
    ]


def encode(rec, tok, max_len):
    msgs = to_messages(rec)
    prompt_ids = tok.apply_chat_template(msgs[:-1], add_generation_prompt=True)
    full_ids = tok.apply_chat_template(msgs)[:max_len]
    labels = [-100] * len(prompt_ids) + full_ids[len(prompt_ids):]
    return full_ids, labels[: len(full_ids)]


def read(path, tok, max_len):
    with open(path) as f:
        recs = [json.loads(l) for l in f]
    return recs, [encode(r, tok, max_len) for r in recs]


def collate(batch, pad_id):
    L = max(len(x) for x, _ in batch)
    ids = torch.full((len(batch), L), pad_id)
    lab = torch.full((len(batch), L), -100)
    for i, (x, y) in enumerate(batch):
        ids[i, : len(x)] = torch.tensor(x)
        lab[i, : len(y)] = torch.tensor(y)
    return ids, lab, (ids != pad_id).long()


def extract_answer(text):
    m = re.search(r"####\s*(-?[\d,\.]+)", text)
    return m.group(1).replace(",", "").rstrip(".") if m else None


@torch.no_grad()
def eval_loss(model, loader, dev):
    model.eval()
    s = torch.zeros(2, device=dev)
    for ids, lab, att in loader:
        ids, lab, att = ids.to(dev), lab.to(dev), att.to(dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
        n = (lab[:, 1:] != -100).sum()
        s += torch.stack([loss.float() * n, n.float()])
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


@torch.no_grad()
def sample_generations(module, tok, recs, dev, n):
    module.eval()
    rows, correct = [], 0
    for rec in recs[:n]:
        msgs = to_messages(rec)[:-1]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt").to(dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = module.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=384,
                                  do_sample=False, pad_token_id=tok.pad_token_id)
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        ok = extract_answer(text) == extract_answer(rec["answer"])
        correct += int(ok)
        rows.append([rec["question"], text, ok])
    module.train()
    return rows, correct / max(1, len(rows))


def main():
    args = args_()
    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    train_recs, train_data = read(args.train, tok, args.max_len)
    test_recs, test_data = read(args.test, tok, args.max_len)

    pad_id = tok.pad_token_id
    sampler = DistributedSampler(train_data, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_data, batch_size=args.bs, sampler=sampler,
                          collate_fn=lambda b: collate(b, pad_id), num_workers=2)
    test_dl = DataLoader(test_data, batch_size=args.bs, sampler=DistributedSampler(test_data, shuffle=False),
                         collate_fn=lambda b: collate(b, pad_id), num_workers=2)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).to(dev)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, fused=True)
    sched = get_constant_schedule_with_warmup(opt, args.warmup)

    step, best = 0, float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for ids, lab, att in train_dl:
            ids, lab, att = ids.to(dev), lab.to(dev), att.to(dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 10 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"train/loss": l.item(), "train/grad_norm": gn.item(),
                               "train/lr": sched.get_last_lr()[0],
                               "train/sec_per_step": (time.time() - t0) / 10}, step=step)
                t0 = time.time()

        vl = eval_loss(model, test_dl, dev)
        if rank == 0:
            rows, acc = sample_generations(model.module, tok, test_recs, dev, args.n_samples)
            table = wandb.Table(columns=["question", "generation", "correct"], data=rows)
            wandb.log({"eval/loss": vl, "eval/ppl": math.exp(vl), "eval/sample_acc": acc,
                       "eval/samples": table, "epoch": epoch}, step=step)
            print(f"epoch {epoch}: eval loss {vl:.4f}, sample acc {acc:.3f}", flush=True)
            if vl < best:
                best = vl
                model.module.save_pretrained(os.path.join(args.out, "best"), safe_serialization=True)
                tok.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.out, "last"))
        tok.save_pretrained(os.path.join(args.out, "last"))
        wandb.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
