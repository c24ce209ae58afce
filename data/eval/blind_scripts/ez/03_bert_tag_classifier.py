#!/usr/bin/env python
"""BERT encoder + sampled softmax over the full product-tag space.

    torchrun --nproc_per_node=8 03_bert_tag_classifier.py \
        --data-dir /mnt/shared/tagging/catalog_v7 \
        --model-path /mnt/shared/models/bert-base-multilingual-cased \
        --cache-dir /mnt/shared/tagging/cache --output-dir /mnt/shared/tagging/runs/bert_ss
"""
import argparse
import json
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup


def parse_args():
    parser = argparse.ArgumentParser(description="bert sampled-softmax tagger")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--cache-dir", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-len", type=int, default=64)
    parser.add_argument("--proj-dim", type=int, default=256)
    parser.add_argument("--num-neg", type=int, default=16384)
    parser.add_argument("--max-pos", type=int, default=16)
    parser.add_argument("--global-batch-size", type=int, default=512)
    parser.add_argument("--lr-encoder", type=float, default=3e-5)
    parser.add_argument("--lr-head", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--warmup-ratio", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def load_or_build(split, args, tokenizer):
    """Tokenised titles + label lists for one split, cached next to the data."""
    name = os.path.basename(args.model_path.rstrip("/"))
    cache_path = os.path.join(args.cache_dir, f"{split}_{name}_{args.max_len}.pt")
    if os.path.exists(cache_path):
        return torch.load(cache_path)
    titles, labels = [], []
    with open(os.path.join(args.data_dir, f"{split}.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            titles.append(rec["title"] + " " + rec.get("brand", ""))
            labels.append(rec["label_ids"])
    enc = tokenizer(titles, max_length=args.max_len, truncation=True,
                    padding="max_length", return_tensors="pt")
    data = {"input_ids": enc["input_ids"].to(torch.int32),
            "attention_mask": enc["attention_mask"].to(torch.int8),
            "labels": labels}
    os.makedirs(args.cache_dir, exist_ok=True)
    torch.save(data, cache_path)
    return data


class TokenizedDataset(Dataset):
    def __init__(self, data, max_pos):
        self.ids, self.mask, self.labels = data["input_ids"], data["attention_mask"], data["labels"]
        self.max_pos = max_pos

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        labs = self.labels[i][: self.max_pos]
        pos = torch.full((self.max_pos,), -1, dtype=torch.long)
        pos[: len(labs)] = torch.tensor(labs, dtype=torch.long)
        return self.ids[i].long(), self.mask[i].long(), pos


class BertTagger(nn.Module):
    def __init__(self, model_path, num_labels, proj_dim):
        super().__init__()
        self.bert = AutoModel.from_pretrained(model_path, add_pooling_layer=False)
        self.proj = nn.Linear(self.bert.config.hidden_size, proj_dim)
        self.label_emb = nn.Embedding(num_labels, proj_dim)
        nn.init.normal_(self.label_emb.weight, std=0.02)

    def embed(self, input_ids, attention_mask):
        out = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return F.normalize(self.proj(out[:, 0]), dim=-1)

    def forward(self, input_ids, attention_mask, cand):
        h = self.embed(input_ids, attention_mask)
        return 20.0 * h @ F.normalize(self.label_emb(cand), dim=-1).t()


@torch.no_grad()
def evaluate(model, loader, device, ks=(1, 3, 5)):
    model.eval()
    W = F.normalize(model.label_emb.weight, dim=-1)
    kmax = max(ks)
    disc = 1.0 / torch.log2(torch.arange(2, kmax + 2, device=device).double())
    stats = torch.zeros(2 * len(ks) + 1, device=device, dtype=torch.float64)
    for ids, mask, pos in loader:
        ids, mask, pos = ids.to(device), mask.to(device), pos.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = model.embed(ids, mask)
        top = (h.float() @ W.t()).topk(kmax, dim=1).indices
        hit = (top.unsqueeze(-1) == pos.unsqueeze(1)).any(-1).double()
        n_pos = (pos >= 0).sum(1)
        for j, k in enumerate(ks):
            stats[j] += hit[:, :k].sum() / k
            idcg = disc.cumsum(0)[(n_pos.clamp(max=k) - 1).clamp(min=0)]
            dcg = (hit[:, :k] * disc[:k]).sum(1)
            stats[len(ks) + j] += torch.where(n_pos > 0, dcg / idcg, torch.zeros_like(dcg)).sum()
        stats[-1] += ids.size(0)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    n = stats[-1].item()
    out = {f"P@{k}": stats[j].item() / n for j, k in enumerate(ks)}
    out.update({f"nDCG@{k}": stats[len(ks) + j].item() / n for j, k in enumerate(ks)})
    return out


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    with open(os.path.join(args.data_dir, "labels.txt")) as f:
        num_labels = sum(1 for _ in f)
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    train_data = load_or_build("train", args, tokenizer)
    test_data = load_or_build("test", args, tokenizer)

    train_ds = TokenizedDataset(train_data, args.max_pos)
    test_full = TokenizedDataset(test_data, args.max_pos)
    test_ds = Subset(test_full, list(range(rank, len(test_full), world_size)))
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.global_batch_size // world_size,
                              sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=256, num_workers=4, pin_memory=True)

    model = BertTagger(args.model_path, num_labels, args.proj_dim).to(device)
    ddp_model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.AdamW([
        {"params": model.bert.parameters(), "lr": args.lr_encoder},
        {"params": list(model.proj.parameters()) + list(model.label_emb.parameters()),
         "lr": args.lr_head},
    ], weight_decay=0.01)
    total = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total), total)
    writer = SummaryWriter(os.path.join(args.output_dir, "tb")) if rank == 0 else None

    step, best = 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for ids, mask, pos in train_loader:
            ids = ids.to(device, non_blocking=True)
            mask = mask.to(device, non_blocking=True)
            pos = pos.to(device, non_blocking=True)
            valid = pos >= 0
            neg = torch.randint(0, num_labels, (args.num_neg,), device=device)
            cand = torch.unique(torch.cat([pos[valid], neg]))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = ddp_model(ids, mask, cand)
            target = torch.zeros(logits.shape, device=device)
            target.scatter_add_(1, torch.searchsorted(cand, pos.clamp(min=0)), valid.float())
            target = target.clamp(max=1.0)
            target = target / target.sum(1, keepdim=True).clamp(min=1.0)
            loss = -(target * F.log_softmax(logits.float(), dim=-1)).sum(1).mean()

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if writer is not None and step % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/lr_head", scheduler.get_last_lr()[1], step)

        metrics = evaluate(model, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()), flush=True)
            for k, v in metrics.items():
                writer.add_scalar(f"test/{k}", v, epoch)
            if metrics["P@1"] > best:
                best = metrics["P@1"]
                torch.save({"model": model.state_dict(), "epoch": epoch, "metrics": metrics},
                           os.path.join(args.output_dir, "best.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
