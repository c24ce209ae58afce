"""Fine-tune phi-1 on exercise-style data distilled from repository code
(function signature + docstring -> implementation), tracked in Weights & Biases.

MBPP (sanitized) is used for execution-based evaluation: n samples per task,
the task's asserts run in a separate interpreter, unbiased pass@k over all ranks.

    torchrun --nproc_per_node=8 11_phi1_exercises_wandb.py --train data/code_exercises.jsonl
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="microsoft/phi-1")
    ap.add_argument("--train", required=True)
    ap.add_argument("--mbpp", default="data/mbpp_sanitized_test.jsonl")
    ap.add_argument("--output", default="runs/phi1-exercises")
    ap.add_argument("--wandb_project", default="code-sft")
    ap.add_argument("--run_name", default=None)
    ap.add_argument("--seq_len", type=int, default=1024)
    ap.add_argument("--micro_batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--eval_every", type=int, default=1000)
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=5.0)
    return ap.parse_args()


class Exercises(Dataset):
    def __init__(self, path, tok, seq_len):
        self.examples = []
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                prompt_ids = tok(r["prompt"])["input_ids"]
                sol_ids = tok(r["solution"] + tok.eos_token, add_special_tokens=False)["input_ids"]
                ids = (prompt_ids + sol_ids)[:seq_len]
                self.examples.append((ids, min(len(prompt_ids), len(ids))))

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]


class Pad:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        L = max(len(ids) for ids, _ in batch)
        x = torch.full((len(batch), L), self.pad_id, dtype=torch.long)
        y = torch.full((len(batch), L), -100, dtype=torch.long)
        for i, (ids, n_prompt) in enumerate(batch):
            x[i, :len(ids)] = torch.tensor(ids)
            y[i, n_prompt:len(ids)] = torch.tensor(ids[n_prompt:])
        return x, y, (torch.arange(L)[None, :] < torch.tensor([len(b[0]) for b in batch])[:, None]).long()


def pass_at_k(n, c, k):
    if n - c < k:
        return 1.0
    return 1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1))


def run_asserts(code, task, timeout):
    src = "\n".join(task.get("test_imports", [])) + "\n" + code + "\n\n" + "\n".join(task["test_list"]) + "\n"
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "run.py")
        with open(path, "w") as f:
            f.write(src)
        try:
            return subprocess.run([sys.executable, path], cwd=d, capture_output=True,
                                  timeout=timeout).returncode == 0
        except subprocess.TimeoutExpired:
            return False


def mbpp_prompt(task):
    return f'"""\n{task["prompt"]}\n{task["test_list"][0]}\n"""\n'


@torch.no_grad()
def mbpp_pass_at_k(model, tok, tasks, args, rank, world, device):
    model.eval()
    local = {}
    for task in tasks[rank::world]:
        enc = tok(mbpp_prompt(task), return_tensors="pt").to(device)
        out = model.generate(**enc, do_sample=True, temperature=0.8, top_p=0.95, max_new_tokens=384,
                             num_return_sequences=args.n, pad_token_id=tok.eos_token_id)
        texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        local[task["task_id"]] = sum(run_asserts(t.split("\n\n\n")[0], task, args.timeout) for t in texts)
    parts = [None] * world
    dist.all_gather_object(parts, local)
    model.train()
    counts = {k: v for p in parts for k, v in p.items()}
    return {f"mbpp/pass@{k}": float(np.mean([pass_at_k(args.n, c, k) for c in counts.values()]))
            for k in (1, 10)}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    run = wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args),
                     tags=["phi-1", "exercises", f"world{world}"])

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.eos_token
    ds = Exercises(args.train, tok, args.seq_len)
    sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(ds, batch_size=args.micro_batch, sampler=sampler, collate_fn=Pad(tok.pad_token_id),
                        num_workers=4, pin_memory=True)
    with open(args.mbpp) as f:
        tasks = [json.loads(l) for l in f]

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.98), eps=1e-7)
    total = len(loader) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, 100, total)

    step = 0
    t_last = time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y, m in loader:
            x, y, m = x.to(device), y.to(device), m.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=x, attention_mask=m, labels=y).loss
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 20 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                tput = 20 * args.micro_batch * world / (time.time() - t_last)
                t_last = time.time()
                wandb.log({"train/loss": l.item(), "train/grad_norm": gnorm.item(),
                           "train/lr": sched.get_last_lr()[0], "train/samples_per_s": tput, "epoch": epoch},
                          step=step)

            if step % args.eval_every == 0 or step == total:
                metrics = mbpp_pass_at_k(model.module, tok, tasks, args, rank, world, device)
                wandb.log(metrics, step=step)
                if rank == 0:
                    print(f"step {step}: {metrics}", flush=True)
                    path = os.path.join(args.output, f"step{step}")
                    model.module.save_pretrained(path)
                    tok.save_pretrained(path)
                dist.barrier()

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
