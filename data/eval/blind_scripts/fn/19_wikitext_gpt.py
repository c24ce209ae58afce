"""Small GPT on WikiText-103 (GPT-2 BPE), used for the optimizer ablations in the lab report.

    torchrun --nproc_per_node=4 19_wikitext_gpt.py optimizer=adamw seed=null
    torchrun --nproc_per_node=4 19_wikitext_gpt.py -m optimizer=adamw,lion,sophia seed=1,2,3
"""
import logging
import math
import os
import time

import hydra
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate, to_absolute_path
from omegaconf import DictConfig, OmegaConf, open_dict
from torch.nn.parallel import DistributedDataParallel as DDP

log = logging.getLogger(__name__)


def shared_seed(cfg_seed):
    """Use the configured seed, or draw one on rank 0 and share it so all ranks agree."""
    if cfg_seed is not None:
        return int(cfg_seed)
    t = torch.randint(0, 2**31 - 1, (1,), device="cuda")
    dist.broadcast(t, src=0)
    return int(t.item())


class Block(nn.Module):
    def __init__(self, d, n_heads, dropout):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, n_heads, dropout=dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, d_model, n_layers, n_heads, dropout=0.1):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Parameter(torch.zeros(1, block_size, d_model))
        self.blocks = nn.ModuleList([Block(d_model, n_heads, dropout) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.tok.weight
        mask = torch.triu(torch.full((block_size, block_size), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx):
        T = idx.size(1)
        x = self.tok(idx) + self.pos[:, :T]
        for blk in self.blocks:
            x = blk(x, self.mask[:T, :T])
        return self.lm_head(self.ln_f(x))


def get_batch(data, block_size, batch_size, device, gen):
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=gen)
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


@torch.no_grad()
def estimate_loss(model, data, cfg, device, gen):
    model.eval()
    losses = torch.zeros(cfg.train.eval_iters, device=device)
    for k in range(cfg.train.eval_iters):
        x, y = get_batch(data, cfg.model.block_size, cfg.train.batch_size, device, gen)
        logits = model(x)
        losses[k] = nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
    loss = losses.mean()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    model.train()
    return loss.item()


@hydra.main(version_base="1.3", config_path="configs", config_name="gpt")
def main(cfg: DictConfig):
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    seed = shared_seed(cfg.seed)
    with open_dict(cfg):
        cfg.seed = seed

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(seed)
    out_dir = HydraConfig.get().runtime.output_dir
    if rank == 0:
        OmegaConf.save(cfg, os.path.join(out_dir, "resolved_config.yaml"))
        log.info("seed %d, world size %d", seed, world)

    # token files produced by prepare_wikitext.py (uint16 GPT-2 ids)
    data_dir = to_absolute_path(cfg.data.dir)
    train_data = np.memmap(os.path.join(data_dir, "train.bin"), dtype=np.uint16, mode="r")
    val_data = np.memmap(os.path.join(data_dir, "val.bin"), dtype=np.uint16, mode="r")
    # different batches on each rank, reproducible per (seed, rank)
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    eval_gen = torch.Generator().manual_seed(seed * 1000 + rank + 7)

    model = GPT(cfg.model.vocab_size, cfg.model.block_size, cfg.model.d_model, cfg.model.n_layers,
                cfg.model.n_heads, cfg.model.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = instantiate(cfg.optimizer, params=[{"params": decay, "weight_decay": cfg.optimizer.weight_decay},
                                                  {"params": no_decay, "weight_decay": 0.0}])

    def lr_lambda(it):
        if it < cfg.train.warmup_iters:
            return (it + 1) / cfg.train.warmup_iters
        r = (it - cfg.train.warmup_iters) / max(1, cfg.train.max_iters - cfg.train.warmup_iters)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(r, 1.0)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    best_val = float("inf")
    t0 = time.time()
    for it in range(cfg.train.max_iters):
        x, y = get_batch(train_data, cfg.model.block_size, cfg.train.batch_size, device, gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
            loss = nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        optimizer.step()
        scheduler.step()

        if rank == 0 and it % cfg.train.log_every == 0:
            dt = time.time() - t0
            t0 = time.time()
            log.info("iter %d loss %.4f lr %.2e (%.1f ms/it)", it, loss.item(), scheduler.get_last_lr()[0],
                     1000 * dt / max(1, cfg.train.log_every))

        if (it + 1) % cfg.train.eval_interval == 0:
            val_loss = estimate_loss(model, val_data, cfg, device, eval_gen)
            if rank == 0:
                log.info("iter %d val loss %.4f ppl %.2f", it + 1, val_loss, math.exp(val_loss))
                if val_loss < best_val:
                    best_val = val_loss
                    torch.save({"model": model.module.state_dict(), "iter": it + 1, "val_loss": val_loss,
                                "cfg": OmegaConf.to_container(cfg)}, os.path.join(out_dir, "ckpt.pt"))

    dist.destroy_process_group()
    return best_val


if __name__ == "__main__":
    main()
