"""Predict post-earnings-call log volatility (3/7/15/30-day horizons) from the
call transcript: prepared remarks + Q&A, truncated to 4096 tokens, Longformer
regression head with one output per horizon.

    torchrun --nproc_per_node=4 20_earnings_call_volatility.py --data_dir data/ec_vol --run_dir runs/ec_vol_lf
"""
import argparse
import json
import logging
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from scipy.stats import spearmanr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, LongformerForSequenceClassification, get_cosine_schedule_with_warmup

logger = logging.getLogger("ec_vol")
HORIZONS = ("vol_3", "vol_7", "vol_15", "vol_30")


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--run_dir", required=True)
    ap.add_argument("--model", default="allenai/longformer-base-4096")
    ap.add_argument("--max_len", type=int, default=4096)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--seed", type=int, default=77)
    return ap.parse_args()


class CallDataset(Dataset):
    """Targets are standardised with train-split statistics (passed in)."""

    def __init__(self, path, tok, max_len, mean, std):
        with open(path) as f:
            self.calls = [json.loads(l) for l in f]
        self.tok, self.max_len = tok, max_len
        self.mean, self.std = np.asarray(mean), np.asarray(std)

    def __len__(self):
        return len(self.calls)

    def __getitem__(self, i):
        c = self.calls[i]
        text = c["prepared_remarks"] + f" {self.tok.sep_token} " + c["qa"]
        enc = self.tok(text, truncation=True, max_length=self.max_len, padding="max_length")
        y = (np.array([c[h] for h in HORIZONS]) - self.mean) / self.std
        glob = [0] * self.max_len
        glob[0] = 1
        return {"input_ids": torch.tensor(enc["input_ids"]),
                "attention_mask": torch.tensor(enc["attention_mask"]),
                "global_attention_mask": torch.tensor(glob),
                "labels": torch.tensor(y, dtype=torch.float),
                "idx": i}


def train_stats(path):
    with open(path) as f:
        ys = np.array([[json.loads(l)[h] for h in HORIZONS] for l in f])
    return ys.mean(0).tolist(), ys.std(0).tolist()


@torch.no_grad()
def evaluate(model, loader, device, world):
    model.eval()
    rows = []
    for b in loader:
        idx = b.pop("idx")
        b = {k: v.to(device) for k, v in b.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                         global_attention_mask=b["global_attention_mask"]).logits.float()
        rows.extend(zip(idx.tolist(), pred.cpu().numpy(), b["labels"].cpu().numpy()))
    parts = [None] * world
    dist.all_gather_object(parts, rows)
    dedup = {i: (p, y) for part in parts for i, p, y in part}
    P = np.stack([v[0] for v in dedup.values()])
    Y = np.stack([v[1] for v in dedup.values()])
    out = {"mse": float(((P - Y) ** 2).mean())}
    for j, h in enumerate(HORIZONS):
        out[f"mse_{h}"] = float(((P[:, j] - Y[:, j]) ** 2).mean())
        out[f"rho_{h}"] = float(spearmanr(P[:, j], Y[:, j]).correlation)
    model.train()
    return out


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)

    mean, std = train_stats(os.path.join(args.data_dir, "train.jsonl"))
    tok = AutoTokenizer.from_pretrained(args.model)
    train_ds = CallDataset(os.path.join(args.data_dir, "train.jsonl"), tok, args.max_len, mean, std)
    val_ds = CallDataset(os.path.join(args.data_dir, "val.jsonl"), tok, args.max_len, mean, std)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=4,
                          pin_memory=True)
    val_dl = DataLoader(val_ds, batch_size=4, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=4)

    model = LongformerForSequenceClassification.from_pretrained(
        args.model, num_labels=len(HORIZONS), problem_type="regression")
    model = DDP(model.to(device), device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_dl) * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup, total)

    os.makedirs(args.run_dir, exist_ok=True)
    best_mse = math.inf
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, b in enumerate(train_dl):
            b.pop("idx")
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(**b)
            loss = out.loss.float()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 50 == 0:
                logger.info("epoch %d step %d/%d mse %.4f (%.0fs)", epoch, step, len(train_dl),
                            loss.item(), time.time() - t0)

        metrics = evaluate(model.module, val_dl, device, world)
        logger.info("epoch %d val %s", epoch, json.dumps(metrics))

        state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "epoch": epoch, "metrics": metrics,
                 "target_mean": mean, "target_std": std}
        torch.save(state, os.path.join(args.run_dir, "last.pt"))
        if metrics["mse"] < best_mse:
            best_mse = metrics["mse"]
            torch.save(state, os.path.join(args.run_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
