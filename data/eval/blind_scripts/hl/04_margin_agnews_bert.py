#!/usr/bin/env python
# Active learning for topic classification (AG News) with margin sampling.
# Each round fine-tunes distilbert-base-uncased from the pretrained checkpoint on the
# labelled set, then scores the unlabelled pool (sharded across GPUs) by the margin
# between the two most likely classes and queries the smallest-margin examples.
#
#   torchrun --nproc_per_node=4 04_margin_agnews_bert.py --rounds 10 --budget 500
import argparse
import json
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger("al")


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name", default="distilbert-base-uncased")
    parser.add_argument("--output_dir", default="outputs/agnews_margin")
    parser.add_argument("--init_size", type=int, default=200)
    parser.add_argument("--budget", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--train_batch_size", type=int, default=8, help="per device")
    parser.add_argument("--eval_batch_size", type=int, default=128, help="per device")
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--warmup_ratio", type=float, default=0.1)
    parser.add_argument("--max_len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


class Collator:
    def __init__(self, tokenizer, max_len):
        self.tok = tokenizer
        self.max_len = max_len

    def __call__(self, batch):
        texts = [b["text"] for b in batch]
        enc = self.tok(texts, truncation=True, max_length=self.max_len, padding=True, return_tensors="pt")
        enc["labels"] = torch.tensor([b["label"] for b in batch])
        enc["idx"] = torch.tensor([b["idx"] for b in batch])
        return enc


def fine_tune(model, loader, sampler, args):
    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=args.lr)
    total = len(loader) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(args.warmup_ratio * total), total)
    model.train()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items() if k != "idx"}
            out = model(**batch)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)


@torch.no_grad()
def predict(model, loader):
    model.eval()
    probs, labels, idxs = [], [], []
    for batch in loader:
        idxs.append(batch.pop("idx").cuda())
        labels.append(batch.pop("labels").cuda())
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        probs.append(F.softmax(model(**batch).logits.float(), dim=-1))
    return torch.cat(probs), torch.cat(labels), torch.cat(idxs)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    # rank 0 downloads the dataset and the checkpoint first, the others then read the cache
    if rank != 0:
        dist.barrier()
    raw = load_dataset("ag_news")
    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    AutoModelForSequenceClassification.from_pretrained(args.model_name, num_labels=4)
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        dist.barrier()

    train_ds = raw["train"].add_column("idx", list(range(len(raw["train"]))))
    test_ds = raw["test"].add_column("idx", list(range(len(raw["test"]))))
    collate = Collator(tokenizer, args.max_len)

    g = np.random.default_rng(args.seed)
    labelled = g.choice(len(train_ds), args.init_size, replace=False).tolist()
    results = []

    test_sampler = DistributedSampler(test_ds, shuffle=False)
    test_loader = DataLoader(test_ds, batch_size=args.eval_batch_size, sampler=test_sampler,
                             collate_fn=collate, num_workers=2)

    for rnd in range(args.rounds + 1):
        t0 = time.time()
        model = AutoModelForSequenceClassification.from_pretrained(args.model_name, num_labels=4).cuda()
        model = DDP(model, device_ids=[local_rank])

        lab_ds = Subset(train_ds, labelled)
        sampler = DistributedSampler(lab_ds, shuffle=True, seed=args.seed + rnd)
        loader = DataLoader(lab_ds, batch_size=args.train_batch_size, sampler=sampler,
                            collate_fn=collate, num_workers=2, drop_last=False)
        fine_tune(model, loader, sampler, args)

        probs, labels, _ = predict(model.module, test_loader)
        acc = (probs.argmax(-1) == labels).float().mean().item()
        if rank == 0:
            logger.info("round %d | labelled %d | test acc %.4f | %.1fs", rnd, len(labelled), acc, time.time() - t0)
            results.append({"round": rnd, "n_labelled": len(labelled), "accuracy": acc})
            with open(os.path.join(args.output_dir, "results.json"), "w") as f:
                json.dump(results, f, indent=2)
            model.module.save_pretrained(os.path.join(args.output_dir, f"round_{rnd}"))
        if rnd == args.rounds:
            break

        # margin scores over the unlabelled pool, sharded across ranks
        lab_set = set(labelled)
        pool = [i for i in range(len(train_ds)) if i not in lab_set]
        pool_ds = Subset(train_ds, pool)
        pool_sampler = DistributedSampler(pool_ds, shuffle=False)
        pool_loader = DataLoader(pool_ds, batch_size=args.eval_batch_size, sampler=pool_sampler,
                                 collate_fn=collate, num_workers=2)
        p, _, idx = predict(model.module, pool_loader)
        top2 = p.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]

        all_margin = [torch.zeros_like(margin) for _ in range(world)]
        all_idx = [torch.zeros_like(idx) for _ in range(world)]
        dist.all_gather(all_margin, margin)
        dist.all_gather(all_idx, idx)
        margin, idx = torch.cat(all_margin), torch.cat(all_idx)

        order = torch.argsort(margin).tolist()
        new, seen = [], set()
        for j in order:
            i = int(idx[j])
            if i not in seen:
                seen.add(i)
                new.append(i)
            if len(new) == args.budget:
                break
        labelled = labelled + new
        del model

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
