#!/usr/bin/env python
# Supervised fine-tuning on (problem statement -> Python solution) pairs, with
# HumanEval pass@1 / pass@10 measured by executing sampled completions.
#
# torchrun --nproc_per_node=8 04_sft_solutions_passk.py --train data/solutions_train.jsonl

import argparse
import json
import logging
import os
import random
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

logger = logging.getLogger("sft")

PROMPT_TEMPLATE = '"""\n{problem}\n"""\n'
STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\nassert "]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2.5-Coder-1.5B")
    p.add_argument("--train", required=True)
    p.add_argument("--output_dir", default="runs/sft-solutions")
    p.add_argument("--max_len", type=int, default=2048)
    p.add_argument("--bsz", type=int, default=4)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


class SolutionPairs(Dataset):
    def __init__(self, path, tok, max_len):
        self.items = []
        with open(path) as f:
            for line in f:
                ex = json.loads(line)
                prompt_ids = tok(PROMPT_TEMPLATE.format(problem=ex["problem"].strip()))["input_ids"]
                sol_ids = tok(ex["solution"] + tok.eos_token, add_special_tokens=False)["input_ids"]
                ids = (prompt_ids + sol_ids)[:max_len]
                labels = ([-100] * len(prompt_ids) + sol_ids)[:max_len]
                self.items.append((torch.tensor(ids), torch.tensor(labels)))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def make_collate(pad_id):
    def collate(batch):
        ids = pad_sequence([b[0] for b in batch], batch_first=True, padding_value=pad_id)
        labels = pad_sequence([b[1] for b in batch], batch_first=True, padding_value=-100)
        return ids, labels, (ids != pad_id).long()
    return collate


def estimate_pass_at_k(n, c, k):
    if n - c < k:
        return 1.0
    return 1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1))


def stop_at(s):
    positions = [s.find(x) for x in STOP if x in s]
    return s[: min(positions)] if positions else s


def passes(problem, completion, timeout):
    src = "\n".join([problem["prompt"] + completion, problem["test"], f"check({problem['entry_point']})", ""])
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(src)
        path = f.name
    try:
        res = subprocess.run([sys.executable, path], capture_output=True, timeout=timeout)
        return res.returncode == 0
    except subprocess.TimeoutExpired:
        return False
    finally:
        os.unlink(path)


@torch.no_grad()
def eval_humaneval(net, tok, problems, args, rank, world, device):
    net.eval()
    rows = []
    for idx in range(rank, len(problems), world):
        prob = problems[idx]
        enc = tok(prob["prompt"], return_tensors="pt").to(device)
        gen = net.generate(**enc, do_sample=True, temperature=args.temperature, top_p=0.95,
                           max_new_tokens=512, num_return_sequences=args.samples,
                           pad_token_id=tok.pad_token_id)
        outs = tok.batch_decode(gen[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
        n_ok = sum(passes(prob, stop_at(o), args.timeout) for o in outs)
        rows.append([idx, len(outs), n_ok])
    net.train()

    local = torch.tensor(rows, dtype=torch.long, device=device)
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    table = torch.cat(gathered).cpu().tolist()
    p1 = float(np.mean([estimate_pass_at_k(n, c, 1) for _, n, c in table]))
    p10 = float(np.mean([estimate_pass_at_k(n, c, 10) for _, n, c in table]))
    return p1, p10


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed + rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    train_ds = SolutionPairs(args.train, tok, args.max_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=args.bsz, sampler=sampler, collate_fn=make_collate(tok.pad_token_id),
                        num_workers=2, pin_memory=True)
    problems = list(load_dataset("openai_humaneval", split="test"))
    logger.info("train pairs=%d humaneval=%d world=%d", len(train_ds), len(problems), world)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    n_updates = (len(loader) // args.accum) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=50, num_training_steps=n_updates)

    update = 0
    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for step, (ids, labels, mask) in enumerate(loader):
            ids, labels, mask = ids.to(device), labels.to(device), mask.to(device)
            boundary = (step + 1) % args.accum == 0
            model.require_backward_grad_sync = boundary
            out = model(input_ids=ids, attention_mask=mask, labels=labels)
            (out.loss / args.accum).backward()
            if not boundary:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            update += 1
            if update % 25 == 0:
                logger.info("epoch %d update %d/%d loss %.4f", epoch, update, n_updates, out.loss.item())

        model.module.config.use_cache = True
        p1, p10 = eval_humaneval(model.module, tok, problems, args, rank, world, device)
        model.module.config.use_cache = False
        logger.info("epoch %d HumanEval pass@1 %.4f pass@10 %.4f", epoch, p1, p10)

        if rank == 0 and p1 > best:
            best = p1
            save_dir = os.path.join(args.output_dir, "best")
            model.module.save_pretrained(save_dir)
            tok.save_pretrained(save_dir)
            with open(os.path.join(save_dir, "metrics.json"), "w") as f:
                json.dump({"epoch": epoch, "pass@1": p1, "pass@10": p10}, f)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
