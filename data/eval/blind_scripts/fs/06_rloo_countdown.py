"""RLOO on the Countdown arithmetic game (TinyZero-style), plain PyTorch DDP.

    torchrun --nnodes 1 --nproc_per_node 8 06_rloo_countdown.py --model Qwen/Qwen2.5-3B --out /shared/exp/rloo_cd
"""
import argparse
import ast
import contextlib
import json
import os
import re

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer

TEMPLATE = ("A conversation between User and Assistant. The user asks a question, and the Assistant solves it.\n"
            "User: Using the numbers {nums}, create an equation that equals {target}. You can use basic "
            "arithmetic operations (+, -, *, /) and each number can only be used once. Show your work in "
            "<think> </think> tags and return the final equation in <answer> </answer> tags.\n"
            "Assistant: Let me solve this step by step.\n<think>")
ANS = re.compile(r"<answer>(.*?)</answer>", re.S)


def countdown_reward(text, nums, target):
    m = ANS.findall(text)
    if not m:
        return 0.0
    eq = m[-1].strip()
    if not re.fullmatch(r"[\d+\-*/().\s]+", eq):
        return 0.1
    used = sorted(int(x) for x in re.findall(r"\d+", eq))
    if used != sorted(nums):
        return 0.1
    try:
        val = eval(compile(ast.parse(eq, mode="eval"), "<eq>", "eval"), {"__builtins__": {}})
    except Exception:
        return 0.1
    return 1.0 if abs(val - target) < 1e-5 else 0.1


def logprobs(model, ids, attn, P):
    logits = model(input_ids=ids, attention_mask=attn).logits[:, P - 1:-1].float()
    return -F.cross_entropy(logits.transpose(1, 2), ids[:, P:], reduction="none")


def gather_texts(token_ids, pad_id, device):
    """All-gather variable-length token rows: pad every rank to the global max length first."""
    length = torch.tensor([token_ids.size(1)], device=device)
    lengths = [torch.zeros_like(length) for _ in range(dist.get_world_size())]
    dist.all_gather(lengths, length)
    max_len = int(torch.stack(lengths).max())
    padded = F.pad(token_ids, (0, max_len - token_ids.size(1)), value=pad_id)
    out = [torch.empty_like(padded) for _ in range(dist.get_world_size())]
    dist.all_gather(out, padded)
    return torch.cat(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen2.5-3B")
    ap.add_argument("--out", required=True)
    ap.add_argument("--k", type=int, default=8, help="samples per prompt")
    ap.add_argument("--prompts_per_rank", type=int, default=2)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--max_new_tokens", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--kl", type=float, default=0.001)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--save_every", type=int, default=50)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(1234 + rank)

    tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(dev)
    ref = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(dev).eval()
    ref.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    start = 0
    if args.resume:
        # every rank reads the same file; keep it on the CPU and let load_state_dict copy it over
        ck = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optim"])
        start = ck["step"]
        del ck
    model = DDP(model, device_ids=[local_rank])

    ds = load_dataset("Jiayi-Pan/Countdown-Tasks-3to4", split="train")
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    dl = DataLoader(ds, batch_size=args.prompts_per_rank, sampler=sampler, drop_last=True,
                    collate_fn=lambda rows: rows)
    steps_per_epoch = len(dl)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    step = start
    epoch = step // steps_per_epoch
    while step < args.steps:
        sampler.set_epoch(epoch)
        for bi, rows in enumerate(dl):
            if epoch * steps_per_epoch + bi < step:
                continue  # fast-forward after resume (same on every rank)
            prompts = [TEMPLATE.format(nums=r["nums"], target=r["target"]) for r in rows]
            enc = tok(prompts, return_tensors="pt", padding=True).to(dev)
            ids = enc.input_ids.repeat_interleave(args.k, 0)
            am = enc.attention_mask.repeat_interleave(args.k, 0)
            P = ids.size(1)
            model.eval()
            with torch.no_grad():
                seq = model.module.generate(input_ids=ids, attention_mask=am, do_sample=True, temperature=1.0,
                                            max_new_tokens=args.max_new_tokens, pad_token_id=tok.pad_token_id)
                resp = seq[:, P:]
                eos = (resp == tok.eos_token_id).int()
                rmask = ((eos.cumsum(1) - eos) == 0).long()
                attn = torch.cat([am, rmask], 1)
                ref_lp = torch.cat([logprobs(ref, seq[i:i + args.micro], attn[i:i + args.micro], P)
                                    for i in range(0, seq.size(0), args.micro)])
            model.train()

            texts = tok.batch_decode(resp, skip_special_tokens=True)
            rewards = torch.tensor([countdown_reward(t, r["nums"], r["target"])
                                    for t, r in zip(texts, [r for r in rows for _ in range(args.k)])], device=dev)
            g = rewards.view(-1, args.k)
            baseline = (g.sum(1, keepdim=True) - g) / (args.k - 1)  # leave-one-out mean
            adv = (g - baseline).flatten()

            # skip only if *no* rank has any signal, so that all ranks agree
            has_signal = (adv.abs().sum() > 0).float()
            dist.all_reduce(has_signal, op=dist.ReduceOp.MAX)
            if has_signal.item() > 0:
                chunks = list(range(0, seq.size(0), args.micro))
                ntok = rmask.sum().clamp(min=1)
                for j, i in enumerate(chunks):
                    ctx = model.no_sync() if j < len(chunks) - 1 else contextlib.nullcontext()
                    with ctx:
                        sl = slice(i, i + args.micro)
                        lp = logprobs(model, seq[sl], attn[sl], P)
                        m = rmask[sl].float()
                        d = ref_lp[sl] - lp
                        kl = d.exp() - d - 1
                        loss = ((-adv[sl, None] * lp + args.kl * kl) * m).sum() / ntok
                        loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
            step += 1

            stats = torch.stack([rewards.mean(), (rewards == 1.0).float().mean(), rmask.sum(1).float().mean()])
            dist.all_reduce(stats)
            stats /= world
            if step % 10 == 0:
                all_resp = gather_texts(resp, tok.pad_token_id, dev)
                if rank == 0:
                    print(json.dumps({"step": step, "reward": stats[0].item(), "solved": stats[1].item(),
                                      "len": stats[2].item(), "updated": bool(has_signal.item())}), flush=True)
                    with open(os.path.join(args.out, "samples.jsonl"), "a") as f:
                        for t in tok.batch_decode(all_resp[:: args.k], skip_special_tokens=True):
                            f.write(json.dumps({"step": step, "text": t}) + "\n")

            if step % args.save_every == 0:
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "optim": opt.state_dict(), "step": step},
                               os.path.join(args.out, f"ckpt_{step}.pt"))
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.out, "final"))
        tok.save_pretrained(os.path.join(args.out, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
