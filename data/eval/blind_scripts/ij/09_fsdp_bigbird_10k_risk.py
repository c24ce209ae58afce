"""Multi-label tagging of 10-K Item 1A (risk factors) with a block-sparse
BigBird encoder (roberta-large size) under FSDP.

Launch (2 nodes x 8 GPUs, shared /fsx):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 \
        09_fsdp_bigbird_10k_risk.py --config configs/risk_bigbird_large.json
"""
import argparse
import functools
import json
import logging
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import (
    BackwardPrefetch,
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, BigBirdModel, get_cosine_schedule_with_warmup
from transformers.models.big_bird.modeling_big_bird import BigBirdLayer

logger = logging.getLogger("risk")

DEFAULTS = {
    "model": "google/bigbird-roberta-large",
    "data_dir": "/fsx/fin/risk_factors",
    "out_dir": "/fsx/runs/risk_bigbird_large",
    "max_len": 4096,
    "micro_batch": 1,
    "lr": 1.5e-5,
    "epochs": 4,
    "warmup_steps": 300,
    "threshold": 0.4,
    "save_every_epochs": 1,
}


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ns = ap.parse_args()
    cfg = dict(DEFAULTS)
    if ns.config:
        with open(ns.config) as f:
            cfg.update(json.load(f))
    return argparse.Namespace(**cfg)


class RiskDataset(Dataset):
    def __init__(self, path, tokenizer, taxonomy, max_len):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.tok = tokenizer
        self.tax = {t: i for i, t in enumerate(taxonomy)}
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        enc = self.tok(r["item_1a"], truncation=True, max_length=self.max_len,
                       padding="max_length", return_tensors="pt")
        y = torch.zeros(len(self.tax))
        for t in r["risk_categories"]:
            y[self.tax[t]] = 1.0
        return enc["input_ids"][0], enc["attention_mask"][0], y


class RiskTagger(nn.Module):
    def __init__(self, name, n_labels):
        super().__init__()
        self.bigbird = BigBirdModel.from_pretrained(name, attention_type="block_sparse",
                                                    add_pooling_layer=False)
        d = self.bigbird.config.hidden_size
        self.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(d, d), nn.Tanh(), nn.Dropout(0.1),
                                  nn.Linear(d, n_labels))

    def forward(self, input_ids, attention_mask):
        h = self.bigbird(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(h[:, 0])


@torch.no_grad()
def evaluate(model, loader, threshold, device, rank, world):
    model.eval()
    n = len(loader.dataset)
    stats = torch.zeros(3, device=device)  # tp, fp, fn (micro)
    seen = 0
    for ids, mask, y in loader:
        ids, mask, y = ids.to(device), mask.to(device), y.to(device)
        pred = (model(ids, mask).float().sigmoid() > threshold).float()
        # rank r holds padded positions r, r + world, ...; positions >= n are repeats
        pos = rank + world * torch.arange(seen, seen + ids.size(0), device=device)
        keep = (pos < n).float().unsqueeze(1)
        seen += ids.size(0)
        stats[0] += (keep * pred * y).sum()
        stats[1] += (keep * pred * (1 - y)).sum()
        stats[2] += (keep * (1 - pred) * y).sum()
    dist.all_reduce(stats)
    tp, fp, fn = stats.tolist()
    p, r = tp / max(tp + fp, 1), tp / max(tp + fn, 1)
    model.train()
    return {"micro_p": p, "micro_r": r, "micro_f1": 2 * p * r / max(p + r, 1e-9)}


def save_model(model, path, rank):
    if rank == 0:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
            cpu_state = model.state_dict()
        torch.save(cpu_state, path)
        logger.info("wrote %s", path)


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s r{rank}] %(message)s")
    torch.manual_seed(0)

    with open(os.path.join(cfg.data_dir, "taxonomy.json")) as f:
        taxonomy = json.load(f)
    tok = AutoTokenizer.from_pretrained(cfg.model)
    train_ds = RiskDataset(os.path.join(cfg.data_dir, "train.jsonl"), tok, taxonomy, cfg.max_len)
    dev_ds = RiskDataset(os.path.join(cfg.data_dir, "dev.jsonl"), tok, taxonomy, cfg.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    # padded sampler on purpose: FSDP needs the same number of forwards on every rank
    dev_sampler = DistributedSampler(dev_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=cfg.micro_batch, sampler=train_sampler,
                          num_workers=6, pin_memory=True, drop_last=True, persistent_workers=True)
    dev_dl = DataLoader(dev_ds, batch_size=cfg.micro_batch * 2, sampler=dev_sampler, num_workers=6)

    model = RiskTagger(cfg.model, len(taxonomy))
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                           transformer_layer_cls={BigBirdLayer}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        device_id=device,
        limit_all_gathers=True,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    total = len(train_dl) * cfg.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, cfg.warmup_steps, total)
    loss_fn = nn.BCEWithLogitsLoss()

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
    step = 0
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for ids, mask, y in train_dl:
            ids, mask, y = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True), \
                y.to(device, non_blocking=True)
            loss = loss_fn(model(ids, mask).float(), y)
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 20 == 0 and rank == 0:
                logger.info("ep %d step %d/%d loss %.4f %.2fs/it", epoch, step, total, loss.item(),
                            (time.time() - t0) / 20)
                t0 = time.time()

        metrics = evaluate(model, dev_dl, cfg.threshold, device, rank, world)
        logger.info("epoch %d dev %s", epoch, metrics)
        if (epoch + 1) % cfg.save_every_epochs == 0:
            save_model(model, os.path.join(cfg.out_dir, f"epoch{epoch}.pt"), rank)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
