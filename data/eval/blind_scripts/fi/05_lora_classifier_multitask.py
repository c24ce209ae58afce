#!/usr/bin/env python
"""Multi-task LoRA fine-tuning of an encoder: intent + sentiment heads on one adapter.

Batches alternate between the two tasks; each task has its own linear head on top of the
shared LoRA-adapted encoder.

    torchrun --nproc_per_node=4 05_lora_classifier_multitask.py \
        --encoder microsoft/deberta-v3-large --data_dir data/cx --out runs/cx-multitask
"""
import argparse
import itertools
import json
import logging
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup
from peft import LoraConfig, get_peft_model

logger = logging.getLogger("multitask")
TASKS = ("intent", "sentiment")


class TextLabelDataset(Dataset):
    def __init__(self, path, label2id):
        self.rows = [json.loads(l) for l in open(path)]
        self.label2id = label2id

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return r["text"], self.label2id[r["label"]]


class MultiTaskModel(nn.Module):
    def __init__(self, encoder, hidden, num_labels):
        super().__init__()
        self.encoder = encoder
        self.dropout = nn.Dropout(0.1)
        self.heads = nn.ModuleDict({t: nn.Linear(hidden, n) for t, n in num_labels.items()})

    def forward(self, task, input_ids, attention_mask):
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        pooled = self.dropout(h[:, 0])
        return self.heads[task](pooled)


def load_label_map(path):
    with open(path) as f:
        labels = sorted(json.load(f))
    return {l: i for i, l in enumerate(labels)}


def make_loader(ds, tok, bs, rank, world, train, max_len):
    def collate(batch):
        texts, labels = zip(*batch)
        enc = tok(list(texts), padding=True, truncation=True, max_length=max_len, return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"], torch.tensor(labels)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=train, drop_last=not train)
    return DataLoader(ds, batch_size=bs, sampler=sampler, collate_fn=collate, num_workers=2), sampler


@torch.no_grad()
def evaluate(model, loaders, device):
    model.eval()
    results = {}
    for task, loader in loaders.items():
        counts = torch.zeros(2, device=device)
        for ids, mask, y in loader:
            ids, mask, y = ids.to(device), mask.to(device), y.to(device)
            logits = model(task, ids, mask)
            counts[0] += (logits.argmax(-1) == y).sum()
            counts[1] += y.numel()
        dist.all_reduce(counts)
        results[task] = (counts[0] / counts[1]).item()
    model.train()
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--encoder", default="microsoft/deberta-v3-large")
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--out", default="runs/cx-multitask")
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--head_lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--max_len", type=int, default=256)
    ap.add_argument("--r", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN)
    torch.manual_seed(17)

    tok = AutoTokenizer.from_pretrained(args.encoder)
    label_maps = {t: load_label_map(os.path.join(args.data_dir, f"{t}_labels.json")) for t in TASKS}

    encoder = AutoModel.from_pretrained(args.encoder)
    lora_cfg = LoraConfig(r=args.r, lora_alpha=2 * args.r, lora_dropout=0.1,
                          target_modules=["query_proj", "key_proj", "value_proj", "dense"],
                          task_type="FEATURE_EXTRACTION")
    encoder = get_peft_model(encoder, lora_cfg)
    model = MultiTaskModel(encoder, encoder.config.hidden_size,
                           {t: len(m) for t, m in label_maps.items()}).to(device)
    model = DDP(model, device_ids=[local_rank])

    train_loaders, samplers, val_loaders = {}, {}, {}
    for t in TASKS:
        tr = TextLabelDataset(os.path.join(args.data_dir, f"{t}_train.jsonl"), label_maps[t])
        va = TextLabelDataset(os.path.join(args.data_dir, f"{t}_dev.jsonl"), label_maps[t])
        train_loaders[t], samplers[t] = make_loader(tr, tok, args.bs, rank, world, True, args.max_len)
        val_loaders[t], _ = make_loader(va, tok, args.bs, rank, world, False, args.max_len)

    steps_per_epoch = 2 * min(len(l) for l in train_loaders.values())
    head_params = list(model.module.heads.parameters())
    lora_params = [p for n, p in model.module.encoder.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([
        {"params": lora_params, "lr": args.lr},
        {"params": head_params, "lr": args.head_lr},
    ], weight_decay=0.01)
    total = steps_per_epoch * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.06 * total), total)

    best = 0.0
    for epoch in range(args.epochs):
        for t in TASKS:
            samplers[t].set_epoch(epoch)
        iters = {t: iter(train_loaders[t]) for t in TASKS}
        model.train()
        for step in range(steps_per_epoch):
            task = TASKS[step % len(TASKS)]
            ids, mask, y = next(iters[task])
            ids, mask, y = ids.to(device), mask.to(device), y.to(device)
            logits = model(task, ids, mask)
            loss = F.cross_entropy(logits, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if rank == 0 and step % 50 == 0:
                logger.info("epoch %d step %d task %s loss %.4f", epoch, step, task, loss.item())

        scores = evaluate(model.module, val_loaders, device)
        mean_acc = sum(scores.values()) / len(scores)
        logger.info("epoch %d dev %s mean %.4f", epoch, json.dumps(scores), mean_acc)
        if mean_acc > best:
            best = mean_acc
            if rank == 0:
                os.makedirs(args.out, exist_ok=True)
                model.module.encoder.save_pretrained(os.path.join(args.out, "adapter"))
                torch.save(model.module.heads.state_dict(), os.path.join(args.out, "heads.pt"))
                with open(os.path.join(args.out, "label_maps.json"), "w") as f:
                    json.dump(label_maps, f)
            dist.barrier()

    logger.info("best mean dev accuracy %.4f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
