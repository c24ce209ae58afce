"""Fine-tune CodeGen-350M-mono on function-level instruction data extracted from
permissively licensed repositories; evaluate pass@1 / pass@10 with sampled
completions executed in a subprocess sandbox.

Single node, one process per GPU started with torch.multiprocessing:

    python 02_codegen_spawn_passk.py --data data/fn_instruct.jsonl --gpus 4
"""
import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
from dataclasses import dataclass, asdict

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_linear_schedule_with_warmup


@dataclass
class Config:
    model: str = "Salesforce/codegen-350M-mono"
    data: str = "data/fn_instruct.jsonl"
    problems: str = "data/humaneval.jsonl"
    out_dir: str = "checkpoints/codegen_fn"
    resume: str = ""
    max_len: int = 1024
    batch_size: int = 8
    lr: float = 5e-5
    epochs: int = 2
    warmup: int = 200
    n_samples: int = 10
    temperature: float = 0.8
    exec_timeout: float = 5.0
    port: int = 29512
    gpus: int = 0
    seed: int = 0


def pass_at_k(n, c, k):
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def _limit_resources():
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))


def execute(program, timeout):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "prog.py")
        with open(path, "w") as f:
            f.write(program)
        try:
            r = subprocess.run([sys.executable, "-I", path], cwd=tmp, timeout=timeout,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               preexec_fn=_limit_resources)
            return r.returncode == 0
        except subprocess.TimeoutExpired:
            return False


class FunctionDataset(Dataset):
    def __init__(self, path, tokenizer, max_len):
        self.items = []
        with open(path) as f:
            for line in f:
                ex = json.loads(line)
                text = f"# {ex['repo']}\n{ex['signature']}\n    \"\"\"{ex['docstring']}\"\"\"\n{ex['body']}"
                ids = tokenizer(text + tokenizer.eos_token, truncation=True, max_length=max_len)["input_ids"]
                if len(ids) > 16:
                    self.items.append(ids)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return torch.tensor(self.items[i], dtype=torch.long)


def collate_right_pad(batch, pad_id=0):
    n = max(x.numel() for x in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    for i, x in enumerate(batch):
        ids[i, : x.numel()] = x
        mask[i, : x.numel()] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


@torch.no_grad()
def sample_and_check(model, tokenizer, problems, cfg, rank, world_size, device):
    model.eval()
    torch.cuda.manual_seed(cfg.seed + 1000 * rank)
    local = {}
    for prob in problems[rank::world_size]:
        enc = tokenizer([prob["prompt"]] * cfg.n_samples, return_tensors="pt").to(device)
        out = model.generate(**enc, do_sample=True, temperature=cfg.temperature, top_p=0.95,
                             max_new_tokens=256, pad_token_id=tokenizer.eos_token_id)
        n_ok = 0
        for row in out[:, enc["input_ids"].shape[1]:]:
            body = tokenizer.decode(row, skip_special_tokens=True)
            for stop in ("\ndef ", "\nclass ", "\nif __name__", "\n#"):
                body = body.split(stop)[0]
            prog = prob["prompt"] + body + "\n\n" + prob["test"] + f"\ncheck({prob['entry_point']})\n"
            n_ok += execute(prog, cfg.exec_timeout)
        local[prob["task_id"]] = n_ok
    parts = [None] * world_size
    dist.all_gather_object(parts, local)
    model.train()
    merged = {}
    for p in parts:
        merged.update(p)
    return {f"pass@{k}": float(np.mean([pass_at_k(cfg.n_samples, c, k) for c in merged.values()]))
            for k in (1, 10) if k <= cfg.n_samples}


def worker(rank, world_size, cfg):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    device = torch.device(f"cuda:{rank}")
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    tokenizer.pad_token = tokenizer.eos_token
    dataset = FunctionDataset(cfg.data, tokenizer, cfg.max_len)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed)
    loader = DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler,
                        collate_fn=collate_right_pad, num_workers=4, pin_memory=True)

    model = AutoModelForCausalLM.from_pretrained(cfg.model).to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = DDP(model, device_ids=[rank])

    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1)
    total = len(loader) * cfg.epochs
    sched = get_linear_schedule_with_warmup(optim, cfg.warmup, total)

    start_epoch = 0
    if cfg.resume and os.path.isfile(cfg.resume):
        ckpt = torch.load(cfg.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optim.load_state_dict(ckpt["optim"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch = ckpt["epoch"] + 1
        if rank == 0:
            print(f"resumed from {cfg.resume} at epoch {start_epoch}")

    with open(cfg.problems) as f:
        problems = [json.loads(l) for l in f]

    for epoch in range(start_epoch, cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(2, device=device)
        for step, (ids, mask, labels) in enumerate(loader):
            ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            loss_sum += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if rank == 0 and step % 50 == 0:
                print(f"[ep {epoch} it {step}/{len(loader)}] loss {loss.item():.4f} (rank 0 batch)")

        dist.all_reduce(loss_sum)
        metrics = sample_and_check(model.module, tokenizer, problems, cfg, rank, world_size, device)
        if rank == 0:
            print(f"epoch {epoch}: train loss {(loss_sum[0] / loss_sum[1]).item():.4f} {metrics}")
            os.makedirs(cfg.out_dir, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optim": optim.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "cfg": asdict(cfg), "metrics": metrics},
                       os.path.join(cfg.out_dir, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    for name, default in asdict(Config()).items():
        parser.add_argument(f"--{name}", type=type(default), default=default)
    cfg = Config(**vars(parser.parse_args()))
    world_size = cfg.gpus or torch.cuda.device_count()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(cfg.port))
    mp.spawn(worker, args=(world_size, cfg), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
