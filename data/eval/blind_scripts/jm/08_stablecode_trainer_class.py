"""Minimal trainer for code-completion fine-tuning of stable-code-3b.

Packed 4k blocks from a pre-tokenized .npy token stream, DDP, bf16 autocast,
gradient accumulation, HumanEval pass@k for model selection.

    torchrun --nproc_per_node=8 08_stablecode_trainer_class.py --tokens data/py_tokens.npy --val_tokens data/py_val.npy
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup


class TokenBlocks(Dataset):
    def __init__(self, npy_path, block):
        self.tok = np.load(npy_path, mmap_mode="r")
        self.block = block

    def __len__(self):
        return len(self.tok) // self.block

    def __getitem__(self, i):
        s = i * self.block
        return torch.from_numpy(np.asarray(self.tok[s : s + self.block], dtype=np.int64))


def pass_at_k(n, c, k):
    if n - c < k:
        return 1.0
    return 1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1))


def clean_completion(text):
    for stop in ("\ndef ", "\nclass ", "\nif __name__", "\n#", "\nprint("):
        text = text.split(stop)[0]
    return text


def check(problem, completion, timeout):
    code = f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"
    with tempfile.TemporaryDirectory() as tmp:
        fn = os.path.join(tmp, "t.py")
        with open(fn, "w") as f:
            f.write(code)
        try:
            return subprocess.run([sys.executable, fn], capture_output=True, cwd=tmp, timeout=timeout).returncode == 0
        except subprocess.TimeoutExpired:
            return False


class Trainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        self.is_main = self.rank == 0
        torch.manual_seed(args.seed)

        self.tokenizer = AutoTokenizer.from_pretrained(args.model)
        self.train_ds = TokenBlocks(args.tokens, args.block)
        self.val_ds = TokenBlocks(args.val_tokens, args.block)
        self.sampler = DistributedSampler(self.train_ds, shuffle=True, seed=args.seed, drop_last=True)
        self.loader = DataLoader(self.train_ds, batch_size=args.micro_bs, sampler=self.sampler,
                                 num_workers=4, pin_memory=True)
        self.problems = list(load_dataset("openai_humaneval", split="test"))

        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        self.model = DDP(model.to(self.device), device_ids=[self.local_rank])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
        self.steps_total = len(self.loader) // args.accum * args.epochs
        self.sched = get_cosine_schedule_with_warmup(self.opt, args.warmup, self.steps_total)
        self.step = 0
        self.best = -1.0

    def log(self, msg):
        if self.is_main:
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def train_epoch(self, epoch):
        self.model.train()
        self.sampler.set_epoch(epoch)
        window = []
        for i, x in enumerate(self.loader):
            x = x.to(self.device, non_blocking=True)
            boundary = (i + 1) % self.args.accum == 0
            self.model.require_backward_grad_sync = boundary
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = self.model(input_ids=x, labels=x).loss
            (loss / self.args.accum).backward()
            window.append(loss.detach())
            if not boundary:
                continue
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)
            self.step += 1
            if self.step % 20 == 0:
                avg = torch.stack(window).mean()
                dist.all_reduce(avg, op=dist.ReduceOp.AVG)
                self.log(f"epoch {epoch} step {self.step}/{self.steps_total} loss {avg.item():.4f}")
            window = []

    @torch.no_grad()
    def val_loss(self):
        net = self.model.module
        net.eval()
        acc = torch.zeros(2, device=self.device)
        for i in range(self.rank, len(self.val_ds), self.world):
            x = self.val_ds[i].unsqueeze(0).to(self.device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                acc[0] += net(input_ids=x, labels=x).loss.float()
            acc[1] += 1
        dist.all_reduce(acc)
        return (acc[0] / acc[1]).item()

    @torch.no_grad()
    def humaneval(self):
        net = self.model.module
        net.eval()
        net.config.use_cache = True
        rows = []
        with ThreadPoolExecutor(8) as pool:
            for prob in self.problems[self.rank :: self.world]:
                enc = self.tokenizer(prob["prompt"], return_tensors="pt").to(self.device)
                out = net.generate(**enc, do_sample=True, temperature=0.2, top_p=0.95, max_new_tokens=300,
                                   num_return_sequences=self.args.n_samples,
                                   pad_token_id=self.tokenizer.eos_token_id)
                comps = self.tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
                ok = list(pool.map(lambda c: check(prob, clean_completion(c), 5.0), comps))
                rows.append((len(ok), sum(ok)))
        net.config.use_cache = False
        return {f"pass@{k}": float(np.mean([pass_at_k(n, c, k) for n, c in rows])) for k in (1, 5, 10)}

    def save(self, tag, metrics):
        path = os.path.join(self.args.out_dir, tag)
        os.makedirs(path, exist_ok=True)
        self.model.module.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        with open(os.path.join(path, "metrics.json"), "w") as f:
            json.dump({"step": self.step, **metrics}, f, indent=2)

    def fit(self):
        for epoch in range(self.args.epochs):
            self.train_epoch(epoch)
            vl = self.val_loss()
            scores = self.humaneval()
            metrics = {"val_loss": vl, **scores}
            self.log(f"epoch {epoch} " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
            if self.is_main:
                self.save(f"epoch{epoch}", metrics)
                if scores["pass@1"] > self.best:
                    self.best = scores["pass@1"]
                    self.save("best", metrics)
            dist.barrier()
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="stabilityai/stable-code-3b")
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--val_tokens", required=True)
    ap.add_argument("--out_dir", default="runs/stablecode-ft")
    ap.add_argument("--block", type=int, default=4096)
    ap.add_argument("--micro_bs", type=int, default=2)
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--n_samples", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    Trainer(ap.parse_args()).fit()


if __name__ == "__main__":
    main()
