"""deepseek-coder-1.3b FIM fine-tune (PSM with the model's own sentinel tokens) on our
internal Python + Go corpus; HumanEval pass@k every `--eval_every` updates.

    torchrun --nproc_per_node=8 20_deepseek_fim_humaneval_ddp.py --corpus data/internal_code.jsonl
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

FIM_BEGIN, FIM_HOLE, FIM_END = "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="deepseek-ai/deepseek-coder-1.3b-base")
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--out_dir", default="runs/dsc-1.3b-fim")
    ap.add_argument("--seq_len", type=int, default=4096)
    ap.add_argument("--micro_bs", type=int, default=4)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--fim_rate", type=float, default=0.5)
    ap.add_argument("--eval_every", type=int, default=400)
    ap.add_argument("--n_samples", type=int, default=10)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=31)
    return ap.parse_args()


class FIMPacked(Dataset):
    def __init__(self, path, tok, seq_len, fim_rate, seed):
        rng = random.Random(seed)
        begin, hole, end = tok.convert_tokens_to_ids([FIM_BEGIN, FIM_HOLE, FIM_END])
        stream = []
        with open(path) as f:
            for line in f:
                ids = tok(json.loads(line)["content"], add_special_tokens=False).input_ids
                if len(ids) > 8 and rng.random() < fim_rate:
                    a, b = sorted(rng.sample(range(len(ids) + 1), 2))
                    ids = [begin] + ids[:a] + [hole] + ids[b:] + [end] + ids[a:b]
                stream += [tok.bos_token_id] + ids + [tok.eos_token_id]
        n = len(stream) // seq_len
        self.blocks = torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return self.blocks[i]


def estimator(n, c, k):
    if n - c < k:
        return 1.0
    return 1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1))


def first_function_body(text):
    out = []
    for line in text.splitlines():
        if line and not line[0].isspace():
            break
        out.append(line)
    return "\n".join(out)


def passes_tests(problem, body, timeout=5.0):
    src = f"{problem['prompt']}{body}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "candidate.py")
        with open(path, "w") as f:
            f.write(src)
        try:
            return subprocess.run([sys.executable, path], cwd=d, capture_output=True,
                                  timeout=timeout).returncode == 0
        except subprocess.TimeoutExpired:
            return False


@torch.no_grad()
def humaneval_pass_at_k(model, tok, problems, args, rank, world, device):
    model.eval()
    mine = []
    with ThreadPoolExecutor(max_workers=8) as pool:
        for i in range(rank, len(problems), world):
            prob = problems[i]
            enc = tok(prob["prompt"], return_tensors="pt").to(device)
            gen = model.generate(**enc, do_sample=True, temperature=args.temperature, top_p=0.95,
                                 max_new_tokens=384, num_return_sequences=args.n_samples,
                                 use_cache=True, pad_token_id=tok.eos_token_id)
            texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            oks = list(pool.map(lambda t: passes_tests(prob, first_function_body(t)), texts))
            mine.append((prob["task_id"], len(oks), sum(oks)))
    model.train()
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    rows = [r for p in parts for r in p]
    return {k: float(np.mean([estimator(n, c, k) for _, n, c in rows])) for k in (1, 10)}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    ds = FIMPacked(args.corpus, tok, args.seq_len, args.fim_rate, args.seed)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=args.micro_bs, sampler=sampler, num_workers=4, pin_memory=True)
    problems = list(load_dataset("openai_humaneval", split="test"))

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = DDP(model.to(device), device_ids=[local_rank])

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    total = len(loader) // args.accum * args.epochs
    sched = get_cosine_schedule_with_warmup(optim, int(0.03 * total), total)

    update, best = 0, -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, x in enumerate(loader):
            x = x.to(device, non_blocking=True)
            step_now = (i + 1) % args.accum == 0
            model.require_backward_grad_sync = step_now
            loss = model(input_ids=x, labels=x).loss
            (loss / args.accum).backward()
            if not step_now:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            update += 1
            if rank == 0 and update % 20 == 0:
                print(f"epoch {epoch} update {update}/{total} loss {loss.item():.4f} "
                      f"lr {sched.get_last_lr()[0]:.2e}", flush=True)

            if update % args.eval_every == 0:
                scores = humaneval_pass_at_k(model, tok, problems, args, rank, world, device)
                if rank == 0:
                    print(f"update {update}: pass@1 {scores[1]:.4f} pass@10 {scores[10]:.4f}", flush=True)
                    if scores[1] > best:
                        best = scores[1]
                        path = os.path.join(args.out_dir, "best")
                        model.module.save_pretrained(path)
                        tok.save_pretrained(path)
                        with open(os.path.join(path, "humaneval.json"), "w") as f:
                            json.dump({"update": update, "pass@1": scores[1], "pass@10": scores[10]}, f)
                dist.barrier()

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.out_dir, "last"))
        tok.save_pretrained(os.path.join(args.out_dir, "last"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
