#!/usr/bin/env python
"""GRPO fine-tuning on GSM8K with a rule-based correctness reward.

    torchrun --nproc_per_node 8 01_grpo_gsm8k_ddp.py --model Qwen/Qwen2.5-1.5B-Instruct
"""
import argparse
import contextlib
import json
import os
import re
import time

import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

SYSTEM_PROMPT = (
    "Solve the math problem step by step. "
    "Write the final numeric answer on the last line after '####'."
)
ANSWER_RE = re.compile(r"####\s*\$?(-?[\d,]*\.?\d+)")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2.5-1.5B-Instruct")
    p.add_argument("--output_dir", default="runs/grpo_gsm8k")
    p.add_argument("--prompts_per_rank", type=int, default=4)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--max_prompt_len", type=int, default=256)
    p.add_argument("--max_new_tokens", type=int, default=320)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--kl_coef", type=float, default=0.04)
    p.add_argument("--clip_eps", type=float, default=0.2)
    p.add_argument("--micro_batch", type=int, default=8)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--warmup_steps", type=int, default=20)
    p.add_argument("--save_every", type=int, default=100)
    p.add_argument("--log_every", type=int, default=5)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


def build_prompt(tokenizer, question):
    msgs = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def extract_answer(text):
    m = ANSWER_RE.search(text)
    if m is None:
        return None
    return m.group(1).replace(",", "")


def reward_fn(completions, golds):
    out = []
    for text, gold in zip(completions, golds):
        pred = extract_answer(text)
        r = 0.0
        if pred is not None:
            r += 0.1  # format bonus
            try:
                if abs(float(pred) - float(gold)) < 1e-4:
                    r += 1.0
            except ValueError:
                pass
        out.append(r)
    return out


def token_logprobs(model, input_ids, attention_mask, prompt_len):
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    logits = logits[:, prompt_len - 1:-1].float()
    targets = input_ids[:, prompt_len:]
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def completion_mask_from(completion_ids, eos_id):
    is_eos = completion_ids == eos_id
    L = completion_ids.size(1)
    first = torch.full((completion_ids.size(0),), L, dtype=torch.long, device=completion_ids.device)
    has = is_eos.any(dim=1)
    first[has] = is_eos.int().argmax(dim=1)[has]
    pos = torch.arange(L, device=completion_ids.device).unsqueeze(0)
    return (pos <= first.unsqueeze(1)).long()


@torch.no_grad()
def rollout(policy, ref_model, tokenizer, batch, args, device):
    enc = tokenizer(batch["prompt"], return_tensors="pt", padding=True, truncation=True,
                    max_length=args.max_prompt_len).to(device)
    prompt_ids = enc.input_ids.repeat_interleave(args.group_size, dim=0)
    prompt_mask = enc.attention_mask.repeat_interleave(args.group_size, dim=0)

    policy.eval()
    seqs = policy.module.generate(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        do_sample=True,
        temperature=args.temperature,
        top_p=1.0,
        max_new_tokens=args.max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
    )
    policy.train()

    prompt_len = prompt_ids.size(1)
    completion_ids = seqs[:, prompt_len:]
    comp_mask = completion_mask_from(completion_ids, tokenizer.eos_token_id)
    attn = torch.cat([prompt_mask, comp_mask], dim=1)

    old_logp = token_logprobs(policy.module, seqs, attn, prompt_len)
    ref_logp = token_logprobs(ref_model, seqs, attn, prompt_len)

    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    golds = [a for a in batch["answer"] for _ in range(args.group_size)]
    rewards = torch.tensor(reward_fn(texts, golds), dtype=torch.float32, device=device)
    grouped = rewards.view(-1, args.group_size)
    adv = (grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + 1e-4)

    return {
        "seqs": seqs,
        "attn": attn,
        "comp_mask": comp_mask,
        "old_logp": old_logp,
        "ref_logp": ref_logp,
        "adv": adv.view(-1),
        "rewards": rewards,
        "prompt_len": prompt_len,
        "sample": texts[0],
    }


def grpo_loss(policy, roll, idx, args):
    p = roll["prompt_len"]
    new_logp = token_logprobs(policy, roll["seqs"][idx], roll["attn"][idx], p)
    mask = roll["comp_mask"][idx].float()
    adv = roll["adv"][idx].unsqueeze(1)
    ratio = torch.exp(new_logp - roll["old_logp"][idx])
    pg = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1 - args.clip_eps, 1 + args.clip_eps))
    log_r = roll["ref_logp"][idx] - new_logp
    kl = torch.exp(log_r) - log_r - 1
    per_tok = pg + args.kl_coef * kl
    loss = ((per_tok * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
    mean_kl = ((kl * mask).sum() / mask.sum().clamp(min=1)).detach()
    return loss, mean_kl


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    policy = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(device)
    ref_model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(device)
    ref_model.eval().requires_grad_(False)
    policy = DDP(policy, device_ids=[local_rank])

    ds = load_dataset("openai/gsm8k", "main", split="train")
    ds = ds.map(lambda ex: {"prompt": build_prompt(tokenizer, ex["question"]),
                            "answer": ex["answer"].split("####")[-1].strip().replace(",", "")})
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.prompts_per_rank, sampler=sampler, drop_last=True,
                        collate_fn=lambda rows: {"prompt": [r["prompt"] for r in rows],
                                                 "answer": [r["answer"] for r in rows]})

    total_steps = len(loader) * args.epochs
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, total_steps)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        log_f = open(os.path.join(args.output_dir, "train_log.jsonl"), "a")

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            t0 = time.time()
            roll = rollout(policy, ref_model, tokenizer, batch, args, device)
            if roll["adv"].abs().sum() == 0:
                # every group got identical rewards -> nothing to learn from this batch
                continue

            n = roll["seqs"].size(0)
            perm = torch.randperm(n, device=device)
            chunks = perm.split(args.micro_batch)
            kl_acc = 0.0
            for i, idx in enumerate(chunks):
                ctx = policy.no_sync() if i < len(chunks) - 1 else contextlib.nullcontext()
                with ctx:
                    loss, mkl = grpo_loss(policy, roll, idx, args)
                    (loss / len(chunks)).backward()
                kl_acc += mkl.item() / len(chunks)
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            stats = torch.tensor([roll["rewards"].mean().item(), (roll["rewards"] > 1.0).float().mean().item(),
                                  kl_acc, roll["comp_mask"].sum(1).float().mean().item()], device=device)
            dist.all_reduce(stats)
            stats /= world
            if rank == 0 and step % args.log_every == 0:
                rec = {"step": step, "epoch": epoch, "reward": stats[0].item(), "acc": stats[1].item(),
                       "kl": stats[2].item(), "len": stats[3].item(), "grad_norm": grad_norm.item(),
                       "lr": scheduler.get_last_lr()[0], "sec": time.time() - t0}
                print(json.dumps(rec), flush=True)
                log_f.write(json.dumps(rec) + "\n")
                log_f.flush()

            if step % args.save_every == 0:
                if rank == 0:
                    ckpt = os.path.join(args.output_dir, f"step_{step}")
                    policy.module.save_pretrained(ckpt, safe_serialization=True)
                    tokenizer.save_pretrained(ckpt)
                dist.barrier()

    if rank == 0:
        policy.module.save_pretrained(os.path.join(args.output_dir, "final"))
        tokenizer.save_pretrained(os.path.join(args.output_dir, "final"))
        log_f.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
