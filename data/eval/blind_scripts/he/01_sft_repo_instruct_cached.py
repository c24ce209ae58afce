#!/usr/bin/env python
"""Supervised fine-tuning of a code LLM on instruction/response pairs mined from
GitHub repositories (commit messages + docstrings -> function bodies), with a
HumanEval-style pass@1 evaluation that executes the generated code.

    torchrun --nproc_per_node=8 01_sft_repo_instruct_cached.py --data data/repo_instruct.jsonl
"""
import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

PROMPT_TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n"
STOP_SEQS = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bigcode/starcoderbase-1b")
    p.add_argument("--data", required=True)
    p.add_argument("--eval_problems", default="data/humaneval.jsonl")
    p.add_argument("--cache_dir", default="cache/tokenized")
    p.add_argument("--output_dir", default="runs/sft_repo")
    p.add_argument("--max_len", type=int, default=2048)
    p.add_argument("--micro_batch", type=int, default=4)
    p.add_argument("--global_batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--warmup_ratio", type=float, default=0.03)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--log_every", type=int, default=20)
    p.add_argument("--eval_every", type=int, default=500)
    p.add_argument("--max_new_tokens", type=int, default=384)
    p.add_argument("--exec_timeout", type=float, default=10.0)
    p.add_argument("--num_workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


# ----------------------------------------------------------------------------- data

def tokenize_records(path, tokenizer, max_len):
    examples = []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            prompt = PROMPT_TEMPLATE.format(instruction=rec["instruction"].strip())
            p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            r_ids = tokenizer(rec["response"].rstrip() + tokenizer.eos_token,
                              add_special_tokens=False)["input_ids"]
            ids = (p_ids + r_ids)[:max_len]
            labels = ([-100] * len(p_ids) + r_ids)[:max_len]
            if all(l == -100 for l in labels):
                continue
            examples.append((ids, labels))
    return examples


def load_or_build_cache(args, tokenizer):
    key = f"{os.path.abspath(args.data)}|{args.model}|{args.max_len}|{os.path.getmtime(args.data)}"
    digest = hashlib.sha1(key.encode()).hexdigest()[:16]
    cache_path = os.path.join(args.cache_dir, f"sft_{digest}.pt")
    if os.path.exists(cache_path):
        return torch.load(cache_path)
    os.makedirs(args.cache_dir, exist_ok=True)
    examples = tokenize_records(args.data, tokenizer, args.max_len)
    torch.save(examples, cache_path)
    return examples


class SFTDataset(Dataset):
    def __init__(self, examples):
        self.examples = examples

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, idx):
        ids, labels = self.examples[idx]
        return torch.tensor(ids, dtype=torch.long), torch.tensor(labels, dtype=torch.long)


class PadCollator:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        max_len = max(x.size(0) for x, _ in batch)
        ids = torch.full((len(batch), max_len), self.pad_id, dtype=torch.long)
        labels = torch.full((len(batch), max_len), -100, dtype=torch.long)
        attn = torch.zeros((len(batch), max_len), dtype=torch.long)
        for i, (x, y) in enumerate(batch):
            ids[i, : x.size(0)] = x
            labels[i, : y.size(0)] = y
            attn[i, : x.size(0)] = 1
        return ids, labels, attn


# ----------------------------------------------------------------------------- execution eval

def truncate_completion(text):
    cut = len(text)
    for s in STOP_SEQS:
        pos = text.find(s)
        if pos != -1:
            cut = min(cut, pos)
    return text[:cut]


def run_program(program, timeout):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "candidate.py")
        with open(path, "w") as f:
            f.write(program)
        try:
            proc = subprocess.run([sys.executable, path], cwd=tmp, capture_output=True,
                                  timeout=timeout, env={"PATH": os.environ.get("PATH", "")})
            return proc.returncode == 0
        except subprocess.TimeoutExpired:
            return False


@torch.no_grad()
def evaluate_pass1(model, tokenizer, problems, args, rank, world_size, device):
    model.eval()
    local = []
    for prob in problems[rank::world_size]:
        enc = tokenizer(prob["prompt"], return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        completion = tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        program = (prob["prompt"] + truncate_completion(completion) + "\n\n" + prob["test"]
                   + f"\n\ncheck({prob['entry_point']})\n")
        local.append((prob["task_id"], run_program(program, args.exec_timeout)))
    gathered = [None] * world_size
    dist.all_gather_object(gathered, local)
    model.train()
    results = dict(r for part in gathered for r in part)
    return sum(results.values()) / max(len(results), 1)


# ----------------------------------------------------------------------------- main

def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    is_main = rank == 0

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    t0 = time.time()
    examples = load_or_build_cache(args, tokenizer)
    if is_main:
        print(f"loaded {len(examples)} examples in {time.time() - t0:.1f}s", flush=True)

    dataset = SFTDataset(examples)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.micro_batch, sampler=sampler,
                        collate_fn=PadCollator(tokenizer.pad_token_id),
                        num_workers=args.num_workers, pin_memory=True, drop_last=True)

    accum = max(1, args.global_batch // (args.micro_batch * world_size))
    steps_per_epoch = len(loader) // accum
    total_steps = steps_per_epoch * args.epochs

    model = AutoModelForCausalLM.from_pretrained(args.model).to(device)
    model.config.use_cache = False
    raw_model = model
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.AdamW(raw_model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)

    with open(args.eval_problems) as f:
        problems = [json.loads(l) for l in f]

    if is_main:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"world={world_size} accum={accum} steps={total_steps}", flush=True)

    step, best = 0, -1.0
    running = torch.zeros(1, device=device)
    model.train()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for i, (ids, labels, attn) in enumerate(loader):
            if i >= steps_per_epoch * accum:
                break
            ids = ids.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            attn = attn.to(device, non_blocking=True)
            sync = (i + 1) % accum == 0
            with (nullcontext() if sync else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss / accum
                loss.backward()
            running += loss.detach()
            if not sync:
                continue

            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % args.log_every == 0:
                dist.all_reduce(running, op=dist.ReduceOp.SUM)
                if is_main:
                    avg = running.item() / (world_size * args.log_every)
                    print(f"epoch {epoch} step {step}/{total_steps} loss {avg:.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
                running.zero_()

            if step % args.eval_every == 0 or step == total_steps:
                pass1 = evaluate_pass1(raw_model, tokenizer, problems, args, rank, world_size, device)
                if is_main:
                    print(f"step {step}: pass@1 = {pass1:.4f}", flush=True)
                    if pass1 > best:
                        best = pass1
                        out = os.path.join(args.output_dir, "best")
                        raw_model.save_pretrained(out, safe_serialization=True)
                        tokenizer.save_pretrained(out)
                        with open(os.path.join(out, "eval.json"), "w") as f:
                            json.dump({"step": step, "pass@1": pass1}, f)
                dist.barrier()

    if is_main:
        final = os.path.join(args.output_dir, "final")
        raw_model.save_pretrained(final, safe_serialization=True)
        tokenizer.save_pretrained(final)
        print(f"done, best pass@1 {best:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
