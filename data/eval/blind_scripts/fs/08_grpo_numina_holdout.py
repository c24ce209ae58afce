#!/usr/bin/env python3
# GRPO on a filtered NuminaMath subset stored as JSONL ({"problem":..., "answer":...}).
# We hold out a slice of the file for a greedy pass@1 eval every N steps.
#
#   torchrun --nproc_per_node=8 08_grpo_numina_holdout.py --data data/numina_int_answers.jsonl
import argparse
import json
import os
import random
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from math_verify import parse, verify
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_constant_schedule_with_warmup

PROMPT = "{problem}\n\nPlease reason step by step, and put your final answer within \\boxed{{}}."


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen2.5-Math-1.5B")
    ap.add_argument("--data", required=True)
    ap.add_argument("--n_eval", type=int, default=512)
    ap.add_argument("--out", default="exp/grpo_numina")
    ap.add_argument("--bsz", type=int, default=8, help="prompts per rank")
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--mb", type=int, default=16)
    ap.add_argument("--max_tokens", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-6)
    ap.add_argument("--beta", type=float, default=0.0)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--eval_every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=2024)
    return ap.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def load_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def math_reward(completion, answer):
    try:
        return 1.0 if verify(parse("$" + answer + "$"), parse(completion)) else 0.0
    except Exception:
        return 0.0


def token_logp(model, ids, attn, P):
    logits = model(input_ids=ids, attention_mask=attn).logits[:, P - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, P:].unsqueeze(-1)).squeeze(-1)


def build_prompts(tok, rows):
    return [tok.apply_chat_template([{"role": "user", "content": PROMPT.format(problem=r["problem"])}],
                                    tokenize=False, add_generation_prompt=True) for r in rows]


@torch.no_grad()
def evaluate(model, tok, loader, args, dev):
    model.eval()
    correct = torch.zeros(2, device=dev)
    for rows in loader:
        enc = tok(build_prompts(tok, rows), return_tensors="pt", padding=True).to(dev)
        out = model.generate(**enc, do_sample=False, max_new_tokens=args.max_tokens, pad_token_id=tok.pad_token_id)
        texts = tok.batch_decode(out[:, enc.input_ids.size(1):], skip_special_tokens=True)
        correct[0] += sum(math_reward(t, r["answer"]) for t, r in zip(texts, rows))
        correct[1] += len(rows)
    dist.all_reduce(correct)
    model.train()
    return (correct[0] / correct[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    seed_everything(args.seed + rank)  # different sampling noise on each rank

    records = load_jsonl(args.data)
    random.shuffle(records)
    eval_rows, train_rows = records[:args.n_eval], records[args.n_eval:]
    if rank == 0:
        print(f"{len(train_rows)} train / {len(eval_rows)} held-out problems", flush=True)

    tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(dev)
    ref = None
    if args.beta > 0:
        ref = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(dev).eval()
        ref.requires_grad_(False)
    ddp = DDP(policy, device_ids=[local_rank])
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.99))
    sched = get_constant_schedule_with_warmup(opt, 10)

    train_sampler = DistributedSampler(train_rows, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_rows, batch_size=args.bsz, sampler=train_sampler, collate_fn=lambda x: x)
    eval_dl = DataLoader(eval_rows, batch_size=32, sampler=DistributedSampler(eval_rows, shuffle=False),
                         collate_fn=lambda x: x)

    step, epoch = 0, 0
    best = -1.0
    while step < args.steps:
        train_sampler.set_epoch(epoch)
        for rows in train_dl:
            t0 = time.time()
            enc = tok(build_prompts(tok, rows), return_tensors="pt", padding=True).to(dev)
            ids = enc.input_ids.repeat_interleave(args.G, 0)
            am = enc.attention_mask.repeat_interleave(args.G, 0)
            P = ids.size(1)
            policy.eval()
            with torch.no_grad():
                seq = policy.generate(input_ids=ids, attention_mask=am, do_sample=True, temperature=1.0,
                                      max_new_tokens=args.max_tokens, pad_token_id=tok.pad_token_id)
                resp = seq[:, P:]
                e = (resp == tok.eos_token_id).int()
                m = ((e.cumsum(1) - e) == 0).long()
                attn = torch.cat([am, m], 1)
                old_lp = torch.cat([token_logp(policy, seq[i:i + args.mb], attn[i:i + args.mb], P)
                                    for i in range(0, seq.size(0), args.mb)])
                ref_lp = None
                if ref is not None:
                    ref_lp = torch.cat([token_logp(ref, seq[i:i + args.mb], attn[i:i + args.mb], P)
                                        for i in range(0, seq.size(0), args.mb)])
            policy.train()

            texts = tok.batch_decode(resp, skip_special_tokens=True)
            answers = [r["answer"] for r in rows for _ in range(args.G)]
            rew = torch.tensor([math_reward(t, a) for t, a in zip(texts, answers)], device=dev)
            g = rew.view(-1, args.G)
            adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).view(-1, 1)

            mf = m.float()
            denom = mf.sum()
            n_chunks = (seq.size(0) + args.mb - 1) // args.mb
            for c in range(n_chunks):
                sl = slice(c * args.mb, (c + 1) * args.mb)
                with ddp.no_sync() if c < n_chunks - 1 else nullcontext():
                    lp = token_logp(ddp, seq[sl], attn[sl], P)
                    ratio = (lp - old_lp[sl]).exp()
                    per_tok = -torch.min(ratio * adv[sl], ratio.clamp(1 - args.clip, 1 + args.clip) * adv[sl])
                    if ref_lp is not None:
                        d = ref_lp[sl] - lp
                        per_tok = per_tok + args.beta * (d.exp() - d - 1)
                    loss = (per_tok * mf[sl]).sum() / denom
                    loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            s = torch.tensor([rew.mean().item(), m.sum(1).float().mean().item()], device=dev)
            dist.all_reduce(s)
            s /= world
            if rank == 0:
                print(f"step {step:4d} | reward {s[0]:.3f} | len {s[1]:.0f} | gnorm {gn:.3f} | {time.time() - t0:.1f}s",
                      flush=True)

            if step % args.eval_every == 0:
                acc = evaluate(policy, tok, eval_dl, args, dev)
                if rank == 0:
                    print(f"== eval step {step}: pass@1 {acc:.4f}", flush=True)
                    if acc > best:
                        best = acc
                        policy.save_pretrained(os.path.join(args.out, "best"))
                        tok.save_pretrained(os.path.join(args.out, "best"))
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
