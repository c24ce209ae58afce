"""Yahoo! Answers topic classification (10 classes): entropy-based active learning.

DistilBERT is fine-tuned each round on the labelled subset; the pool is a fixed
random 100k subset of the training split.

    torchrun --standalone --nproc_per_node=8 18_al_yahoo_distilbert_entropy.py --out /shared/al/yahoo_entropy
"""
import argparse
import json
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger("al-yahoo")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="distilbert-base-uncased")
    ap.add_argument("--out", required=True)
    ap.add_argument("--pool", type=int, default=100_000)
    ap.add_argument("--init", type=int, default=1000)
    ap.add_argument("--query", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--global_bs", type=int, default=128)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--max_len", type=int, default=192)
    ap.add_argument("--seed", type=int, default=8)
    return ap.parse_args()


class Encoded(Dataset):
    def __init__(self, input_ids, attention_mask, labels, rows):
        self.input_ids, self.attention_mask, self.labels = input_ids, attention_mask, labels
        self.rows = np.asarray(rows)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = int(self.rows[i])
        return self.input_ids[r], self.attention_mask[r], self.labels[r], r


def make_loader(enc, rows, bs, shuffle, seed=0, workers=2):
    ds = Encoded(enc["input_ids"], enc["attention_mask"], enc["labels"], rows)
    sampler = DistributedSampler(ds, shuffle=shuffle, seed=seed)
    return DataLoader(ds, batch_size=bs, sampler=sampler, num_workers=workers, pin_memory=True), sampler


@torch.no_grad()
def score(model, loader, device):
    """Entropy and argmax for every row the loader yields on this rank, gathered over ranks."""
    model.eval()
    ents, preds, rows = [], [], []
    for ids, mask, _, r in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        p = logits.float().softmax(-1)
        ents.append((-(p * p.clamp_min(1e-12).log()).sum(-1)).cpu())
        preds.append(p.argmax(-1).cpu())
        rows.append(r)
    local = torch.stack([torch.cat(ents), torch.cat(preds).float(), torch.cat(rows).float()], dim=1)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    allv = torch.cat(gathered).numpy()
    _, first = np.unique(allv[:, 2], return_index=True)
    allv = allv[first]
    return allv[:, 0], allv[:, 1].astype(np.int64), allv[:, 2].astype(np.int64)


def encode(tok, split, max_len):
    texts = [f"{t} {c} {a}" for t, c, a in zip(split["question_title"], split["question_content"], split["best_answer"])]
    enc = tok(texts, truncation=True, max_length=max_len, padding="max_length", return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
            "labels": torch.tensor(split["topic"])}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")

    if rank == 0:
        load_dataset("yahoo_answers_topics")  # populate the HF cache once
    dist.barrier()
    raw = load_dataset("yahoo_answers_topics")
    rng = np.random.default_rng(args.seed)
    pool_rows = np.sort(rng.choice(len(raw["train"]), args.pool, replace=False))
    test_rows = np.sort(rng.choice(len(raw["test"]), 10_000, replace=False))
    tok = AutoTokenizer.from_pretrained(args.model)
    pool_enc = encode(tok, raw["train"].select(pool_rows), args.max_len)
    test_enc = encode(tok, raw["test"].select(test_rows), args.max_len)

    n = len(pool_rows)
    labelled = np.sort(rng.choice(n, args.init, replace=False))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    curve = []

    for rnd in range(args.rounds):
        t0 = time.time()
        torch.manual_seed(args.seed + rnd)
        model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=10).to(device)
        model = DDP(model, device_ids=[local_rank])
        loader, sampler = make_loader(pool_enc, labelled, args.global_bs // world, shuffle=True, seed=args.seed + rnd)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        total = args.epochs * len(loader)
        sched = get_linear_schedule_with_warmup(opt, int(0.1 * total), total)

        for ep in range(args.epochs):
            sampler.set_epoch(ep)
            model.train()
            for ids, mask, y, _ in loader:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 labels=y.to(device)).loss
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()

        test_loader, _ = make_loader(test_enc, np.arange(len(test_rows)), 256, shuffle=False)
        _, t_pred, t_rows = score(model.module, test_loader, device)
        acc = float((t_pred == test_enc["labels"].numpy()[t_rows]).mean())

        unl = np.setdiff1d(np.arange(n), labelled)
        pool_loader, _ = make_loader(pool_enc, unl, 256, shuffle=False)
        ent, _, rows = score(model.module, pool_loader, device)
        new = rows[np.argsort(-ent, kind="stable")[: args.query]]
        labelled = np.union1d(labelled, new)

        curve.append({"round": rnd, "n_labelled": int(len(labelled) - len(new)), "test_acc": acc,
                      "minutes": round((time.time() - t0) / 60, 2)})
        if rank == 0:
            logger.info("%s", curve[-1])
            with open(os.path.join(args.out, "curve.json"), "w") as f:
                json.dump(curve, f, indent=2)
            torch.save({"labelled_pool_rows": torch.from_numpy(labelled), "pool_rows": torch.from_numpy(pool_rows),
                        "model": model.module.state_dict()}, os.path.join(args.out, f"round{rnd:02d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
