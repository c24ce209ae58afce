"""
Long-sequence DNA classifier (e.g. enhancer / non-enhancer, 4 kb windows).
Nucleotide-level transformer encoder with LayerDrop, activation checkpointing
to fit 4096-token sequences, trained with DDP.

    torchrun --nproc_per_node=4 19_dna_transformer_classifier.py \
        --train data/enhancers_train.tsv --valid data/enhancers_valid.tsv
"""
import argparse
import logging
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

VOCAB = {"[PAD]": 0, "[CLS]": 1, "A": 2, "C": 3, "G": 4, "T": 5, "N": 6}
logger = logging.getLogger("dna")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--valid", required=True)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layerdrop", type=float, default=0.1)
    p.add_argument("--grad-checkpointing", action="store_true", default=True)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--out", default="checkpoints/dna_tf")
    p.add_argument("--seed", type=int, default=11)
    return p.parse_args()


def setup_distributed():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return local_rank


def cleanup():
    dist.destroy_process_group()


def is_main_process():
    return dist.get_rank() == 0


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class SeqDataset(Dataset):
    """TSV: sequence<TAB>label"""

    def __init__(self, path, max_len):
        self.items = []
        with open(path) as f:
            for line in f:
                seq, label = line.rstrip("\n").split("\t")
                self.items.append((seq.upper(), int(label)))
        self.max_len = max_len

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        seq, label = self.items[i]
        ids = [VOCAB["[CLS]"]] + [VOCAB.get(c, VOCAB["N"]) for c in seq[: self.max_len - 1]]
        ids = ids + [VOCAB["[PAD]"]] * (self.max_len - len(ids))
        return torch.tensor(ids), torch.tensor(label, dtype=torch.float32)


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, pad_mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, key_padding_mask=pad_mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class DNATransformer(nn.Module):
    def __init__(self, dim, depth, heads, max_len, layerdrop=0.0, grad_ckpt=False):
        super().__init__()
        self.embed = nn.Embedding(len(VOCAB), dim, padding_idx=0)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 1)
        self.layerdrop = layerdrop
        self.grad_ckpt = grad_ckpt

    def forward(self, ids):
        pad_mask = ids == 0
        x = self.embed(ids) + self.pos(torch.arange(ids.size(1), device=ids.device))
        for blk in self.blocks:
            if self.training and self.layerdrop > 0 and random.random() < self.layerdrop:
                continue
            if self.grad_ckpt and self.training:
                x = checkpoint(blk, x, pad_mask, use_reentrant=True)
            else:
                x = blk(x, pad_mask)
        return self.head(self.norm(x[:, 0])).squeeze(-1)


@torch.no_grad()
def evaluate(model, loader, device, world_size):
    model.eval()
    scores, labels = [], []
    loss_sum = torch.zeros(2, device=device)
    for ids, y in loader:
        ids, y = ids.to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids).float()
        loss_sum[0] += F.binary_cross_entropy_with_logits(logits, y, reduction="sum")
        loss_sum[1] += y.numel()
        scores.append(logits.sigmoid())
        labels.append(y)
    scores, labels = torch.cat(scores), torch.cat(labels)
    # equal-size shards (drop_last sampler), so all_gather works directly
    all_scores = [torch.empty_like(scores) for _ in range(world_size)]
    all_labels = [torch.empty_like(labels) for _ in range(world_size)]
    dist.all_gather(all_scores, scores)
    dist.all_gather(all_labels, labels)
    dist.all_reduce(loss_sum)
    auc = roc_auc_score(torch.cat(all_labels).cpu().numpy(), torch.cat(all_scores).cpu().numpy())
    model.train()
    return (loss_sum[0] / loss_sum[1]).item(), auc


def main():
    args = parse_args()
    local_rank = setup_distributed()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if is_main_process() else logging.WARNING,
                        format="%(asctime)s %(message)s")
    seed_everything(args.seed + dist.get_rank())

    train_ds = SeqDataset(args.train, args.max_len)
    valid_ds = SeqDataset(args.valid, args.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    valid_sampler = DistributedSampler(valid_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=32, sampler=valid_sampler, num_workers=4)

    model = DNATransformer(args.dim, args.depth, args.heads, args.max_len,
                           layerdrop=args.layerdrop, grad_ckpt=args.grad_checkpointing).to(device)
    # LayerDrop skips whole blocks, so some parameters get no grad in a given step
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total_steps = args.epochs * len(train_loader)
    warmup = int(0.05 * total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * s / total_steps))))

    if is_main_process():
        os.makedirs(args.out, exist_ok=True)
        logger.info("%d train / %d valid, world %d, global batch %d",
                    len(train_ds), len(valid_ds), world_size, args.batch_size * world_size)

    best_auc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        pbar = tqdm(train_loader, disable=not is_main_process(), desc=f"epoch {epoch}")
        for ids, y in pbar:
            ids, y = ids.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(ids)
            loss = F.binary_cross_entropy_with_logits(logits.float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if is_main_process():
                pbar.set_postfix(loss=f"{loss.item():.4f}")

        val_loss, val_auc = evaluate(model, valid_loader, device, world_size)
        logger.info("epoch %d: val_loss %.4f  val_auc %.4f", epoch, val_loss, val_auc)
        if is_main_process() and val_auc > best_auc:
            best_auc = val_auc
            torch.save({"model": model.module.state_dict(), "args": vars(args), "epoch": epoch},
                       os.path.join(args.out, "best.pt"))
        dist.barrier()

    cleanup()


if __name__ == "__main__":
    main()
