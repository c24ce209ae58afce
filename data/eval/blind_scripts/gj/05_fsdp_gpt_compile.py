"""GPT-2 XL style pretraining with FSDP (FULL_SHARD) and torch.compile.

Launch on two nodes:
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=$NODE_RANK \
        --master_addr=$MASTER_ADDR --master_port=29400 \
        fsdp_gpt_compile.py --config configs/gpt2xl.yaml
"""
import argparse
import functools
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEFAULTS = dict(
    data_dir="/lustre/data/openwebtext",
    out_dir="/lustre/ckpt/gpt2xl",
    n_layer=48, n_head=25, n_embd=1600, block_size=1024, vocab_size=50304,
    micro_batch=8, lr=2e-4, min_lr=2e-5, warmup_iters=2000, max_iters=60000,
    weight_decay=0.1, grad_clip=1.0, eval_every=1000, eval_iters=50, log_every=10,
)


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.n_head = c["n_head"]
        d = c["n_embd"]
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.wte = nn.Embedding(c["vocab_size"], c["n_embd"])
        self.wpe = nn.Embedding(c["block_size"], c["n_embd"])
        self.h = nn.ModuleList([Block(c) for _ in range(c["n_layer"])])
        self.ln_f = nn.LayerNorm(c["n_embd"])
        self.lm_head = nn.Linear(c["n_embd"], c["vocab_size"], bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))


class TokenWindows(Dataset):
    def __init__(self, path, block_size):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.block_size = block_size

    def __len__(self):
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i):
        s = i * self.block_size
        x = torch.from_numpy(self.data[s : s + self.block_size + 1].astype(np.int64))
        return x[:-1], x[1:]


def get_lr(it, c):
    if it < c["warmup_iters"]:
        return c["lr"] * (it + 1) / c["warmup_iters"]
    ratio = min(1.0, (it - c["warmup_iters"]) / (c["max_iters"] - c["warmup_iters"]))
    return c["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (c["lr"] - c["min_lr"])


@torch.no_grad()
def estimate_val_loss(model, loader, iters, device):
    model.eval()
    total = torch.zeros(2, device=device)
    for i, (x, y) in enumerate(loader):
        if i == iters:
            break
        total[0] += model(x.to(device), y.to(device))
        total[1] += 1
    dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=None)
    cfg = dict(DEFAULTS)
    cli = parser.parse_args()
    if cli.config:
        with open(cli.config) as f:
            cfg.update(yaml.safe_load(f) or {})

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1337)

    train_ds = TokenWindows(os.path.join(cfg["data_dir"], "train.bin"), cfg["block_size"])
    val_ds = TokenWindows(os.path.join(cfg["data_dir"], "val.bin"), cfg["block_size"])
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=1337, drop_last=True)
    # fixed seed and no set_epoch: every eval looks at the same random subset of val
    val_sampler = DistributedSampler(val_ds, shuffle=True, seed=0, drop_last=True)
    train_dl = DataLoader(train_ds, cfg["micro_batch"], sampler=train_sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, cfg["micro_batch"], sampler=val_sampler, num_workers=2, pin_memory=True, drop_last=True)

    model = GPT(cfg)
    wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    model = FSDP(
        model,
        auto_wrap_policy=wrap_policy,
        mixed_precision=bf16,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.cuda.current_device(),
        limit_all_gathers=True,
    )
    model = torch.compile(model)

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=cfg["weight_decay"])

    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        n_params = sum(p.numel() for p in model.parameters()) * world
        print(f"world={world} ~{n_params / 1e9:.2f}B params (sharded)", flush=True)

    it, epoch = 0, 0
    train_sampler.set_epoch(epoch)
    batches = iter(train_dl)
    t0 = time.time()
    while it < cfg["max_iters"]:
        try:
            x, y = next(batches)
        except StopIteration:
            epoch += 1
            train_sampler.set_epoch(epoch)
            batches = iter(train_dl)
            x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)

        lr = get_lr(it, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = model(x, y)
        loss.backward()
        model.clip_grad_norm_(cfg["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        it += 1

        if it % cfg["log_every"] == 0:
            l = loss.detach()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                dt = (time.time() - t0) / cfg["log_every"]
                tok_s = cfg["micro_batch"] * cfg["block_size"] * world / dt
                print(f"iter {it} loss {l.item():.4f} lr {lr:.2e} {dt * 1000:.0f} ms/it {tok_s:,.0f} tok/s", flush=True)
            t0 = time.time()

        if it % cfg["eval_every"] == 0 or it == cfg["max_iters"]:
            val = estimate_val_loss(model, val_dl, cfg["eval_iters"], device)
            save_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_cfg):
                state = model.state_dict()
            if rank == 0:
                print(f"iter {it} val loss {val:.4f}", flush=True)
                state = {k.replace("_orig_mod.", ""): v for k, v in state.items()}
                torch.save({"model": state, "iter": it, "val_loss": val, "config": cfg},
                           os.path.join(cfg["out_dir"], f"ckpt_{it:06d}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
