"""BADGE active learning for intent classification (BANKING77, BERT-base).

BADGE = k-means++ seeding on last-layer gradient embeddings
        g(x) = (p(x) - onehot(argmax p(x))) (x) h(x)
which trades off uncertainty (gradient norm) and diversity.

torchrun --nproc_per_node=4 badge_banking77.py --rounds 10 --query 200
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, DataCollatorWithPadding, get_linear_schedule_with_warmup

DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
NUM_LABELS = 77


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bert-base-uncased")
    ap.add_argument("--out", default="runs/badge_banking77")
    ap.add_argument("--init", type=int, default=200)
    ap.add_argument("--query", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--seed", type=int, default=3)
    return ap.parse_args()


class IntentClassifier(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(name)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(self.encoder.config.hidden_size, NUM_LABELS)

    def embed(self, input_ids, attention_mask):
        return self.encoder(input_ids=input_ids, attention_mask=attention_mask).pooler_output

    def forward(self, input_ids, attention_mask):
        h = self.embed(input_ids, attention_mask)
        return self.head(self.drop(h)), h


@torch.no_grad()
def grad_embeddings(net, dataset, sampler, collate):
    """Gradient embeddings of this rank's shard of `dataset` (fp16, on CPU)."""
    net.eval()
    loader = DataLoader(dataset, batch_size=128, sampler=sampler, collate_fn=collate)
    positions = torch.tensor(list(sampler))
    out = []
    for batch in loader:
        ids = batch["input_ids"].to(DEVICE)
        mask = batch["attention_mask"].to(DEVICE)
        logits, h = net(ids, mask)
        p = F.softmax(logits, 1)
        onehot = F.one_hot(p.argmax(1), NUM_LABELS).float()
        g = (p - onehot).unsqueeze(2) * h.unsqueeze(1)
        out.append(g.flatten(1).half().cpu())
    return positions, torch.cat(out)


def kmeanspp(emb, k, seed):
    rng = np.random.default_rng(seed)
    emb = emb.numpy()
    first = int(np.argmax((emb ** 2).sum(1)))
    centers = [first]
    d2 = ((emb - emb[first]) ** 2).sum(1)
    while len(centers) < k:
        probs = d2 / d2.sum()
        c = int(rng.choice(len(emb), p=probs))
        if c in centers:
            continue
        centers.append(c)
        d2 = np.minimum(d2, ((emb - emb[c]) ** 2).sum(1))
    return centers


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    s = torch.zeros(2, device=device)
    for batch in loader:
        logits, _ = net(batch["input_ids"].to(device), batch["attention_mask"].to(device))
        s[0] += (logits.argmax(1) == batch["labels"].to(device)).sum()
        s[1] += batch["labels"].numel()
    dist.all_reduce(s)
    return (s[0] / s[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    tok = AutoTokenizer.from_pretrained(args.model)
    if rank == 0:
        raw = load_dataset("banking77")
        raw = raw.map(lambda b: tok(b["text"], truncation=True, max_length=64), batched=True)
        AutoModel.from_pretrained(args.model)
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()
    raw = load_dataset("banking77")
    raw = raw.map(lambda b: tok(b["text"], truncation=True, max_length=64), batched=True)
    raw = raw.rename_column("label", "labels").remove_columns(["text"])
    raw.set_format("torch")
    train_ds, test_ds = raw["train"], raw["test"]
    collate = DataCollatorWithPadding(tok)
    test_loader = DataLoader(test_ds, batch_size=128, collate_fn=collate,
                             sampler=DistributedSampler(test_ds, shuffle=False))

    rng = np.random.default_rng(args.seed)
    labeled = rng.choice(len(train_ds), args.init, replace=False).tolist()
    results = []

    for rnd in range(args.rounds + 1):
        t0 = time.time()
        torch.manual_seed(args.seed)
        net = IntentClassifier(args.model).to(device)
        model = DDP(net, device_ids=[local_rank])
        lab_ds = Subset(train_ds, labeled)
        sampler = DistributedSampler(lab_ds, shuffle=True, seed=args.seed + rnd)
        loader = DataLoader(lab_ds, batch_size=args.bs, sampler=sampler, collate_fn=collate)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        total = args.epochs * len(loader)
        sched = get_linear_schedule_with_warmup(opt, int(0.1 * total), total)
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            for batch in loader:
                logits, _ = model(batch["input_ids"].to(device), batch["attention_mask"].to(device))
                loss = F.cross_entropy(logits, batch["labels"].to(device))
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
        acc = evaluate(net, test_loader, device)
        if rank == 0:
            results.append({"round": rnd, "labeled": len(labeled), "acc": acc,
                            "sec": round(time.time() - t0)})
            print(results[-1], flush=True)
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump(results, f)
            torch.save(net.state_dict(), os.path.join(args.out, f"round{rnd}.pt"))
        if rnd == args.rounds:
            break

        # query: every rank embeds its shard of the pool, rank 0 runs k-means++
        pool = sorted(set(range(len(train_ds))) - set(labeled))
        pool_ds = Subset(train_ds, pool)
        pool_sampler = DistributedSampler(pool_ds, shuffle=False)
        pos, emb = grad_embeddings(net, pool_ds, pool_sampler, collate)
        parts = [None] * world if rank == 0 else None
        dist.gather_object((pos, emb), parts, dst=0)
        chosen = [None]
        if rank == 0:
            pos = torch.cat([p for p, _ in parts]).numpy()
            emb = torch.cat([e for _, e in parts])
            # drop the padding DistributedSampler adds; rows end up in pool order
            _, first = np.unique(pos, return_index=True)
            emb = emb[torch.from_numpy(first)].float()
            chosen[0] = [pool[i] for i in kmeanspp(emb, args.query, args.seed + rnd)]
        dist.broadcast_object_list(chosen, src=0)
        labeled = labeled + chosen[0]
        del model, net, opt
        torch.cuda.empty_cache()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
