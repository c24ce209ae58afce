"""Repository-level code completion fine-tune for deepseek-coder-1.3b.

The corpus (one JSON object per file, grouped by repo) is tokenized once into a flat
uint32 token file next to the data and memory-mapped for training, nanoGPT style.

    torchrun --standalone --nproc_per_node=4 03_deepseek_coder_memmap.py --config configs/ds13b_repo.yaml
"""

import argparse
import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer


@dataclass
class Config:
    model_name: str = "deepseek-ai/deepseek-coder-1.3b-base"
    data_dir: str = "data/repo_corpus"
    out_dir: str = "out/ds13b-repo"
    block_size: int = 16384
    micro_batch: int = 1
    grad_accum: int = 32
    lr: float = 2e-5
    min_lr: float = 2e-6
    warmup_iters: int = 100
    max_iters: int = 3000
    eval_interval: int = 250
    eval_iters: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 1337


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--max_iters", type=int, default=None)
    ns = ap.parse_args()
    cfg = Config()
    if ns.config:
        with open(ns.config) as f:
            overrides = yaml.safe_load(f) or {}
        cfg = dataclasses.replace(cfg, **overrides)
    if ns.max_iters is not None:
        cfg.max_iters = ns.max_iters
    return cfg


def tokenize_split(cfg, tokenizer, split):
    """Tokenize data_dir/{split}.jsonl into data_dir/{split}.bin (uint32), once."""
    bin_path = os.path.join(cfg.data_dir, f"{split}.bin")
    if os.path.exists(bin_path):
        return bin_path
    src = os.path.join(cfg.data_dir, f"{split}.jsonl")
    eos = tokenizer.eos_token_id
    with open(src) as f, open(bin_path, "wb") as out:
        for line in tqdm(f, desc=f"tokenizing {split}", disable=int(os.environ.get("RANK", 0)) != 0):
            ex = json.loads(line)
            header = f"# repo: {ex['repo']}\n# path: {ex['path']}\n"
            ids = tokenizer(header + ex["content"], add_special_tokens=False)["input_ids"]
            ids.append(eos)
            np.asarray(ids, dtype=np.uint32).tofile(out)
    return bin_path


class MemmapBlocks(Dataset):
    def __init__(self, bin_path, block_size):
        self.tokens = np.memmap(bin_path, dtype=np.uint32, mode="r")
        self.block_size = block_size
        self.n = (len(self.tokens) - 1) // block_size

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        start = i * self.block_size
        chunk = torch.from_numpy(self.tokens[start : start + self.block_size].astype(np.int64))
        return chunk


def lr_at(it, cfg):
    if it < cfg.warmup_iters:
        return cfg.lr * (it + 1) / cfg.warmup_iters
    ratio = (it - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (cfg.lr - cfg.min_lr)


@torch.no_grad()
def estimate_val_loss(raw_model, val_ds, cfg, rank, world, device):
    raw_model.eval()
    idx = list(range(rank, min(len(val_ds), cfg.eval_iters * world), world))
    acc = torch.zeros(2, device=device)
    for i in idx:
        x = val_ds[i].unsqueeze(0).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = raw_model(input_ids=x, labels=x).loss
        acc[0] += loss.float()
        acc[1] += 1
    dist.all_reduce(acc)
    raw_model.train()
    return (acc[0] / acc[1].clamp(min=1)).item()


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    master = rank == 0
    torch.manual_seed(cfg.seed)
    torch.backends.cuda.matmul.allow_tf32 = True

    tokenizer = AutoTokenizer.from_pretrained(cfg.model_name)
    train_bin = tokenize_split(cfg, tokenizer, "train")
    val_bin = tokenize_split(cfg, tokenizer, "val")
    train_ds = MemmapBlocks(train_bin, cfg.block_size)
    val_ds = MemmapBlocks(val_bin, cfg.block_size)
    if master:
        os.makedirs(cfg.out_dir, exist_ok=True)
        print(f"{len(train_ds)} train blocks of {cfg.block_size} tokens, {len(val_ds)} val blocks")

    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed)
    loader = DataLoader(train_ds, batch_size=cfg.micro_batch, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = AutoModelForCausalLM.from_pretrained(
        cfg.model_name, torch_dtype=torch.bfloat16, attn_implementation="flash_attention_2"
    )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.to(device)
    ddp_model = DDP(model, device_ids=[local_rank])
    raw_model = ddp_model.module

    optimizer = torch.optim.AdamW(raw_model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                  weight_decay=cfg.weight_decay, fused=True)

    it = 0
    epoch = 0
    sampler.set_epoch(epoch)
    data_iter = iter(loader)
    best_val = float("inf")
    t_last = time.time()
    while it < cfg.max_iters:
        for g in optimizer.param_groups:
            g["lr"] = lr_at(it, cfg)

        loss_accum = 0.0
        for micro in range(cfg.grad_accum):
            try:
                x = next(data_iter)
            except StopIteration:
                epoch += 1
                sampler.set_epoch(epoch)
                data_iter = iter(loader)
                x = next(data_iter)
            x = x.to(device, non_blocking=True)
            ddp_model.require_backward_grad_sync = micro == cfg.grad_accum - 1
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ddp_model(input_ids=x, labels=x).loss / cfg.grad_accum
            loss.backward()
            loss_accum += loss.item()

        norm = torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        it += 1

        if master and it % 10 == 0:
            dt = (time.time() - t_last) / 10
            t_last = time.time()
            print(f"iter {it} loss {loss_accum:.4f} gnorm {norm:.2f} lr {lr_at(it, cfg):.2e} {dt:.2f}s/it", flush=True)

        if it % cfg.eval_interval == 0 or it == cfg.max_iters:
            val_loss = estimate_val_loss(raw_model, val_ds, cfg, rank, world, device)
            if master:
                print(f"iter {it} val loss {val_loss:.4f}", flush=True)
                if val_loss < best_val:
                    best_val = val_loss
                    raw_model.save_pretrained(os.path.join(cfg.out_dir, "best"))
                    tokenizer.save_pretrained(os.path.join(cfg.out_dir, "best"))
                    torch.save({"optimizer": optimizer.state_dict(), "iter": it, "val_loss": val_loss},
                               os.path.join(cfg.out_dir, "best", "optim.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
