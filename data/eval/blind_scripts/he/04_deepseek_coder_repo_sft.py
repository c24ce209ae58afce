#!/usr/bin/env python
# Full fine-tuning of deepseek-coder-1.3b-base on repository-level instruction data.
# Each training record is built from a repository: README/issue text as the instruction,
# the implementing function (plus the file's imports) as the answer.
#
# Evaluation: greedy HumanEval completions, executed with the task's check() in a
# throw-away interpreter; pass@1 is reported across all ranks.
#
#   torchrun --standalone --nproc_per_node=4 04_deepseek_coder_repo_sft.py --config configs/ds13b.json
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.optimization import get_constant_schedule_with_warmup

DEFAULTS = {
    "model_name": "deepseek-ai/deepseek-coder-1.3b-base",
    "train_path": "data/repo_sft/train.jsonl",
    "humaneval_path": "data/HumanEval.jsonl",
    "save_dir": "ckpt/ds13b_repo_sft",
    "seq_len": 4096,
    "micro_bsz": 2,
    "accum": 4,
    "lr": 1e-5,
    "warmup": 50,
    "epochs": 2,
    "eval_interval": 400,
    "gen_bsz": 16,
    "max_new_tokens": 512,
    "timeout": 8,
}


class Trainer:
    def __init__(self, cfg):
        self.cfg = cfg
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = torch.device(f"cuda:{self.local_rank}")

        self.tok = AutoTokenizer.from_pretrained(cfg["model_name"])
        if self.tok.pad_token_id is None:
            self.tok.pad_token = self.tok.eos_token
        model = AutoModelForCausalLM.from_pretrained(cfg["model_name"], torch_dtype=torch.bfloat16,
                                                     attn_implementation="sdpa")
        model.to(self.device)
        self.model = DDP(model, device_ids=[self.local_rank])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95),
                                     weight_decay=0.05, eps=1e-6)
        self.sched = get_constant_schedule_with_warmup(self.opt, cfg["warmup"])

        self.train_ds = RepoInstructionSet(cfg["train_path"], self.tok, cfg["seq_len"])
        self.sampler = DistributedSampler(self.train_ds, shuffle=True)
        self.loader = DataLoader(self.train_ds, batch_size=cfg["micro_bsz"], sampler=self.sampler,
                                 collate_fn=self.train_ds.collate, num_workers=4, pin_memory=True,
                                 persistent_workers=True)
        with open(cfg["humaneval_path"]) as f:
            self.problems = [json.loads(x) for x in f]

    def log(self, msg):
        if self.rank == 0:
            print(time.strftime("%H:%M:%S"), msg, flush=True)

    # ---------------------------------------------------------------- evaluation
    @torch.no_grad()
    def humaneval_pass1(self):
        net = self.model.module
        net.eval()
        self.tok.padding_side = "left"
        shard = self.problems[self.rank::self.world]
        outcomes = []
        for i in range(0, len(shard), self.cfg["gen_bsz"]):
            probs = shard[i:i + self.cfg["gen_bsz"]]
            enc = self.tok([p["prompt"] for p in probs], return_tensors="pt", padding=True).to(self.device)
            out = net.generate(**enc, do_sample=False, max_new_tokens=self.cfg["max_new_tokens"],
                               eos_token_id=self.tok.eos_token_id, pad_token_id=self.tok.pad_token_id)
            texts = self.tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            for p, t in zip(probs, texts):
                outcomes.append(check_program(p, t, self.cfg["timeout"]))
        self.tok.padding_side = "right"
        net.train()

        stats = torch.tensor([sum(outcomes), len(outcomes)], dtype=torch.long)
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)
        return stats[0].item() / max(stats[1].item(), 1)

    # ---------------------------------------------------------------- training
    def save(self, tag):
        if self.rank == 0:
            path = os.path.join(self.cfg["save_dir"], tag)
            self.model.module.save_pretrained(path)
            self.tok.save_pretrained(path)
            self.log(f"saved {path}")
        dist.barrier()

    def fit(self):
        cfg = self.cfg
        step = 0
        best = 0.0
        window = torch.zeros(2, device=self.device)
        for epoch in range(cfg["epochs"]):
            self.sampler.set_epoch(epoch)
            for it, batch in enumerate(self.loader):
                batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
                last_micro = (it + 1) % cfg["accum"] == 0
                if last_micro:
                    loss = self.model(**batch).loss / cfg["accum"]
                    loss.backward()
                else:
                    with self.model.no_sync():
                        loss = self.model(**batch).loss / cfg["accum"]
                        loss.backward()
                window[0] += loss.detach().float()
                if not last_micro:
                    continue
                window[1] += 1
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                self.opt.step()
                self.sched.step()
                self.opt.zero_grad(set_to_none=True)
                step += 1

                if step % 25 == 0:
                    dist.all_reduce(window)
                    self.log(f"ep {epoch} step {step} loss {(window[0] / window[1]).item():.4f}")
                    window.zero_()
                if step % cfg["eval_interval"] == 0:
                    score = self.humaneval_pass1()
                    self.log(f"step {step} humaneval pass@1 {score:.3f}")
                    if score > best:
                        best = score
                        self.save("best")
            self.save(f"epoch{epoch}")
        score = self.humaneval_pass1()
        self.log(f"final humaneval pass@1 {score:.3f} (best {best:.3f})")
        dist.destroy_process_group()


class RepoInstructionSet(Dataset):
    def __init__(self, path, tok, seq_len):
        self.tok = tok
        self.rows = []
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                prompt = f"# Repository: {r['repo_name']}\n# Task:\n{r['instruction']}\n\n"
                answer = (r.get("imports", "") + "\n" + r["code"]).strip() + "\n"
                a = tok(prompt, add_special_tokens=True)["input_ids"]
                b = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                ids = (a + b)[:seq_len]
                lab = ([-100] * len(a) + b)[:seq_len]
                self.rows.append((ids, lab))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    def collate(self, items):
        L = max(len(x) for x, _ in items)
        pad = self.tok.pad_token_id
        return {
            "input_ids": torch.tensor([x + [pad] * (L - len(x)) for x, _ in items]),
            "labels": torch.tensor([y + [-100] * (L - len(y)) for _, y in items]),
            "attention_mask": torch.tensor([[1] * len(x) + [0] * (L - len(x)) for x, _ in items]),
        }


def check_program(problem, completion, timeout):
    for stop in ("\ndef ", "\nclass ", "\nif __name__", "\n```"):
        completion = completion.split(stop)[0]
    program = (problem["prompt"] + completion + "\n\n" + problem["test"] + "\n"
               + f"check({problem['entry_point']})\n")
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "solution.py")
        with open(f, "w") as fh:
            fh.write(program)
        proc = subprocess.Popen([sys.executable, f], cwd=d, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            return proc.wait(timeout=timeout) == 0
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--override", nargs="*", default=[], help="key=value pairs")
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    if a.config:
        with open(a.config) as f:
            cfg.update(json.load(f))
    for kv in a.override:
        k, v = kv.split("=", 1)
        cfg[k] = type(DEFAULTS[k])(v)
    Trainer(cfg).fit()


if __name__ == "__main__":
    main()
