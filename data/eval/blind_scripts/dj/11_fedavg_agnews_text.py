"""Federated text classification on AG News (FedAvg, Dirichlet label skew).

Model: fastText-style EmbeddingBag classifier over BERT wordpiece ids. Each
rank is one client; the global model is evaluated on the AG News test split
after every round and everything is tracked in Weights & Biases.

    torchrun --nproc_per_node=4 11_fedavg_agnews_text.py --alpha 0.1 --run_name agnews-a0.1
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from datasets import load_dataset
from torch.utils.data import DataLoader, Subset
from transformers import AutoTokenizer


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default="bert-base-uncased")
    ap.add_argument("--max_len", type=int, default=128)
    ap.add_argument("--emb_dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--local_epochs", type=int, default=1)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--alpha", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=123)
    ap.add_argument("--project", default="federated-text")
    ap.add_argument("--run_name", default="agnews-fedavg")
    ap.add_argument("--save_dir", default="./checkpoints/agnews")
    return ap.parse_args()


class BagClassifier(nn.Module):
    def __init__(self, vocab_size, dim, n_classes=4):
        super().__init__()
        self.emb = nn.EmbeddingBag(vocab_size, dim, mode="mean")
        self.fc = nn.Linear(dim, n_classes)
        nn.init.uniform_(self.emb.weight, -0.5, 0.5)
        nn.init.uniform_(self.fc.weight, -0.5, 0.5)
        nn.init.zeros_(self.fc.bias)

    def forward(self, flat_ids, offsets):
        return self.fc(self.emb(flat_ids, offsets))


class Collate:
    def __init__(self, tokenizer, max_len):
        self.tok = tokenizer
        self.max_len = max_len

    def __call__(self, batch):
        enc = self.tok([b["text"] for b in batch], truncation=True, max_length=self.max_len,
                       add_special_tokens=False)["input_ids"]
        lengths = torch.tensor([max(len(e), 1) for e in enc])
        flat = torch.tensor([i for e in enc for i in (e or [0])], dtype=torch.long)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
        labels = torch.tensor([b["label"] for b in batch])
        return flat, offsets, labels


def label_dirichlet(labels, n_clients, alpha, seed):
    rng = np.random.default_rng(seed)
    labels = np.asarray(labels)
    parts = [[] for _ in range(n_clients)]
    for c in np.unique(labels):
        ids = rng.permutation(np.flatnonzero(labels == c))
        p = rng.dirichlet(alpha * np.ones(n_clients))
        for k, chunk in enumerate(np.split(ids, (np.cumsum(p)[:-1] * len(ids)).astype(int))):
            parts[k].extend(chunk.tolist())
    return parts


def train_local(model, loader, args, device):
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    total, n = 0.0, 0
    for _ in range(args.local_epochs):
        for flat, offsets, y in loader:
            flat, offsets, y = flat.to(device), offsets.to(device), y.to(device)
            loss = F.cross_entropy(model(flat, offsets), y)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            opt.step()
            total += loss.item() * y.numel()
            n += y.numel()
    return total, n


@torch.no_grad()
def fedavg(model, n_local, device):
    n = torch.tensor(float(n_local), device=device)
    n_sum = n.clone()
    dist.all_reduce(n_sum)
    for p in model.parameters():
        p.mul_(n / n_sum)
        dist.all_reduce(p)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    out = torch.zeros(3, device=device)
    for flat, offsets, y in loader:
        flat, offsets, y = flat.to(device), offsets.to(device), y.to(device)
        logits = model(flat, offsets)
        out[0] += F.cross_entropy(logits, y, reduction="sum")
        out[1] += (logits.argmax(1) == y).sum()
        out[2] += y.numel()
    dist.all_reduce(out)
    return (out[0] / out[2]).item(), (out[1] / out[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    wandb.init(project=args.project, name=args.run_name, config=vars(args))

    # download / prepare once, then everybody reads from the HF cache
    if rank == 0:
        AutoTokenizer.from_pretrained(args.tokenizer)
        load_dataset("ag_news")
    dist.barrier()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    ds = load_dataset("ag_news")
    train, test = ds["train"], ds["test"]
    parts = label_dirichlet(train["label"], world, args.alpha, args.seed)
    n_local = len(parts[rank])
    collate = Collate(tokenizer, args.max_len)
    train_loader = DataLoader(Subset(train, parts[rank]), batch_size=args.batch_size,
                              shuffle=True, collate_fn=collate, num_workers=2)
    test_loader = DataLoader(Subset(test, list(range(rank, len(test), world))), batch_size=512,
                             collate_fn=collate, num_workers=2)

    model = BagClassifier(tokenizer.vocab_size, args.emb_dim).to(device)
    for p in model.parameters():
        dist.broadcast(p.data, 0)

    best = 0.0
    for rnd in range(1, args.rounds + 1):
        t0 = time.time()
        loss_sum, seen = train_local(model, train_loader, args, device)
        fedavg(model, n_local, device)
        tl = torch.tensor([loss_sum, seen], device=device)
        dist.all_reduce(tl)
        test_loss, test_acc = evaluate(model, test_loader, device)

        wandb.log({"round": rnd, "train/loss": (tl[0] / tl[1]).item(),
                   "test/loss": test_loss, "test/acc": test_acc,
                   "time/round_s": time.time() - t0})
        if rank == 0:
            print(f"round {rnd}: test acc {test_acc:.4f}", flush=True)
            if test_acc > best:
                best = test_acc
                os.makedirs(args.save_dir, exist_ok=True)
                torch.save(model.state_dict(), os.path.join(args.save_dir, "best.pt"))

    wandb.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
