"""
GRPO fine-tuning of a small instruct model on GSM8K.

Plain PyTorch DDP, one process per GPU. Each rank samples its own prompts,
generates `group_size` completions per prompt with HF generate(), scores them
with a rule-based answer checker and takes one policy-gradient step with a
KL penalty against a frozen reference copy of the initial model.

    torchrun --standalone --nproc_per_node=8 01_grpo_gsm8k_ddp.py \
        --model Qwen/Qwen2.5-0.5B-Instruct --group_size 8 --output_dir runs/grpo_gsm8k
"""
import argparse
import math
import os
import re
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

SYSTEM = "Solve the problem step by step. Put the final number after '####'."
ANS_RE = re.compile(r"####\s*(-?[\d,\.]+)")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    p.add_argument("--output_dir", default="runs/grpo_gsm8k")
    p.add_argument("--prompts_per_rank", type=int, default=4)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--max_prompt_len", type=int, default=256)
    p.add_argument("--max_new_tokens", type=int, default=320)
    p.add_argument("--temperature", type=float, default=0.9)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--warmup_steps", type=int, default=20)
    p.add_argument("--log_every", type=int, default=5)
    p.add_argument("--save_every", type=int, default=200)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


def extract_answer(text):
    m = ANS_RE.search(text)
    if m is None:
        return None
    return m.group(1).replace(",", "").rstrip(".")


def reward_fn(completions, answers):
    out = []
    for c, a in zip(completions, answers):
        pred = extract_answer(c)
        r = 0.0
        if pred is not None:
            r += 0.1
            try:
                if abs(float(pred) - float(a)) < 1e-4:
                    r += 1.0
            except ValueError:
                pass
        out.append(r)
    return out


def token_logprobs(model, input_ids, attention_mask, n_prompt):
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    logits = logits[:, n_prompt - 1:-1, :].float()
    targets = input_ids[:, n_prompt:]
    return torch.gather(F.log_softmax(logits, dim=-1), 2, targets.unsqueeze(-1)).squeeze(-1)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)
    is_main = rank == 0

    tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    policy = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(device)
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.config.use_cache = False
    ref = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(device)
    ref.eval().requires_grad_(False)

    policy = DDP(policy, device_ids=[local_rank])

    ds = load_dataset("openai/gsm8k", "main", split="train")

    def to_prompt(ex):
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ex["question"]}]
        return {
            "prompt": tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
            "target": ex["answer"].split("####")[-1].strip().replace(",", ""),
        }

    ds = ds.map(to_prompt, remove_columns=ds.column_names)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=args.prompts_per_rank, sampler=sampler,
                        collate_fn=lambda b: ([x["prompt"] for x in b], [x["target"] for x in b]))

    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.99))
    total_steps = args.epochs * len(loader)
    sched = get_cosine_schedule_with_warmup(opt, args.warmup_steps, total_steps)

    if is_main:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"world={world} steps={total_steps} prompts/step={args.prompts_per_rank * world}", flush=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for prompts, targets in loader:
            t0 = time.time()
            enc = tok(prompts, return_tensors="pt", padding=True, truncation=True,
                      max_length=args.max_prompt_len).to(device)
            n_prompt = enc.input_ids.shape[1]

            # ---- rollout ----
            policy.eval()
            policy.module.config.use_cache = True
            with torch.no_grad():
                seqs = policy.generate(
                    **enc,
                    do_sample=True,
                    temperature=args.temperature,
                    top_p=1.0,
                    max_new_tokens=args.max_new_tokens,
                    num_return_sequences=args.group_size,
                    pad_token_id=tok.pad_token_id,
                )
            policy.module.config.use_cache = False
            policy.train()

            completion_ids = seqs[:, n_prompt:]
            is_eos = completion_ids == tok.eos_token_id
            eos_idx = torch.where(is_eos.any(1), is_eos.int().argmax(1),
                                  torch.full_like(is_eos[:, 0], completion_ids.shape[1], dtype=torch.long))
            pos = torch.arange(completion_ids.shape[1], device=device).unsqueeze(0)
            comp_mask = (pos <= eos_idx.unsqueeze(1)).float()
            prompt_mask = enc.attention_mask.repeat_interleave(args.group_size, dim=0)
            attn = torch.cat([prompt_mask, comp_mask.long()], dim=1)

            texts = tok.batch_decode(completion_ids, skip_special_tokens=True)
            answers = [t for t in targets for _ in range(args.group_size)]
            rewards = torch.tensor(reward_fn(texts, answers), device=device)

            grouped = rewards.view(-1, args.group_size)
            adv = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)
            adv = adv.view(-1)

            with torch.no_grad():
                ref_lp = token_logprobs(ref, seqs, attn, n_prompt)

            # ---- policy update (single step, on-policy) ----
            lp = token_logprobs(policy, seqs, attn, n_prompt)
            ratio = torch.exp(lp - lp.detach())
            pg = -ratio * adv.unsqueeze(1)
            kl = torch.exp(ref_lp - lp) - (ref_lp - lp) - 1.0
            per_tok = pg + args.beta * kl
            loss = ((per_tok * comp_mask).sum(1) / comp_mask.sum(1).clamp(min=1)).mean()

            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1

            if step % args.log_every == 0:
                stats = torch.stack([
                    loss.detach(),
                    rewards.mean(),
                    (rewards > 1.0).float().mean(),
                    ((kl * comp_mask).sum() / comp_mask.sum()).detach(),
                    comp_mask.sum(1).mean(),
                ])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if is_main:
                    l, r, acc, k, ln = stats.tolist()
                    print(f"ep {epoch} step {step}/{total_steps} loss {l:.4f} reward {r:.3f} "
                          f"acc {acc:.3f} kl {k:.4f} len {ln:.0f} gnorm {gnorm.item():.2f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.1f}s", flush=True)

            if step % args.save_every == 0:
                if is_main:
                    out = os.path.join(args.output_dir, f"step_{step}")
                    policy.module.save_pretrained(out, safe_serialization=True)
                    tok.save_pretrained(out)
                dist.barrier()

    if is_main:
        policy.module.save_pretrained(os.path.join(args.output_dir, "final"), safe_serialization=True)
        tok.save_pretrained(os.path.join(args.output_dir, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
