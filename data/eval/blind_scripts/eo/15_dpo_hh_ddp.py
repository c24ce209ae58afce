#!/usr/bin/env python
"""DPO on Anthropic HH-RLHF starting from our SFT checkpoint.

    torchrun --nproc_per_node=8 15_dpo_hh_ddp.py \
        --model ckpts/sft-pythia-1.4b-hh --output_dir runs/dpo-pythia-1.4b-hh
"""
import argparse
import contextlib
import json
import math
import os
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_linear_schedule_with_warmup

IGNORE = -100
ASSISTANT = "\n\nAssistant:"


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", default="Anthropic/hh-rlhf")
    p.add_argument("--output_dir", default="runs/dpo")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--warmup_steps", type=int, default=150)
    p.add_argument("--batch_size", type=int, default=8, help="pairs per GPU per micro-step")
    p.add_argument("--grad_accum", type=int, default=1)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max_length", type=int, default=512)
    p.add_argument("--max_prompt_length", type=int, default=256)
    p.add_argument("--eval_every", type=int, default=400)
    p.add_argument("--eval_samples", type=int, default=2048)
    p.add_argument("--log_every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def split_prompt(chosen, rejected):
    # HH stores the whole dialogue; the shared prefix up to the last assistant turn is the prompt
    idx = chosen.rfind(ASSISTANT) + len(ASSISTANT)
    return chosen[:idx], chosen[idx:], rejected[rejected.rfind(ASSISTANT) + len(ASSISTANT):]


def build_features(example, tok, max_length, max_prompt_length):
    prompt, chosen, rejected = split_prompt(example["chosen"], example["rejected"])
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    c_ids = tok(chosen, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    r_ids = tok(rejected, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    longest = max(len(c_ids), len(r_ids))
    if len(p_ids) + longest > max_length:
        p_ids = p_ids[-max_prompt_length:]
    if len(p_ids) + longest > max_length:
        room = max_length - len(p_ids)
        c_ids, r_ids = c_ids[:room], r_ids[:room]
    return {
        "chosen_ids": p_ids + c_ids,
        "chosen_labels": [IGNORE] * len(p_ids) + c_ids,
        "rejected_ids": p_ids + r_ids,
        "rejected_labels": [IGNORE] * len(p_ids) + r_ids,
    }


def collate(batch, pad_id):
    seqs = [b["chosen_ids"] for b in batch] + [b["rejected_ids"] for b in batch]
    labs = [b["chosen_labels"] for b in batch] + [b["rejected_labels"] for b in batch]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, l) in enumerate(zip(seqs, labs)):
        ids[i, : len(s)] = torch.tensor(s)
        labels[i, : len(l)] = torch.tensor(l)
        mask[i, : len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def response_logps(model, batch):
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    logits = out.logits[:, :-1].float()
    labels = batch["labels"][:, 1:].clone()
    keep = labels != IGNORE
    labels[~keep] = 0
    lp = torch.gather(logits.log_softmax(-1), 2, labels.unsqueeze(-1)).squeeze(-1)
    lp = (lp * keep).sum(-1)
    half = lp.shape[0] // 2
    return lp[:half], lp[half:]


def dpo_loss(pi_c, pi_r, ref_c, ref_r, beta):
    logits = (pi_c - pi_r) - (ref_c - ref_r)
    loss = -F.logsigmoid(beta * logits).mean()
    return loss, beta * (pi_c - ref_c).detach(), beta * (pi_r - ref_r).detach()


@torch.no_grad()
def evaluate(model, ref, loader, beta, device):
    model.eval()
    loss_sum, acc_sum, margin_sum, count = 0.0, 0.0, 0.0, 0
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pi_c, pi_r = response_logps(model, batch)
            ref_c, ref_r = response_logps(ref, batch)
        loss, r_c, r_r = dpo_loss(pi_c, pi_r, ref_c, ref_r, beta)
        n = r_c.numel()
        loss_sum += loss.item() * n
        acc_sum += (r_c > r_r).float().sum().item()
        margin_sum += (r_c - r_r).sum().item()
        count += n
    model.train()
    return {
        "eval/loss": loss_sum / count,
        "eval/reward_acc": acc_sum / count,
        "eval/reward_margin": margin_sum / count,
    }


def main():
    args = get_args()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    master = rank == 0

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.eos_token

    # rank 0 tokenizes first and fills the datasets cache, the other ranks then load it
    if not master:
        dist.barrier()
    raw = load_dataset(args.dataset)
    fn = partial(build_features, tok=tok, max_length=args.max_length, max_prompt_length=args.max_prompt_length)
    train_ds = raw["train"].map(fn, remove_columns=raw["train"].column_names)
    eval_raw = raw["test"].select(range(min(args.eval_samples, len(raw["test"]))))
    eval_ds = eval_raw.map(fn, remove_columns=eval_raw.column_names)
    if master:
        dist.barrier()

    pad = tok.pad_token_id
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    eval_sampler = DistributedSampler(eval_ds, num_replicas=world, rank=rank, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=partial(collate, pad_id=pad), num_workers=2, pin_memory=True)
    eval_loader = DataLoader(eval_ds, batch_size=args.batch_size, sampler=eval_sampler,
                             collate_fn=partial(collate, pad_id=pad), num_workers=2)

    policy = AutoModelForCausalLM.from_pretrained(args.model).to(device)
    policy.config.use_cache = False
    ref = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(device).eval()
    ref.requires_grad_(False)
    model = DDP(policy, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    steps_per_epoch = len(train_loader) // args.grad_accum
    total_steps = steps_per_epoch * args.epochs
    sched = get_linear_schedule_with_warmup(opt, args.warmup_steps, total_steps)

    if master:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"world={world} pairs/step={args.batch_size * args.grad_accum * world} steps={total_steps}")

    step, best_acc = 0, -1.0
    t0 = time.time()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for i, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            last_micro = (i + 1) % args.grad_accum == 0
            with (contextlib.nullcontext() if last_micro else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pi_c, pi_r = response_logps(model, batch)
                    with torch.no_grad():
                        ref_c, ref_r = response_logps(ref, batch)
                loss, r_c, r_r = dpo_loss(pi_c, pi_r, ref_c, ref_r, args.beta)
                (loss / args.grad_accum).backward()
            if not last_micro:
                continue

            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % args.log_every == 0:
                stats = torch.stack([loss.detach(), (r_c > r_r).float().mean(), (r_c - r_r).mean()])
                dist.all_reduce(stats)
                stats /= world
                if master:
                    print(json.dumps({
                        "step": step, "loss": round(stats[0].item(), 4),
                        "reward_acc": round(stats[1].item(), 4), "margin": round(stats[2].item(), 4),
                        "lr": sched.get_last_lr()[0], "sec": round(time.time() - t0, 1),
                    }), flush=True)

            if step % args.eval_every == 0 or step == total_steps:
                metrics = evaluate(model, ref, eval_loader, args.beta, device)
                if master:
                    print(json.dumps({"step": step, **metrics}), flush=True)
                    if metrics["eval/reward_acc"] > best_acc:
                        best_acc = metrics["eval/reward_acc"]
                        model.module.save_pretrained(os.path.join(args.output_dir, "best"))
                        tok.save_pretrained(os.path.join(args.output_dir, "best"))
                dist.barrier()

    if master:
        model.module.save_pretrained(os.path.join(args.output_dir, "final"))
        tok.save_pretrained(os.path.join(args.output_dir, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
