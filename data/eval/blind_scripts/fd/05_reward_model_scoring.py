#!/usr/bin/env python
"""Generate responses with a policy checkpoint and score them with a reward model.

    torchrun --nproc_per_node 8 05_reward_model_scoring.py \
        --policy ckpts/sft-7b --reward_model ckpts/rm-7b --prompts data/hh_test.jsonl

Prompts are sharded across ranks; rewards are collected on rank 0, which writes
summary statistics and the per-sample records.
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--policy", required=True)
    p.add_argument("--reward_model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--output", default="eval/rm_scores.jsonl")
    p.add_argument("--gen_batch_size", type=int, default=16)
    p.add_argument("--rm_batch_size", type=int, default=32)
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top_p", type=float, default=0.9)
    p.add_argument("--max_prompt_len", type=int, default=768)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def read_prompts(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_policy(path, device):
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16)
    model.to(device).eval()
    return model, tok


def load_reward_model(path):
    device = torch.device("cuda:0")
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    rm = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, torch_dtype=torch.bfloat16
    )
    rm.config.pad_token_id = tok.pad_token_id
    rm.to(device).eval()
    return rm, tok, device


@torch.no_grad()
def generate(model, tok, prompts, args, device):
    enc = tok(prompts, return_tensors="pt", padding=True, truncation=True,
              max_length=args.max_prompt_len).to(device)
    out = model.generate(
        **enc,
        do_sample=True,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        pad_token_id=tok.pad_token_id,
    )
    return tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)


@torch.no_grad()
def score(rm, rm_tok, prompts, responses, rm_device, max_len=2048):
    texts = [p + r for p, r in zip(prompts, responses)]
    enc = rm_tok(texts, return_tensors="pt", padding=True, truncation=True,
                 max_length=max_len).to(rm_device)
    return rm(**enc).logits.squeeze(-1).float().cpu().tolist()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    records = read_prompts(args.prompts)
    mine = [(i, r) for i, r in enumerate(records) if i % world == rank]

    policy, pol_tok = load_policy(args.policy, device)
    rm, rm_tok, rm_device = load_reward_model(args.reward_model)

    # generate everything first, then free the policy before scoring
    generated = []
    t0 = time.time()
    for s in range(0, len(mine), args.gen_batch_size):
        chunk = mine[s:s + args.gen_batch_size]
        prompts = [r["prompt"] for _, r in chunk]
        responses = generate(policy, pol_tok, prompts, args, device)
        generated.extend((i, p, resp) for (i, _), p, resp in zip(chunk, prompts, responses))
        if rank == 0:
            print(f"gen {s + len(chunk)}/{len(mine)} ({time.time() - t0:.0f}s)", flush=True)
    del policy
    torch.cuda.empty_cache()

    results = []
    for s in range(0, len(generated), args.rm_batch_size):
        chunk = generated[s:s + args.rm_batch_size]
        rewards = score(rm, rm_tok, [c[1] for c in chunk], [c[2] for c in chunk], rm_device)
        for (i, p, resp), rwd in zip(chunk, rewards):
            results.append({"idx": i, "prompt": p, "response": resp, "reward": rwd})

    gathered = [None] * world if rank == 0 else None
    dist.gather_object(results, gathered, dst=0)

    if rank == 0:
        flat = sorted((r for part in gathered for r in part), key=lambda r: r["idx"])
        assert len(flat) == len(records)
        rewards = [r["reward"] for r in flat]
        summary = {
            "policy": args.policy,
            "reward_model": args.reward_model,
            "n": len(rewards),
            "reward_mean": statistics.fmean(rewards),
            "reward_std": statistics.pstdev(rewards),
            "reward_median": statistics.median(rewards),
            "frac_positive": sum(r > 0 for r in rewards) / len(rewards),
            "seconds": time.time() - t0,
        }
        os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
        with open(args.output, "w") as f:
            for r in flat:
                f.write(json.dumps(r) + "\n")
        with open(os.path.splitext(args.output)[0] + "_summary.json", "w") as f:
            json.dump(summary, f, indent=2)
        print(json.dumps(summary, indent=2))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
