"""
GRPO on the Countdown arithmetic game (TinyZero-style) with plain DDP.

Every rank owns whole groups: it samples `group_size` completions for each of
its prompts with generate() on the unwrapped policy, scores them with a rule
reward (format + correct equation), normalises rewards inside each group and
runs a few micro-batches of the clipped surrogate with gradient accumulation.

    torchrun --standalone --nproc_per_node=4 07_grpo_countdown_ddp.py \
        --model Qwen/Qwen2.5-1.5B-Instruct --run_name countdown-1.5b
"""
import argparse
import os
import re
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer

TEMPLATE = ("Using the numbers {nums}, create an equation that equals {target}. You can use + - * / and each "
            "number once. Show your work in <think> </think> and give the equation in <answer> </answer>.")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2.5-1.5B-Instruct")
    p.add_argument("--run_name", default="countdown")
    p.add_argument("--out_dir", default="runs/countdown")
    p.add_argument("--prompts_per_rank", type=int, default=8)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--micro_batch", type=int, default=16)
    p.add_argument("--max_new_tokens", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--beta", type=float, default=0.001)
    p.add_argument("--eps", type=float, default=0.2)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--save_every", type=int, default=50)
    p.add_argument("--resume", default=None)
    return p.parse_args()


def countdown_reward(text, nums, target):
    m = re.search(r"<answer>(.*?)</answer>", text, re.S)
    if m is None:
        return 0.0
    eq = m.group(1).strip()
    if not re.fullmatch(r"[\d\s\+\-\*/\(\)\.]+", eq):
        return 0.1
    used = sorted(int(n) for n in re.findall(r"\d+", eq))
    if used != sorted(nums):
        return 0.1
    try:
        val = eval(eq, {"__builtins__": None}, {})
    except Exception:
        return 0.1
    return 1.0 if abs(val - target) < 1e-5 else 0.1


def seq_logps(model, ids, attn, n_prompt):
    logits = model(input_ids=ids, attention_mask=attn).logits[:, n_prompt - 1:-1].float()
    return torch.gather(logits.log_softmax(-1), 2, ids[:, n_prompt:].unsqueeze(-1)).squeeze(-1)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    G = args.group_size

    if rank == 0:
        wandb.init(project="grpo-countdown", name=args.run_name, config=vars(args))
        os.makedirs(args.out_dir, exist_ok=True)

    tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    if args.resume:
        model.load_state_dict(torch.load(args.resume, map_location="cpu", weights_only=True))
    model.to(dev)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(dev)
    ref.eval().requires_grad_(False)
    policy = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)

    ds = load_dataset("Jiayi-Pan/Countdown-Tasks-3to4", split="train")

    def fmt(ex):
        msgs = [{"role": "user", "content": TEMPLATE.format(nums=ex["nums"], target=ex["target"])}]
        return {"prompt": tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) + "<think>"}

    ds = ds.map(fmt)
    sampler = DistributedSampler(ds, shuffle=True, seed=7, drop_last=True)
    loader = DataLoader(ds, batch_size=args.prompts_per_rank, sampler=sampler, collate_fn=lambda b: b)

    step, epoch = 0, 0
    data_iter = iter(loader)
    sampler.set_epoch(epoch)
    while step < args.steps:
        try:
            batch = next(data_iter)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            data_iter = iter(loader)
            batch = next(data_iter)
        t0 = time.time()

        enc = tok([b["prompt"] for b in batch], return_tensors="pt", padding=True).to(dev)
        P = enc.input_ids.shape[1]
        model.eval()
        model.config.use_cache = True
        with torch.no_grad():
            seqs = model.generate(**enc, do_sample=True, temperature=1.0, max_new_tokens=args.max_new_tokens,
                                  num_return_sequences=G, pad_token_id=tok.pad_token_id)
        model.config.use_cache = False
        model.train()

        comp = seqs[:, P:]
        done = (comp == tok.eos_token_id).int().cumsum(1)
        cmask = ((done == 0) | ((done == 1) & (comp == tok.eos_token_id))).float()
        attn = torch.cat([enc.attention_mask.repeat_interleave(G, 0), cmask.long()], 1)
        texts = tok.batch_decode(comp, skip_special_tokens=True)
        rewards = torch.tensor([countdown_reward("<think>" + t, batch[i // G]["nums"], batch[i // G]["target"])
                                for i, t in enumerate(texts)], device=dev)
        grp = rewards.view(-1, G)
        std = grp.std(1, keepdim=True)
        # groups where every sample got the same reward give zero advantage; they still go through
        # forward/backward so that every rank runs the same number of all-reduces
        adv = torch.where(std > 0, (grp - grp.mean(1, keepdim=True)) / (std + 1e-6), torch.zeros_like(grp)).view(-1)

        with torch.no_grad():
            old_lp = torch.cat([seq_logps(model, seqs[i:i + args.micro_batch], attn[i:i + args.micro_batch], P)
                                for i in range(0, seqs.shape[0], args.micro_batch)])
            ref_lp = torch.cat([seq_logps(ref, seqs[i:i + args.micro_batch], attn[i:i + args.micro_batch], P)
                                for i in range(0, seqs.shape[0], args.micro_batch)])

        n_micro = (seqs.shape[0] + args.micro_batch - 1) // args.micro_batch
        total_tokens = cmask.sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        for j, i in enumerate(range(0, seqs.shape[0], args.micro_batch)):
            sl = slice(i, i + args.micro_batch)
            ctx = policy.no_sync() if j < n_micro - 1 else nullcontext()
            with ctx:
                lp = seq_logps(policy, seqs[sl], attn[sl], P)
                ratio = torch.exp(lp - old_lp[sl])
                a = adv[sl].unsqueeze(1)
                surr = torch.min(ratio * a, torch.clamp(ratio, 1 - args.eps, 1 + args.eps) * a)
                kl = torch.exp(ref_lp[sl] - lp) - (ref_lp[sl] - lp) - 1
                loss = ((-surr + args.beta * kl) * cmask[sl]).sum() / total_tokens
                loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        step += 1

        all_rewards = torch.empty(world * rewards.numel(), device=dev)
        dist.all_gather_into_tensor(all_rewards, rewards)
        lens = cmask.sum(1).mean()
        dist.all_reduce(lens, op=dist.ReduceOp.AVG)
        if rank == 0:
            wandb.log({"reward/mean": all_rewards.mean().item(),
                       "reward/solved": (all_rewards == 1.0).float().mean().item(),
                       "completion_len": lens.item(), "grad_norm": gnorm.item(),
                       "step_time": time.time() - t0}, step=step)

        if step % args.save_every == 0:
            if rank == 0:
                torch.save(policy.module.state_dict(), os.path.join(args.out_dir, f"policy_{step}.pt"))
            dist.barrier()

    if rank == 0:
        policy.module.save_pretrained(os.path.join(args.out_dir, "final"))
        tok.save_pretrained(os.path.join(args.out_dir, "final"))
        wandb.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
