#!/usr/bin/env python
# DPO trainer for our internal preference dumps (jsonl: prompt / chosen / rejected).
# Checkpoints at the end of every epoch and can resume from one.
#
#   torchrun --nproc_per_node=8 18_dpo_jsonl_resume.py --model ckpts/sft-qwen2.5-1.5b \
#       --train data/prefs_v3_train.jsonl --eval data/prefs_v3_eval.jsonl --out runs/dpo-v3
import argparse
import contextlib
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

IGNORE_INDEX = -100


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--ref_model", default=None, help="defaults to --model")
    p.add_argument("--train", required=True)
    p.add_argument("--eval", required=True)
    p.add_argument("--out", default="runs/dpo")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--label_smoothing", type=float, default=0.0, help="conservative DPO")
    p.add_argument("--lr", type=float, default=5e-7)
    p.add_argument("--warmup_steps", type=int, default=100)
    p.add_argument("--per_device_pairs", type=int, default=4)
    p.add_argument("--grad_accum", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max_length", type=int, default=1024)
    p.add_argument("--max_prompt_length", type=int, default=512)
    p.add_argument("--eval_every", type=int, default=200)
    p.add_argument("--resume", default=None, help="path to an epoch checkpoint (.pt)")
    p.add_argument("--seed", type=int, default=17)
    return p.parse_args()


def tokenize_pair(tok, prompt, chosen, rejected, max_length, max_prompt_length):
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    chosen_ids = tok(chosen, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    rejected_ids = tok(rejected, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    longer = max(len(chosen_ids), len(rejected_ids))
    if len(prompt_ids) + longer > max_length:
        prompt_ids = prompt_ids[-max_prompt_length:]  # keep the end of the prompt
    if len(prompt_ids) + longer > max_length:
        keep = max_length - len(prompt_ids)
        chosen_ids, rejected_ids = chosen_ids[:keep], rejected_ids[:keep]
    return {
        "chosen_input_ids": prompt_ids + chosen_ids,
        "chosen_labels": [IGNORE_INDEX] * len(prompt_ids) + chosen_ids,
        "rejected_input_ids": prompt_ids + rejected_ids,
        "rejected_labels": [IGNORE_INDEX] * len(prompt_ids) + rejected_ids,
    }


class PreferenceJsonl(Dataset):
    def __init__(self, path, tok, max_length, max_prompt_length):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        self.items = [tokenize_pair(tok, r["prompt"], r["chosen"], r["rejected"], max_length, max_prompt_length)
                      for r in rows]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class PairCollator:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        seqs = [b["chosen_input_ids"] for b in batch] + [b["rejected_input_ids"] for b in batch]
        labels = [b["chosen_labels"] for b in batch] + [b["rejected_labels"] for b in batch]
        T = max(len(s) for s in seqs)
        input_ids = torch.full((len(seqs), T), self.pad_id, dtype=torch.long)
        label_t = torch.full((len(seqs), T), IGNORE_INDEX, dtype=torch.long)
        attn = torch.zeros((len(seqs), T), dtype=torch.long)
        for i, (s, l) in enumerate(zip(seqs, labels)):
            input_ids[i, : len(s)] = torch.tensor(s)
            label_t[i, : len(l)] = torch.tensor(l)
            attn[i, : len(s)] = 1
        return {"input_ids": input_ids, "attention_mask": attn, "labels": label_t}


def concatenated_logps(model, batch):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits = logits[:, :-1, :].float()
    labels = batch["labels"][:, 1:].clone()
    mask = labels != IGNORE_INDEX
    labels[~mask] = 0
    per_tok = torch.gather(logits.log_softmax(-1), 2, labels.unsqueeze(2)).squeeze(2)
    logps = (per_tok * mask).sum(-1)
    n = logps.size(0) // 2
    return logps[:n], logps[n:]


def dpo_loss(pc, pr, rc, rr, beta, ls):
    z = (pc - pr) - (rc - rr)
    losses = -F.logsigmoid(beta * z) * (1 - ls) - F.logsigmoid(-beta * z) * ls
    return losses.mean(), beta * (pc - rc).detach(), beta * (pr - rr).detach()


@torch.no_grad()
def evaluate(policy, ref, loader, args, device):
    # policy is the bare module: the eval shards are not the same length on every rank
    policy.eval()
    sums = torch.zeros(4, device=device)  # loss*n, correct, margin, n
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        pc, pr = concatenated_logps(policy, batch)
        rc, rr = concatenated_logps(ref, batch)
        loss, ch, rj = dpo_loss(pc, pr, rc, rr, args.beta, args.label_smoothing)
        n = ch.numel()
        sums += torch.stack([loss * n, (ch > rj).float().sum(), (ch - rj).sum(), sums.new_tensor(n)])
    dist.all_reduce(sums)
    policy.train()
    n = sums[3].clamp(min=1)
    return {"eval_loss": (sums[0] / n).item(), "eval_acc": (sums[1] / n).item(), "eval_margin": (sums[2] / n).item()}


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    is_main = rank == 0

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    train_ds = PreferenceJsonl(args.train, tok, args.max_length, args.max_prompt_length)
    eval_ds = PreferenceJsonl(args.eval, tok, args.max_length, args.max_prompt_length)
    collator = PairCollator(tok.pad_token_id)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.per_device_pairs, sampler=sampler,
                          collate_fn=collator, num_workers=2, pin_memory=True)
    # strided shard without DistributedSampler padding, so no eval pair is counted twice
    eval_shard = Subset(eval_ds, list(range(rank, len(eval_ds), world)))
    eval_dl = DataLoader(eval_shard, batch_size=args.per_device_pairs, collate_fn=collator)

    policy = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.config.use_cache = False
    ref = AutoModelForCausalLM.from_pretrained(args.ref_model or args.model, torch_dtype=torch.bfloat16)
    ref.requires_grad_(False)
    ref.to(device).eval()

    start_epoch = 0
    ckpt = None
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        policy.load_state_dict(ckpt["model"])
        start_epoch = ckpt["epoch"] + 1
    policy.to(device)
    model = DDP(policy, device_ids=[local_rank])

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    steps_per_epoch = len(train_dl) // args.grad_accum
    sched = get_cosine_schedule_with_warmup(optim, args.warmup_steps, steps_per_epoch * args.epochs)
    if ckpt is not None:
        optim.load_state_dict(ckpt["optim"])
        sched.load_state_dict(ckpt["sched"])
        del ckpt

    if is_main:
        os.makedirs(args.out, exist_ok=True)
        print(f"pairs per update: {args.per_device_pairs * args.grad_accum * world}, updates/epoch: {steps_per_epoch}")

    step = start_epoch * steps_per_epoch
    t0 = time.time()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for i, batch in enumerate(train_dl):
            if i >= steps_per_epoch * args.grad_accum:
                break  # drop the ragged tail so every rank does the same number of updates
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            sync_now = (i + 1) % args.grad_accum == 0
            with contextlib.nullcontext() if sync_now else model.no_sync():
                pc, pr = concatenated_logps(model, batch)
                with torch.no_grad():
                    rc, rr = concatenated_logps(ref, batch)
                loss, ch, rj = dpo_loss(pc, pr, rc, rr, args.beta, args.label_smoothing)
                (loss / args.grad_accum).backward()
            if not sync_now:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                log = torch.stack([loss.detach(), (ch > rj).float().mean(), (ch - rj).mean(), ch.mean(), rj.mean()])
                dist.all_reduce(log, op=dist.ReduceOp.AVG)
                if is_main:
                    print(json.dumps({"step": step, "loss": log[0].item(), "acc": log[1].item(),
                                      "margin": log[2].item(), "r_chosen": log[3].item(), "r_rejected": log[4].item(),
                                      "lr": sched.get_last_lr()[0], "elapsed": round(time.time() - t0)}), flush=True)
            if step % args.eval_every == 0:
                metrics = evaluate(model.module, ref, eval_dl, args, device)
                if is_main:
                    print(json.dumps({"step": step, **metrics}), flush=True)

        if is_main:
            torch.save({"model": model.module.state_dict(), "optim": optim.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch},
                       os.path.join(args.out, f"epoch{epoch}.pt"))
        dist.barrier()

    metrics = evaluate(model.module, ref, eval_dl, args, device)
    if is_main:
        print(json.dumps({"step": step, "final": True, **metrics}), flush=True)
        model.module.save_pretrained(os.path.join(args.out, "hf"))
        tok.save_pretrained(os.path.join(args.out, "hf"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
