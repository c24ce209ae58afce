"""Docstring-to-body fine-tuning of Qwen2.5-Coder-1.5B.

Training pairs come from Python repositories (functions with a docstring and a passing
unit test in the repo's test suite). After each epoch we sample 20 completions per
HumanEval problem and report unbiased pass@1 / pass@10 from sandboxed execution.

    torchrun --nproc_per_node=8 06_qwen_coder_docstring_passk.py --train data/docstring_body.jsonl
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen2.5-Coder-1.5B")
    ap.add_argument("--train", required=True)
    ap.add_argument("--humaneval", default="data/HumanEval.jsonl")
    ap.add_argument("--out", default="ckpt/qwen15_docstring")
    ap.add_argument("--max_len", type=int, default=1024)
    ap.add_argument("--bsz", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--warmup", type=float, default=0.05)
    ap.add_argument("--n_samples", type=int, default=20)
    ap.add_argument("--temperature", type=float, default=0.2)
    ap.add_argument("--timeout", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=7)
    return ap.parse_args()


def estimate_pass_at_k(n, c, k):
    if n - c < k:
        return 1.0
    return 1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1))


class DocstringBody(Dataset):
    def __init__(self, path, tok, max_len):
        self.data = []
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                header = r["signature"] + "\n" + '    """' + r["docstring"] + '"""\n'
                h = tok(header)["input_ids"]
                b = tok(r["body"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                if len(h) + len(b) <= max_len:
                    self.data.append((h, b))

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        h, b = self.data[i]
        return h + b, [-100] * len(h) + b


def make_batch(items, pad):
    L = max(len(x) for x, _ in items)
    x = torch.full((len(items), L), pad, dtype=torch.long)
    y = torch.full((len(items), L), -100, dtype=torch.long)
    m = torch.zeros((len(items), L), dtype=torch.long)
    for i, (a, b) in enumerate(items):
        x[i, :len(a)] = torch.tensor(a)
        y[i, :len(b)] = torch.tensor(b)
        m[i, :len(a)] = 1
    return x, y, m


class Collate:
    def __init__(self, pad):
        self.pad = pad

    def __call__(self, items):
        return make_batch(items, self.pad)


def exec_ok(program, timeout):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.py")
        with open(path, "w") as f:
            f.write(program)
        try:
            return subprocess.run([sys.executable, path], cwd=d, capture_output=True,
                                  timeout=timeout).returncode == 0
        except subprocess.TimeoutExpired:
            return False


def trim(completion):
    lines = []
    for line in completion.split("\n"):
        if line and not line.startswith((" ", "\t")):
            break
        lines.append(line)
    return "\n".join(lines)


@torch.no_grad()
def run_humaneval(model, tok, problems, args, device):
    model.eval()
    scores = {1: [], 10: []}
    for prob in problems:
        enc = tok(prob["prompt"], return_tensors="pt").to(device)
        out = model.generate(**enc, do_sample=True, temperature=args.temperature, top_p=0.95,
                             num_return_sequences=args.n_samples, max_new_tokens=512,
                             pad_token_id=tok.eos_token_id)
        comps = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        correct = 0
        for c in comps:
            prog = prob["prompt"] + trim(c) + "\n\n" + prob["test"] + f"\ncheck({prob['entry_point']})\n"
            correct += exec_ok(prog, args.timeout)
        for k in scores:
            scores[k].append(estimate_pass_at_k(args.n_samples, correct, k))
    model.train()
    return {f"pass@{k}": float(np.mean(v)) for k, v in scores.items()}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    ds = DocstringBody(args.train, tok, args.max_len)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=args.bsz, sampler=sampler, collate_fn=Collate(tok.pad_token_id),
                        num_workers=4, pin_memory=True)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    total = len(loader) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, int(args.warmup * total), total)

    with open(args.humaneval) as f:
        problems = [json.loads(l) for l in f]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(ds)} training functions, {len(loader)} steps/epoch/rank, world {world}", flush=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        stat = torch.zeros(2, device=device)
        for step, (x, y, m) in enumerate(loader):
            x, y, m = x.to(device), y.to(device), m.to(device)
            loss = model(input_ids=x, attention_mask=m, labels=y).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            stat[0] += loss.detach().float()
            stat[1] += 1
            if step % 100 == 0 and rank == 0:
                print(f"ep {epoch} {step}/{len(loader)} loss {loss.item():.4f}", flush=True)
        dist.all_reduce(stat)
        train_loss = (stat[0] / stat[1]).item()

        if rank == 0:
            metrics = run_humaneval(model.module, tok, problems, args, device)
            print(f"epoch {epoch} ({time.time() - tic:.0f}s) train_loss {train_loss:.4f} {metrics}", flush=True)
            path = os.path.join(args.out, f"epoch_{epoch}")
            model.module.save_pretrained(path)
            tok.save_pretrained(path)
            with open(os.path.join(path, "metrics.json"), "w") as f:
                json.dump({"train_loss": train_loss, **metrics}, f, indent=2)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
