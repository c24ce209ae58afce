"""HumanEval pass@k harness: sample completions on all GPUs, execute them on rank 0.

    torchrun --nproc_per_node=8 19_code_eval_harness.py --model bigcode/starcoder2-7b \
        --n_samples 20 --temperature 0.2 --out results/humaneval_sc2_7b
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

STOP_SEQS = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--n_samples", type=int, default=20)
    ap.add_argument("--temperature", type=float, default=0.2)
    ap.add_argument("--top_p", type=float, default=0.95)
    ap.add_argument("--max_new_tokens", type=int, default=512)
    ap.add_argument("--batch_size", type=int, default=10, help="samples generated per forward")
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--exec_workers", type=int, default=32)
    ap.add_argument("--out", default="results/humaneval")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--local_rank", type=int, default=0)
    return ap.parse_args()


def truncate(completion):
    cut = len(completion)
    for s in STOP_SEQS:
        i = completion.find(s)
        if i != -1:
            cut = min(cut, i)
    return completion[:cut]


def run_one(problem, completion, timeout):
    program = (problem["prompt"] + completion + "\n\n" + problem["test"] + "\n\n"
               + f"check({problem['entry_point']})\n")
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(program)
        path = f.name
    try:
        r = subprocess.run([sys.executable, path], capture_output=True, timeout=timeout)
        return r.returncode == 0
    except subprocess.TimeoutExpired:
        return False
    finally:
        os.unlink(path)


def pass_at_k(n, c, k):
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(args.seed * 1000 + rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(device)
    model.eval()

    problems = list(load_dataset("openai_humaneval", split="test"))
    task_ids = list(range(len(problems)))[rank::world]

    local = []
    t0 = time.time()
    for n_done, pi in enumerate(task_ids):
        prob = problems[pi]
        enc = tok(prob["prompt"], return_tensors="pt").to(device)
        remaining = args.n_samples
        while remaining > 0:
            n = min(args.batch_size, remaining)
            with torch.no_grad():
                out = model.generate(
                    **enc,
                    do_sample=True,
                    temperature=args.temperature,
                    top_p=args.top_p,
                    num_return_sequences=n,
                    max_new_tokens=args.max_new_tokens,
                    pad_token_id=tok.pad_token_id,
                )
            comps = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            local.extend({"task": pi, "completion": truncate(c)} for c in comps)
            remaining -= n
        if rank == 0:
            print(f"[{time.time() - t0:6.0f}s] {n_done + 1}/{len(task_ids)} problems", flush=True)

    gathered = [None] * world
    dist.all_gather_object(gathered, local)

    if rank == 0:
        samples = [s for part in gathered for s in part]
        with ThreadPoolExecutor(max_workers=args.exec_workers) as ex:
            passed = list(ex.map(lambda s: run_one(problems[s["task"]], s["completion"], args.timeout),
                                 samples))
        per_task = {}
        for s, ok in zip(samples, passed):
            n, c = per_task.get(s["task"], (0, 0))
            per_task[s["task"]] = (n + 1, c + int(ok))
        assert len(per_task) == len(problems), (len(per_task), len(problems))
        metrics = {}
        for k in (1, 10, 100):
            if k <= args.n_samples:
                metrics[f"pass@{k}"] = float(np.mean([pass_at_k(n, c, k) for n, c in per_task.values()]))
        metrics.update(model=args.model, temperature=args.temperature, n_samples=args.n_samples,
                       seconds=round(time.time() - t0, 1))
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "samples.jsonl"), "w") as f:
            for s, ok in zip(samples, passed):
                f.write(json.dumps({**s, "task_id": problems[s["task"]]["task_id"], "passed": ok}) + "\n")
        with open(os.path.join(args.out, "metrics.json"), "w") as f:
            json.dump(metrics, f, indent=2)
        print(json.dumps(metrics, indent=2))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
