"""Uncertainty sampling (entropy) for DBpedia-14 ontology classification.

Large pool (560k documents), so scoring is the expensive part and is spread over
all GPUs. The classifier is re-fine-tuned from distilroberta-base every round.

    torchrun --nproc_per_node=8 10_entropy_dbpedia_roberta.py --rounds 6 --budget 2000
"""
import argparse
import json
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_cosine_schedule_with_warmup


def parse_args():
    parser = argparse.ArgumentParser(description="AL on DBpedia")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--model", default="distilroberta-base")
    parser.add_argument("--output_dir", default="./al_dbpedia")
    parser.add_argument("--init_size", type=int, default=1000)
    parser.add_argument("--budget", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--per_device_bs", type=int, default=16)
    parser.add_argument("--score_bs", type=int, default=256)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--max_length", type=int, default=192)
    parser.add_argument("--seed", type=int, default=17)
    return parser.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def make_collate(tokenizer, max_length):
    def collate(batch):
        enc = tokenizer([b["title"] + ". " + b["content"] for b in batch], truncation=True,
                        max_length=max_length, padding="longest", return_tensors="pt")
        enc["labels"] = torch.tensor([b["label"] for b in batch], dtype=torch.long)
        return enc
    return collate


def train_one_round(model, dataset, labelled, collate, args, device):
    sub = Subset(dataset, labelled)
    sampler = DistributedSampler(sub, shuffle=True, seed=args.seed)
    loader = DataLoader(sub, batch_size=args.per_device_bs, sampler=sampler, collate_fn=collate,
                        num_workers=4, pin_memory=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    steps = args.epochs * len(loader)
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=math.ceil(0.06 * steps), num_training_steps=steps)
    model.train()
    for ep in range(args.epochs):
        sampler.set_epoch(ep)
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)


@torch.no_grad()
def infer(net, dataset, indices, collate, args, device, with_labels=False):
    """Sharded inference. Returns gathered (probs, positions[, labels]) on every rank."""
    sub = Subset(dataset, indices)
    sampler = DistributedSampler(sub, shuffle=False)
    loader = DataLoader(sub, batch_size=args.score_bs, sampler=sampler, collate_fn=collate, num_workers=4)
    net.eval()
    probs, labels = [], []
    for batch in loader:
        labels.append(batch.pop("labels").to(device))
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(**batch).logits
        probs.append(F.softmax(logits.float(), -1))
    probs, labels = torch.cat(probs), torch.cat(labels)
    pos = torch.tensor(list(sampler), device=device)
    world = dist.get_world_size()
    out = []
    for t in (probs, pos, labels):
        buf = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(buf, t)
        out.append(torch.cat(buf))
    return out if with_labels else out[:2]


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    set_seed(args.seed)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        load_dataset("dbpedia_14")
        AutoTokenizer.from_pretrained(args.model)
        AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=14)
    dist.barrier()
    ds = load_dataset("dbpedia_14")
    train, test = ds["train"], ds["test"]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    collate = make_collate(tokenizer, args.max_length)

    # evaluate on a fixed 10k slice of the test set to keep rounds short
    test_idx = np.random.RandomState(0).choice(len(test), 10000, replace=False).tolist()
    labelled = np.random.RandomState(args.seed).choice(len(train), args.init_size, replace=False).tolist()
    history = []

    for rnd in range(args.rounds + 1):
        t0 = time.time()
        net = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=14).to(device)
        model = DDP(net, device_ids=[args.local_rank])
        train_one_round(model, train, labelled, collate, args, device)

        probs, pos, labels = infer(net, test, test_idx, collate, args, device, with_labels=True)
        correct = torch.zeros(len(test_idx), device=device)
        correct[pos] = (probs.argmax(-1) == labels).float()  # padded duplicates collapse onto one slot
        acc = correct.mean().item()
        if rank == 0:
            history.append({"round": rnd, "labelled": len(labelled), "acc": acc, "sec": time.time() - t0})
            print(history[-1], flush=True)
            with open(os.path.join(args.output_dir, "history.json"), "w") as f:
                json.dump(history, f, indent=2)
            net.save_pretrained(os.path.join(args.output_dir, "latest"))
            tokenizer.save_pretrained(os.path.join(args.output_dir, "latest"))
        if rnd == args.rounds:
            break

        lab = set(labelled)
        pool = [i for i in range(len(train)) if i not in lab]
        probs, pos = infer(net, train, pool, collate, args, device)
        ent = -(probs * probs.clamp_min(1e-12).log()).sum(-1)
        scores = torch.full((len(pool),), -1.0, device=device)
        scores[pos] = ent
        top = torch.topk(scores, args.budget).indices.tolist()
        labelled = labelled + [pool[j] for j in top]
        del model, net
        torch.cuda.empty_cache()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
