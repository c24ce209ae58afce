"""Dr. GRPO (no std normalisation, constant-length loss normaliser) on MATH algebra.

    torchrun --standalone --nproc_per_node=8 20_dr_grpo_algebra.py --model Qwen/Qwen2.5-Math-1.5B
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from datasets import concatenate_datasets, load_dataset
from math_verify import parse, verify
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoModelForCausalLM, AutoTokenizer

R1_TEMPLATE = ("A conversation between User and Assistant. The User asks a question, and the Assistant solves it. "
               "The Assistant first thinks about the reasoning process in the mind and then provides the User with "
               "the answer. The reasoning process is enclosed within <think> </think> and answer is enclosed within "
               "<answer> </answer> tags.\nUser: {q}\nAssistant: <think>")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen2.5-Math-1.5B")
    ap.add_argument("--subjects", default="algebra,intermediate_algebra,prealgebra")
    ap.add_argument("--logdir", default="runs/dr_grpo")
    ap.add_argument("--prompts_per_step", type=int, default=8, help="per GPU")
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--max_gen", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt_every", type=int, default=100)
    return ap.parse_args()


def answer_reward(text, solution):
    if "</think>" not in text or "<answer>" not in text:
        return 0.0
    ans = text.split("<answer>")[-1].split("</answer>")[0]
    try:
        return 1.0 if verify(parse(solution), parse("$" + ans.strip() + "$")) else 0.0
    except Exception:
        return 0.0


def logps(model, ids, attn, P):
    logits = model(input_ids=ids, attention_mask=attn).logits[:, P - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, P:, None]).squeeze(-1)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(dev)
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = DDP(policy, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)

    parts = [load_dataset("EleutherAI/hendrycks_math", s, split="train") for s in args.subjects.split(",")]
    ds = concatenate_datasets(parts).filter(lambda r: r["level"] in ("Level 3", "Level 4", "Level 5"))
    loader = DataLoader(ds, batch_size=args.prompts_per_step, shuffle=True, drop_last=True,
                        collate_fn=lambda rows: rows, num_workers=1)

    writer = SummaryWriter(args.logdir) if rank == 0 else None
    step = 0
    for epoch in range(args.epochs):
        for rows in loader:
            t0 = time.time()
            prompts = [R1_TEMPLATE.format(q=r["problem"]) for r in rows]
            enc = tok(prompts, return_tensors="pt", padding=True).to(dev)
            ids = enc.input_ids.repeat_interleave(args.G, 0)
            am = enc.attention_mask.repeat_interleave(args.G, 0)
            P = ids.size(1)

            model.eval()
            with torch.no_grad():
                seq = policy.generate(input_ids=ids, attention_mask=am, do_sample=True, temperature=1.0,
                                      top_p=1.0, max_new_tokens=args.max_gen, pad_token_id=tok.pad_token_id)
                resp = seq[:, P:]
                e = (resp == tok.eos_token_id).int()
                mask = ((e.cumsum(1) - e) == 0).float()
                attn = torch.cat([am, mask.long()], 1)
                old = torch.cat([logps(policy, seq[i:i + args.micro], attn[i:i + args.micro], P)
                                 for i in range(0, seq.size(0), args.micro)])
            model.train()

            texts = tok.batch_decode(resp, skip_special_tokens=True)
            sols = [r["solution"] for r in rows for _ in range(args.G)]
            rew = torch.tensor([answer_reward(t, s) for t, s in zip(texts, sols)], device=dev)
            grp = rew.view(-1, args.G)
            adv = (grp - grp.mean(1, keepdim=True)).view(-1, 1)  # Dr. GRPO: no division by std

            n = seq.size(0)
            chunks = list(range(0, n, args.micro))
            for k, i in enumerate(chunks):
                sl = slice(i, i + args.micro)
                model.require_backward_grad_sync = k == len(chunks) - 1
                lp = logps(model, seq[sl], attn[sl], P)
                ratio = (lp - old[sl]).exp()
                pg = -torch.min(ratio * adv[sl], ratio.clamp(1 - args.clip, 1 + args.clip) * adv[sl])
                # constant normaliser (max_gen * n) instead of per-sequence length
                loss = (pg * mask[sl]).sum() / (args.max_gen * n)
                loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            st = torch.stack([rew.mean(), mask.sum(1).mean(), (mask.sum(1) >= args.max_gen).float().mean()])
            dist.all_reduce(st)
            st /= world
            if rank == 0:
                writer.add_scalar("train/reward", st[0].item(), step)
                writer.add_scalar("train/resp_len", st[1].item(), step)
                writer.add_scalar("train/clip_ratio_len", st[2].item(), step)
                writer.add_scalar("train/grad_norm", gn.item(), step)
                if step % 10 == 0:
                    print(json.dumps({"epoch": epoch, "step": step, "reward": round(st[0].item(), 4),
                                      "len": round(st[1].item(), 1), "sec": round(time.time() - t0, 1)}),
                          flush=True)

            if step % args.ckpt_every == 0:
                if rank == 0:
                    d = os.path.join(args.logdir, f"ckpt_{step}")
                    policy.save_pretrained(d)
                    tok.save_pretrained(d)
                dist.barrier()

    if rank == 0:
        writer.close()
        policy.save_pretrained(os.path.join(args.logdir, "final"))
        tok.save_pretrained(os.path.join(args.logdir, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
