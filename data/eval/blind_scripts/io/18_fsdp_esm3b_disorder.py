#!/usr/bin/env python
"""Intrinsic disorder prediction (per residue, DisProt + PDB-missing-residue labels)
by fine-tuning ESM-2 3B with FSDP (FULL_SHARD, bf16).

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 \
        18_fsdp_esm3b_disorder.py --train /shared/disorder/train.jsonl --valid /shared/disorder/valid.jsonl \
        --save_dir /shared/ckpt/esm3b_disorder
"""
import argparse
import functools
import json
import os
import random
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, EsmForTokenClassification
from transformers.models.esm.modeling_esm import EsmLayer


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--model_name", default="facebook/esm2_t36_3B_UR50D")
    ap.add_argument("--crop", type=int, default=1000)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--save_dir", required=True)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


class DisorderSet(Dataset):
    """{"seq": str, "disorder": str of '0'/'1'/'-' (unknown)} per line."""

    def __init__(self, path, crop, train):
        self.items = [json.loads(l) for l in open(path)]
        self.crop, self.train = crop, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        seq, lab = self.items[i]["seq"], self.items[i]["disorder"]
        if len(seq) > self.crop:
            s = random.randint(0, len(seq) - self.crop) if self.train else 0
            seq, lab = seq[s:s + self.crop], lab[s:s + self.crop]
        y = [-100 if c == "-" else int(c) for c in lab]
        return seq, y


class Collate:
    def __init__(self, tok):
        self.tok = tok

    def __call__(self, batch):
        seqs, ys = zip(*batch)
        enc = self.tok(list(seqs), padding=True, return_tensors="pt")
        labels = torch.full(enc["input_ids"].shape, -100, dtype=torch.long)
        for b, y in enumerate(ys):
            labels[b, 1:1 + len(y)] = torch.tensor(y)
        enc["labels"] = labels
        return enc


def save_full_model(model, path, rank):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    if rank == 0:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            cpu_state = model.state_dict()
        torch.save(cpu_state, path)
    dist.barrier()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    # confusion counts at threshold 0.5 and cross-entropy sum
    stats = torch.zeros(6, device=device, dtype=torch.float64)   # tp, fp, tn, fn, loss_sum, n
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch)
        valid = batch["labels"] != -100
        pred = out.logits.argmax(-1)
        y = batch["labels"]
        stats[0] += ((pred == 1) & (y == 1) & valid).sum()
        stats[1] += ((pred == 1) & (y == 0) & valid).sum()
        stats[2] += ((pred == 0) & (y == 0) & valid).sum()
        stats[3] += ((pred == 0) & (y == 1) & valid).sum()
        stats[4] += out.loss.double() * valid.sum()
        stats[5] += valid.sum()
    dist.all_reduce(stats)
    tp, fp, tn, fn = stats[:4].tolist()
    sens, spec = tp / max(tp + fn, 1), tn / max(tn + fp, 1)
    mcc_den = ((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn)) ** 0.5
    model.train()
    return {"bac": 0.5 * (sens + spec), "mcc": (tp * tn - fp * fn) / max(mcc_den, 1e-8),
            "loss": (stats[4] / stats[5]).item()}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    random.seed(args.seed + rank)

    tok = AutoTokenizer.from_pretrained(args.model_name)
    model = EsmForTokenClassification.from_pretrained(args.model_name, num_labels=2)
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={EsmLayer}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                       buffer_dtype=torch.bfloat16),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.cuda.current_device(),
        use_orig_params=True,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    collate = Collate(tok)
    train_set = DisorderSet(args.train, args.crop, train=True)
    valid_set = DisorderSet(args.valid, args.crop, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    valid_sampler = DistributedSampler(valid_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=4, drop_last=True)
    valid_loader = DataLoader(valid_set, batch_size=4, sampler=valid_sampler, collate_fn=collate, num_workers=2)
    total = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total, pct_start=0.05)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        print(f"{world} ranks, {len(train_loader)} steps/epoch", flush=True)
    best_mcc = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 50 == 0:
                l = loss.detach().float()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {l.item():.4f} {time.time() - t0:.0f}s", flush=True)

        metrics = evaluate(model, valid_loader, device)
        if rank == 0:
            print(f"epoch {epoch} valid {metrics}", flush=True)
        if metrics["mcc"] > best_mcc:
            best_mcc = metrics["mcc"]
            save_full_model(model, os.path.join(args.save_dir, "best_model.pt"), rank)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
