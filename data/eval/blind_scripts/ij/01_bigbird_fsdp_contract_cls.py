#!/usr/bin/env python
"""Contract-type classification with BigBird (block-sparse) sharded by FSDP.

Contracts in the corpus have a median length of ~9k word pieces, so we keep the
first --max_length tokens and rely on block-sparse attention. The model is
wrapped per BigBirdLayer with FSDP FULL_SHARD and bf16 compute.
"""
import argparse
import functools
import json
import logging
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import accuracy_score, f1_score
from torch.distributed.fsdp import (
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, BigBirdModel, get_linear_schedule_with_warmup
from transformers.models.big_bird.modeling_big_bird import BigBirdLayer

logger = logging.getLogger("contract_cls")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name", default="google/bigbird-roberta-base")
    p.add_argument("--train_file", required=True)
    p.add_argument("--dev_file", required=True)
    p.add_argument("--label_file", required=True, help="one contract type per line")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--init_from", default=None, help="full state dict from an earlier run")
    p.add_argument("--max_length", type=int, default=4096)
    p.add_argument("--per_device_batch_size", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--warmup_ratio", type=float, default=0.06)
    p.add_argument("--log_every", type=int, default=25)
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--num_workers", type=int, default=4)
    return p.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class ContractDataset(Dataset):
    def __init__(self, path, tokenizer, label2id, max_length):
        self.records = []
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                self.records.append((r["doc_id"], r["text"], label2id[r["contract_type"]]))
        self.tok = tokenizer
        self.max_length = max_length

    def __len__(self):
        return len(self.records)

    def __getitem__(self, idx):
        _, text, label = self.records[idx]
        enc = self.tok(
            text,
            truncation=True,
            max_length=self.max_length,
            padding="max_length",
            return_tensors="pt",
        )
        return {
            "idx": idx,
            "input_ids": enc["input_ids"][0],
            "attention_mask": enc["attention_mask"][0],
            "label": label,
        }


class BigBirdClassifier(nn.Module):
    def __init__(self, name, num_labels, dropout=0.1):
        super().__init__()
        self.encoder = BigBirdModel.from_pretrained(
            name, attention_type="block_sparse", add_pooling_layer=False
        )
        hidden = self.encoder.config.hidden_size
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(hidden, num_labels)

    def forward(self, input_ids, attention_mask):
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask)
        cls = out.last_hidden_state[:, 0]
        return self.head(self.dropout(cls))


@torch.no_grad()
def evaluate(model, loader, world_size):
    model.eval()
    local = []
    for batch in loader:
        logits = model(batch["input_ids"].cuda(non_blocking=True),
                       batch["attention_mask"].cuda(non_blocking=True))
        preds = logits.argmax(-1).tolist()
        for i, p, y in zip(batch["idx"].tolist(), preds, batch["label"].tolist()):
            local.append((i, p, y))

    gathered = [None] * world_size
    dist.all_gather_object(gathered, local)
    # DistributedSampler pads the last shard with repeated samples; keep one per index
    by_idx = {}
    for part in gathered:
        for i, p, y in part:
            by_idx[i] = (p, y)
    preds = [v[0] for v in by_idx.values()]
    golds = [v[1] for v in by_idx.values()]
    model.train()
    return {
        "n": len(by_idx),
        "accuracy": accuracy_score(golds, preds),
        "macro_f1": f1_score(golds, preds, average="macro"),
    }


def save_full_checkpoint(model, path, rank, extra):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        state = model.state_dict()
    if rank == 0:
        torch.save({"model": state, **extra}, path)
        logger.info("saved %s", path)
    dist.barrier()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(message)s",
    )
    set_seed(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)

    with open(args.label_file) as f:
        labels = [l.strip() for l in f if l.strip()]
    label2id = {l: i for i, l in enumerate(labels)}

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    train_ds = ContractDataset(args.train_file, tokenizer, label2id, args.max_length)
    dev_ds = ContractDataset(args.dev_file, tokenizer, label2id, args.max_length)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    # every rank must run the same number of forwards under FSDP, so the padded
    # sampler is used for dev as well and duplicates are dropped after the gather
    dev_sampler = DistributedSampler(dev_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.per_device_batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    dev_loader = DataLoader(dev_ds, batch_size=args.per_device_batch_size, sampler=dev_sampler,
                            num_workers=args.num_workers, pin_memory=True)

    model = BigBirdClassifier(args.model_name, len(labels))
    if args.init_from:
        state = torch.load(args.init_from, map_location="cpu")
        model.load_state_dict(state["model"])
        logger.info("initialised from %s", args.init_from)

    wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={BigBirdLayer})
    mp_policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = FSDP(
        model,
        auto_wrap_policy=wrap_policy,
        mixed_precision=mp_policy,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.cuda.current_device(),
        use_orig_params=True,
    )

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    total_steps = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(
        optimizer, int(args.warmup_ratio * total_steps), total_steps
    )

    best_f1 = -1.0
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for batch in train_loader:
            input_ids = batch["input_ids"].cuda(non_blocking=True)
            attention_mask = batch["attention_mask"].cuda(non_blocking=True)
            labels_t = batch["label"].cuda(non_blocking=True)

            logits = model(input_ids, attention_mask)
            loss = F.cross_entropy(logits.float(), labels_t)
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % args.log_every == 0:
                loss_t = loss.detach().clone()
                dist.all_reduce(loss_t, op=dist.ReduceOp.AVG)
                logger.info("epoch %d step %d loss %.4f lr %.2e (%.1fs)", epoch, step,
                            loss_t.item(), scheduler.get_last_lr()[0], time.time() - t0)

        metrics = evaluate(model, dev_loader, world_size)
        logger.info("epoch %d dev %s", epoch, json.dumps(metrics))
        if metrics["macro_f1"] > best_f1:
            best_f1 = metrics["macro_f1"]
            save_full_checkpoint(
                model,
                os.path.join(args.output_dir, "best.pt"),
                rank,
                {"epoch": epoch, "labels": labels, "dev": metrics},
            )

    save_full_checkpoint(model, os.path.join(args.output_dir, "last.pt"), rank,
                         {"epoch": args.epochs - 1, "labels": labels})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
