"""
Minimal GRPO on GSM8K-style prompts, one process per GPU.
Policy + frozen reference, group-normalized advantages, token-level KL.

torchrun --standalone --nproc_per_node=8 02_grpo_math_ddp.py \
    --model Qwen/Qwen2.5-1.5B-Instruct --out runs/grpo_qwen15
"""
import argparse
import os
import re
import random
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer

SYSTEM = ("You are a helpful assistant. Think step by step, then give the final "
          "answer after '####'.")
ANS_RE = re.compile(r"####\s*(-?[\d,\.]+)")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2.5-1.5B-Instruct")
    p.add_argument("--out", default="runs/grpo")
    p.add_argument("--prompts_per_rank", type=int, default=4)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--max_new_tokens", type=int, default=384)
    p.add_argument("--temperature", type=float, default=0.9)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--clip_eps", type=float, default=0.2)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--save_every", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def extract(text):
    m = ANS_RE.search(text)
    if not m:
        return None
    return m.group(1).replace(",", "").rstrip(".")


def reward_fn(completions, golds):
    out = []
    for c, g in zip(completions, golds):
        pred = extract(c)
        r = 0.0
        if "####" in c:
            r += 0.1
        if pred is not None and pred == g:
            r += 1.0
        out.append(r)
    return torch.tensor(out, dtype=torch.float32)


def build_prompts(tok, questions):
    msgs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            for q in questions]
    return [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in msgs]


def token_logprobs(model, input_ids, attn_mask, n_prompt):
    logits = model(input_ids=input_ids, attention_mask=attn_mask).logits
    logits = logits[:, n_prompt - 1:-1].float()
    targets = input_ids[:, n_prompt:]
    return torch.gather(F.log_softmax(logits, dim=-1), 2, targets.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def rollout(policy, tok, prompts, args, device):
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left").to(device)
    enc = {k: v.repeat_interleave(args.group_size, dim=0) for k, v in enc.items()}
    seqs = policy.generate(
        **enc,
        do_sample=True,
        temperature=args.temperature,
        top_p=1.0,
        max_new_tokens=args.max_new_tokens,
        pad_token_id=tok.pad_token_id,
    )
    n_prompt = enc["input_ids"].shape[1]
    completion_ids = seqs[:, n_prompt:]
    is_eos = completion_ids == tok.eos_token_id
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1),
                            torch.full_like(is_eos[:, 0], is_eos.size(1), dtype=torch.long))
    comp_mask = (torch.arange(is_eos.size(1), device=device)[None] <= first_eos[:, None]).long()
    attn = torch.cat([enc["attention_mask"], comp_mask], dim=1)
    texts = tok.batch_decode(completion_ids, skip_special_tokens=True)
    return seqs, attn, comp_mask, n_prompt, texts


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device(f"cuda:{local_rank}"))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").to(device)
    ref = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                               attn_implementation="sdpa").to(device).eval()
    ref.requires_grad_(False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    policy = DDP(model, device_ids=[local_rank])

    optim = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)

    ds = load_dataset("openai/gsm8k", "main", split="train")
    ds = ds.map(lambda ex: {"gold": ex["answer"].split("####")[-1].strip().replace(",", "")})
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.prompts_per_rank, sampler=sampler,
                        collate_fn=lambda b: ([x["question"] for x in b], [x["gold"] for x in b]),
                        drop_last=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for questions, golds in loader:
            t0 = time.time()
            prompts = build_prompts(tok, questions)
            policy.eval()
            model.config.use_cache = True
            seqs, attn, comp_mask, n_prompt, texts = rollout(policy, tok, prompts, args, device)
            model.config.use_cache = False
            policy.train()

            gold_rep = [g for g in golds for _ in range(args.group_size)]
            rewards = reward_fn(texts, gold_rep).to(device)
            grouped = rewards.view(-1, args.group_size)
            adv = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)
            adv = adv.view(-1)

            with torch.no_grad():
                ref_lp = token_logprobs(ref, seqs, attn, n_prompt)
                old_lp = token_logprobs(model, seqs, attn, n_prompt)

            new_lp = token_logprobs(policy, seqs, attn, n_prompt)
            ratio = torch.exp(new_lp - old_lp)
            pg1 = ratio * adv[:, None]
            pg2 = torch.clamp(ratio, 1 - args.clip_eps, 1 + args.clip_eps) * adv[:, None]
            kl = torch.exp(ref_lp - new_lp) - (ref_lp - new_lp) - 1
            per_tok = -(torch.min(pg1, pg2) - args.beta * kl)
            mask = comp_mask.float()
            loss = ((per_tok * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()

            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            optim.step()
            step += 1

            stats = torch.stack([rewards.mean(), loss.detach(), (kl * mask).sum() / mask.sum()])
            dist.all_reduce(stats, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"ep {epoch} step {step} reward {stats[0]:.3f} loss {stats[1]:.4f} "
                      f"kl {stats[2]:.4f} {time.time() - t0:.1f}s", flush=True)

            if step % args.save_every == 0:
                if rank == 0:
                    save_dir = os.path.join(args.out, f"step_{step}")
                    model.save_pretrained(save_dir, safe_serialization=True)
                    tok.save_pretrained(save_dir)
                dist.barrier()

    if rank == 0:
        model.save_pretrained(os.path.join(args.out, "final"))
        tok.save_pretrained(os.path.join(args.out, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
