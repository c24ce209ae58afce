"""GRPO on MATH (lighteval split) with periodic greedy evaluation on MATH-500.

Keeps the checkpoint with the best MATH-500 accuracy.

    torchrun --nproc_per_node=4 11_grpo_math500_eval.py --model Qwen/Qwen2.5-1.5B-Instruct --wandb_project grpo-math
"""
import argparse
import os
import shutil

import torch
import torch.distributed as dist
import wandb
from datasets import load_dataset
from math_verify import parse, verify
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

SYS = "Please reason step by step, and put your final answer within \\boxed{}."


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2.5-1.5B-Instruct")
    p.add_argument("--out", default="outputs/grpo_math")
    p.add_argument("--wandb_project", default=None)
    p.add_argument("--n_prompts", type=int, default=8)
    p.add_argument("--G", type=int, default=8)
    p.add_argument("--micro", type=int, default=16)
    p.add_argument("--max_new_tokens", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--eps", type=float, default=0.2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--eval_every", type=int, default=40)
    p.add_argument("--eval_bs", type=int, default=25)
    return p.parse_args()


def chat(tok, problem):
    return tok.apply_chat_template([{"role": "system", "content": SYS}, {"role": "user", "content": problem}],
                                   tokenize=False, add_generation_prompt=True)


def is_correct(completion, gold):
    try:
        return bool(verify(parse(gold), parse(completion)))
    except Exception:
        return False


def logprob(model, ids, attn, P):
    logits = model(input_ids=ids, attention_mask=attn).logits[:, P - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, P:, None]).squeeze(-1)


@torch.no_grad()
def evaluate(model, tok, dl, args, device):
    model.eval()
    n_correct, n_total = 0, 0
    for rows in dl:
        enc = tok([chat(tok, r["problem"]) for r in rows], return_tensors="pt", padding=True).to(device)
        out = model.generate(**enc, do_sample=False, max_new_tokens=args.max_new_tokens,
                             pad_token_id=tok.pad_token_id)
        texts = tok.batch_decode(out[:, enc.input_ids.size(1):], skip_special_tokens=True)
        for t, r in zip(texts, rows):
            n_correct += is_correct(t, "$" + r["answer"] + "$")
            n_total += 1
    model.train()
    return n_correct / max(n_total, 1)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(rank)
    if rank == 0 and args.wandb_project:
        wandb.init(project=args.wandb_project, config=vars(args))

    tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(device)
    ref = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(device)
    ref.eval().requires_grad_(False)
    ddp_model = DDP(model, device_ids=[local_rank])

    train = load_dataset("DigitalLearningGmbH/MATH-lighteval", split="train")
    train = train.map(lambda r: {"answer": r["solution"]}, remove_columns=["solution"])
    test = load_dataset("HuggingFaceH4/MATH-500", split="test")
    tr_sampler = DistributedSampler(train, shuffle=True, seed=0)
    te_sampler = DistributedSampler(test, shuffle=False)
    tr_dl = DataLoader(train, batch_size=args.n_prompts, sampler=tr_sampler, drop_last=True, collate_fn=lambda x: x)
    te_dl = DataLoader(test, batch_size=args.eval_bs, sampler=te_sampler, collate_fn=lambda x: x)

    total = len(tr_dl) * args.epochs
    opt = torch.optim.AdamW(ddp_model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = get_cosine_schedule_with_warmup(opt, int(0.03 * total), total)

    best_acc, step = -1.0, 0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        for rows in tr_dl:
            enc = tok([chat(tok, r["problem"]) for r in rows], return_tensors="pt", padding=True).to(device)
            ids = enc.input_ids.repeat_interleave(args.G, 0)
            am = enc.attention_mask.repeat_interleave(args.G, 0)
            P = ids.size(1)
            model.eval()
            with torch.no_grad():
                seq = model.generate(input_ids=ids, attention_mask=am, do_sample=True, temperature=0.9,
                                     max_new_tokens=args.max_new_tokens, pad_token_id=tok.pad_token_id)
                resp = seq[:, P:]
                e = (resp == tok.eos_token_id).int()
                mask = ((e.cumsum(1) - e) == 0).long()
                attn = torch.cat([am, mask], 1)
                chunks = range(0, seq.size(0), args.micro)
                old = torch.cat([logprob(model, seq[i:i + args.micro], attn[i:i + args.micro], P) for i in chunks])
                rlp = torch.cat([logprob(ref, seq[i:i + args.micro], attn[i:i + args.micro], P) for i in chunks])
            model.train()

            texts = tok.batch_decode(resp, skip_special_tokens=True)
            golds = [r["answer"] for r in rows for _ in range(args.G)]
            rew = torch.tensor([float(is_correct(t, g)) for t, g in zip(texts, golds)], device=device)
            grp = rew.view(-1, args.G)
            adv = ((grp - grp.mean(1, keepdim=True)) / (grp.std(1, keepdim=True) + 1e-4)).view(-1, 1)

            opt.zero_grad(set_to_none=True)
            n_chunks = len(chunks)
            for k, i in enumerate(chunks):
                sl = slice(i, i + args.micro)
                ddp_model.require_backward_grad_sync = k == n_chunks - 1
                lp = logprob(ddp_model, seq[sl], attn[sl], P)
                ratio = (lp - old[sl]).exp()
                pg = -torch.min(ratio * adv[sl], ratio.clamp(1 - args.eps, 1 + args.eps) * adv[sl])
                d = rlp[sl] - lp
                kl = d.exp() - d - 1
                m = mask[sl].float()
                loss = (((pg + args.beta * kl) * m).sum(1) / m.sum(1).clamp(min=1)).mean() / n_chunks
                loss.backward()
            ddp_model.require_backward_grad_sync = True
            gn = torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1

            train_stats = torch.stack([rew.mean(), mask.sum(1).float().mean()])
            dist.all_reduce(train_stats)
            train_stats /= world
            if rank == 0 and args.wandb_project:
                wandb.log({"train/reward": train_stats[0].item(), "train/len": train_stats[1].item(),
                           "train/grad_norm": gn.item(), "lr": sched.get_last_lr()[0]}, step=step)

            if step % args.eval_every == 0:
                acc = evaluate(model, tok, te_dl, args, device)
                if rank == 0:
                    print(f"step {step}: MATH-500 acc {acc:.4f} (best {best_acc:.4f})", flush=True)
                    if args.wandb_project:
                        wandb.log({"eval/math500_acc": acc}, step=step)
                    if acc > best_acc:
                        best_acc = acc
                        best_dir = os.path.join(args.out, "best")
                        shutil.rmtree(best_dir, ignore_errors=True)
                        model.save_pretrained(best_dir)
                        tok.save_pretrained(best_dir)
                dist.barrier()

    if rank == 0:
        print(f"done, best MATH-500 acc {best_acc:.4f}")
        if args.wandb_project:
            wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
