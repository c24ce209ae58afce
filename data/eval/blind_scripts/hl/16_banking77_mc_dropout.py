"""Active learning for intent detection (BANKING77) with MC-dropout entropy.

The transformer's dropout stays on at query time; the mean softmax over
`--mc_passes` stochastic passes gives the predictive entropy of each pool utterance.

    torchrun --standalone --nproc_per_node=4 16_banking77_mc_dropout.py --rounds 10
"""
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

logging.basicConfig(format="%(asctime)s | %(levelname)s | %(message)s", level=logging.INFO)
logger = logging.getLogger(__name__)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_name", default="bert-base-uncased")
    ap.add_argument("--out_dir", default="./runs/banking77_mcd")
    ap.add_argument("--init_size", type=int, default=770)
    ap.add_argument("--budget", type=int, default=385)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--per_device_batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=4e-5)
    ap.add_argument("--mc_passes", type=int, default=10)
    ap.add_argument("--max_len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1234)
    return ap.parse_args()


class TextCollate:
    def __init__(self, tokenizer, max_len):
        self.tokenizer, self.max_len = tokenizer, max_len

    def __call__(self, rows):
        enc = self.tokenizer([r["text"] for r in rows], padding=True, truncation=True,
                             max_length=self.max_len, return_tensors="pt")
        enc["labels"] = torch.tensor([r["label"] for r in rows])
        return enc


def train(model, ds, labelled, collate, args, device):
    sub = Subset(ds, labelled)
    sampler = DistributedSampler(sub, shuffle=True, seed=args.seed)
    loader = DataLoader(sub, batch_size=args.per_device_batch, sampler=sampler, collate_fn=collate, num_workers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(loader)
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=int(0.1 * total), num_training_steps=total)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()


@torch.no_grad()
def test_accuracy(net, ds, collate, device):
    sampler = DistributedSampler(ds, shuffle=False)
    loader = DataLoader(ds, batch_size=128, sampler=sampler, collate_fn=collate, num_workers=2)
    net.eval()
    correct = torch.zeros(len(ds), device=device)
    positions = list(sampler)  # same order the loader visits (shuffle=False)
    k = 0
    for batch in loader:
        batch = {key: v.to(device) for key, v in batch.items()}
        labels = batch.pop("labels")
        pred = net(**batch).logits.argmax(-1)
        idx = torch.tensor(positions[k:k + labels.size(0)], device=device)
        correct[idx] = (pred == labels).float()
        k += labels.size(0)
    dist.all_reduce(correct, op=dist.ReduceOp.MAX)
    return correct.mean().item()


@torch.no_grad()
def mc_entropy(net, ds, pool, collate, args, device, world):
    sub = Subset(ds, pool)
    sampler = DistributedSampler(sub, shuffle=False)
    loader = DataLoader(sub, batch_size=256, sampler=sampler, collate_fn=collate, num_workers=2)
    net.train()  # keep dropout active for MC sampling
    scores = []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items() if k != "labels"}
        probs = torch.stack([F.softmax(net(**batch).logits, -1) for _ in range(args.mc_passes)]).mean(0)
        scores.append((-(probs * probs.clamp_min(1e-12).log()).sum(-1)).cpu())
    scores = torch.cat(scores)
    positions = torch.tensor(list(sampler))
    all_scores = [torch.zeros_like(scores) for _ in range(world)]
    all_pos = [torch.zeros_like(positions) for _ in range(world)]
    dist.all_gather(all_scores, scores)
    dist.all_gather(all_pos, positions)
    full = torch.full((len(pool),), -1.0)
    full[torch.cat(all_pos)] = torch.cat(all_scores)
    return full


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank != 0:
        logger.setLevel(logging.WARNING)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        load_dataset("banking77")
        AutoTokenizer.from_pretrained(args.model_name)
        AutoModelForSequenceClassification.from_pretrained(args.model_name, num_labels=77)
    dist.barrier()
    data = load_dataset("banking77")
    train_ds, test_ds = data["train"], data["test"]
    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    collate = TextCollate(tokenizer, args.max_len)

    rs = np.random.RandomState(args.seed)
    labelled = rs.choice(len(train_ds), args.init_size, replace=False).tolist()
    curve = []
    for rnd in range(args.rounds + 1):
        t0 = time.time()
        torch.manual_seed(args.seed + rnd)
        net = AutoModelForSequenceClassification.from_pretrained(args.model_name, num_labels=77).to(device)
        model = DDP(net, device_ids=[local_rank])
        train(model, train_ds, labelled, collate, args, device)
        acc = test_accuracy(net, test_ds, collate, device)
        if rank == 0:
            logger.info("round %d: %d labelled, test acc %.4f (%.0fs)", rnd, len(labelled), acc, time.time() - t0)
            curve.append({"round": rnd, "n": len(labelled), "acc": acc})
            with open(os.path.join(args.out_dir, "curve.json"), "w") as f:
                json.dump(curve, f)
            net.save_pretrained(os.path.join(args.out_dir, "last_model"))
        if rnd == args.rounds:
            break

        lab = set(labelled)
        pool = [i for i in range(len(train_ds)) if i not in lab]
        scores = mc_entropy(net, train_ds, pool, collate, args, device, world)
        top = torch.topk(scores, args.budget).indices.tolist()
        labelled = labelled + [pool[j] for j in top]

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
