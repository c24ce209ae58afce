"""Competence-based curriculum (Platanios et al., 2019) for AG News / DBpedia
text classification with a small Transformer encoder, trained with DDP.

Difficulty of a sample = percentile of its token length (or of its unigram
rarity).  At step t the model may only see samples with difficulty <= c(t),
    c(t) = min(1, sqrt(t * (1 - c0^2) / T + c0^2)).

    torchrun --standalone --nproc_per_node=4 03_competence_curriculum_text.py \
        --dataset ag_news --epochs 10 --wandb-project curriculum-text
"""
import argparse
import functools
import math
import os
from collections import Counter

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="ag_news", choices=["ag_news", "dbpedia_14"])
    p.add_argument("--tokenizer", default="bert-base-uncased")
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--difficulty", default="length", choices=["length", "rarity"])
    p.add_argument("--c0", type=float, default=0.1)
    p.add_argument("--curriculum-steps", type=int, default=20000)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--wandb-project", default="curriculum-text")
    p.add_argument("--run-name", default=None)
    p.add_argument("--save-dir", default="checkpoints/competence")
    return p.parse_args()


class TextEncoder(nn.Module):
    def __init__(self, vocab, num_classes, d_model=384, layers=6, heads=6, max_len=256, pad_id=0):
        super().__init__()
        self.pad_id = pad_id
        self.tok = nn.Embedding(vocab, d_model, padding_idx=pad_id)
        self.pos = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.1,
                                           batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, layers)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, ids):
        mask = ids.eq(self.pad_id)
        pos = torch.arange(ids.size(1), device=ids.device)
        h = self.tok(ids) + self.pos(pos)[None]
        h = self.enc(h, src_key_padding_mask=mask)
        h = self.norm(h)
        keep = (~mask).unsqueeze(-1).float()
        pooled = (h * keep).sum(1) / keep.sum(1).clamp(min=1)
        return self.head(pooled)


def competence(step, total, c0):
    return min(1.0, math.sqrt(step * (1 - c0 ** 2) / total + c0 ** 2))


def difficulty_percentiles(ids_list, kind):
    if kind == "length":
        raw = np.array([len(x) for x in ids_list], dtype=np.float64)
    else:
        freq = Counter(t for x in ids_list for t in x)
        total = sum(freq.values())
        raw = np.array([-sum(math.log(freq[t] / total) for t in x) for x in ids_list])
    order = raw.argsort(kind="stable")
    pct = np.empty_like(raw)
    pct[order] = np.arange(len(raw)) / (len(raw) - 1)
    return pct


def collate(batch, pad_id):
    ids = [torch.tensor(b["input_ids"]) for b in batch]
    labels = torch.tensor([b["label"] for b in batch])
    ids = nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=pad_id)
    return ids, labels


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    text_key = "text" if args.dataset == "ag_news" else "content"

    def tokenize(batch):
        return tok(batch[text_key], truncation=True, max_length=args.max_len, add_special_tokens=True)

    # rank 0 downloads and tokenizes, the others hit the HF cache afterwards
    if rank != 0:
        dist.barrier()
    raw = load_dataset(args.dataset)
    ds = raw.map(tokenize, batched=True, remove_columns=[c for c in raw["train"].column_names if c != "label"])
    if rank == 0:
        dist.barrier()

    train, test = ds["train"], ds["test"]
    num_classes = raw["train"].features["label"].num_classes
    pct = difficulty_percentiles(train["input_ids"], args.difficulty)
    order = np.argsort(pct, kind="stable")

    pad_id = tok.pad_token_id
    coll = functools.partial(collate, pad_id=pad_id)
    test_loader = DataLoader(Subset(test, range(rank, len(test), world)), batch_size=256, collate_fn=coll)

    model = TextEncoder(tok.vocab_size, num_classes, args.d_model, args.layers, max_len=args.max_len,
                        pad_id=pad_id).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * math.sqrt(world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)

    os.makedirs(args.save_dir, exist_ok=True)
    step = 0
    for epoch in range(args.epochs):
        # the admitted pool is the same on every rank (difficulty is deterministic)
        c = competence(step, args.curriculum_steps, args.c0)
        n_admit = max(args.batch_size * world, int(c * len(order)))
        pool = Subset(train, order[:n_admit].tolist())
        sampler = DistributedSampler(pool, shuffle=True, seed=1234, drop_last=True)
        sampler.set_epoch(epoch)
        loader = DataLoader(pool, batch_size=args.batch_size, sampler=sampler, collate_fn=coll,
                            num_workers=2, drop_last=True)

        model.train()
        for ids, labels in loader:
            ids, labels = ids.to(device), labels.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(ids), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            if step % 50 == 0:
                wandb.log({"train/loss": loss.item(), "curriculum/competence": c,
                           "curriculum/pool": n_admit}, step=step)

        model.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for ids, labels in test_loader:
                ids, labels = ids.to(device), labels.to(device)
                pred = model.module(ids).argmax(-1)
                acc[0] += (pred == labels).sum()
                acc[1] += labels.numel()
        dist.all_reduce(acc)
        test_acc = (acc[0] / acc[1]).item()
        wandb.log({"test/acc": test_acc, "epoch": epoch}, step=step)
        if rank == 0:
            print(f"epoch {epoch} competence {c:.3f} pool {n_admit} test_acc {test_acc:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch, "step": step}, os.path.join(args.save_dir, "last.pt"))

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
