"""Qwen2.5-Coder-3B: FIM + left-to-right fine-tune on packed 8k sequences.
HumanEval pass@1/pass@10 (sampled, executed in subprocesses) after every epoch.

    torchrun --nproc_per_node=8 11_qwen_coder_fim_passk.py --train_jsonl data/train.jsonl
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

FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen2.5-Coder-3B")
    ap.add_argument("--train_jsonl", required=True)
    ap.add_argument("--save_dir", default="ckpts/qwen-coder-3b-fim")
    ap.add_argument("--seq_len", type=int, default=8192)
    ap.add_argument("--micro_bs", type=int, default=1)
    ap.add_argument("--accum", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--fim_rate", type=float, default=0.5)
    ap.add_argument("--n_samples", type=int, default=10)
    ap.add_argument("--gen_batch", type=int, default=10)
    ap.add_argument("--seed", type=int, default=2024)
    return ap.parse_args()


class PackedFIMDataset(Dataset):
    def __init__(self, path, tok, seq_len, fim_rate, seed):
        rng = random.Random(seed)
        pre, suf, mid = tok.convert_tokens_to_ids(list(FIM_TOKENS))
        eos = tok.convert_tokens_to_ids("<|endoftext|>")
        stream = []
        with open(path) as f:
            for line in f:
                ids = tok(json.loads(line)["content"], add_special_tokens=False).input_ids
                if len(ids) > 32 and rng.random() < fim_rate:
                    a, b = sorted(rng.sample(range(1, len(ids)), 2))
                    ids = [pre] + ids[:a] + [suf] + ids[b:] + [mid] + ids[a:b]
                stream.extend(ids)
                stream.append(eos)
        n = len(stream) // seq_len
        self.blocks = torch.tensor(stream[: n * seq_len]).view(n, seq_len)

    def __len__(self):
        return self.blocks.size(0)

    def __getitem__(self, i):
        return self.blocks[i]


def unbiased_pass_at_k(n, c, k):
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def extract_body(completion):
    lines = []
    for line in completion.split("\n"):
        if line.strip() and not line.startswith((" ", "\t")):
            break
        lines.append(line)
    return "\n".join(lines)


def run_tests(problem, body, timeout=6.0):
    program = problem["prompt"] + body + "\n\n" + problem["test"] + f"\ncheck({problem['entry_point']})\n"
    with tempfile.TemporaryDirectory() as workdir:
        script = os.path.join(workdir, "solution.py")
        with open(script, "w") as f:
            f.write(program)
        try:
            proc = subprocess.run([sys.executable, script], cwd=workdir, timeout=timeout,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            return proc.returncode == 0
        except subprocess.TimeoutExpired:
            return False


@torch.no_grad()
def humaneval_passk(model, tok, problems, args, rank, world, device):
    model.eval()
    model.config.use_cache = True
    counts = torch.zeros(len(problems), 2, dtype=torch.float64)  # (n, correct) per problem
    with ThreadPoolExecutor(max_workers=16) as ex:
        for pid in range(rank, len(problems), world):
            prob = problems[pid]
            enc = tok(prob["prompt"], return_tensors="pt").to(device)
            samples = []
            for _ in range(args.n_samples // args.gen_batch):
                out = model.generate(**enc, do_sample=True, temperature=0.8, top_p=0.95, max_new_tokens=400,
                                     num_return_sequences=args.gen_batch, pad_token_id=tok.pad_token_id)
                samples += tok.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
            ok = list(ex.map(lambda s: run_tests(prob, extract_body(s)), samples))
            counts[pid, 0] = len(ok)
            counts[pid, 1] = sum(ok)
    model.config.use_cache = False
    model.train()

    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    rows = counts.tolist()
    return {k: float(np.mean([unbiased_pass_at_k(int(n), int(c), k) for n, c in rows])) for k in (1, 10)}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    train_ds = PackedFIMDataset(args.train_jsonl, tok, args.seq_len, args.fim_rate, args.seed)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.micro_bs, sampler=sampler, num_workers=2, pin_memory=True)
    problems = list(load_dataset("openai_humaneval", split="test"))

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                 attn_implementation="flash_attention_2")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    ddp = DDP(model.to(device), device_ids=[local_rank])

    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.05, betas=(0.9, 0.95))
    n_updates = len(loader) // args.accum * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, max(1, n_updates // 50), n_updates)

    upd = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        for i, x in enumerate(loader):
            x = x.to(device, non_blocking=True)
            last = (i + 1) % args.accum == 0
            if last:
                loss = ddp(input_ids=x, labels=x).loss
                (loss / args.accum).backward()
            else:
                with ddp.no_sync():
                    loss = ddp(input_ids=x, labels=x).loss
                    (loss / args.accum).backward()
                continue
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            upd += 1
            if upd % 20 == 0 and rank == 0:
                print(f"epoch {epoch} update {upd}/{n_updates} loss {loss.item():.4f}", flush=True)

        scores = humaneval_passk(ddp.module, tok, problems, args, rank, world, device)
        if rank == 0:
            print(f"epoch {epoch} HumanEval pass@1={scores[1]:.4f} pass@10={scores[10]:.4f}", flush=True)
            out = os.path.join(args.save_dir, f"epoch{epoch}")
            ddp.module.save_pretrained(out)
            tok.save_pretrained(out)
            with open(os.path.join(out, "humaneval.json"), "w") as f:
                json.dump({f"pass@{k}": v for k, v in scores.items()}, f)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
