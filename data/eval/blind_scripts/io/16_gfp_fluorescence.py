"""TAPE fluorescence (avGFP mutants) regression with EsmForSequenceClassification.

Train on low-order mutants (<= 3 mutations), test on the higher-order ones, as in TAPE.
All sequences are 237 residues, so batches need no length bucketing.

    torchrun --nproc_per_node=4 16_gfp_fluorescence.py --train data/fluorescence/train.csv \
        --valid data/fluorescence/valid.csv --test data/fluorescence/test.csv
"""
import argparse
import math
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
from scipy.stats import spearmanr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, EsmForSequenceClassification, get_cosine_schedule_with_warmup


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--test", required=True)
    ap.add_argument("--model_name", default="facebook/esm2_t33_650M_UR50D")
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--patience", type=int, default=4)
    ap.add_argument("--output_dir", default="runs/gfp")
    return ap.parse_args()


def tokenize_csv(path, tokenizer):
    df = pd.read_csv(path)
    enc = tokenizer(df["sequence"].tolist(), padding="max_length", max_length=239, truncation=True,
                    return_tensors="pt")
    y = torch.tensor(df["log_fluorescence"].to_numpy(), dtype=torch.float32)
    idx = torch.arange(len(df))
    return TensorDataset(idx, enc["input_ids"], enc["attention_mask"], y)


@torch.no_grad()
def evaluate(model, dataset, device, rank, world, batch_size=128):
    model.eval()
    shard = torch.utils.data.Subset(dataset, range(rank, len(dataset), world))
    loader = DataLoader(shard, batch_size=batch_size)
    sse, sae, n = 0.0, 0.0, 0
    idxs, preds = [], []
    for idx, ids, mask, y in loader:
        ids, mask, y = ids.to(device), mask.to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(input_ids=ids, attention_mask=mask).logits.squeeze(-1).float()
        sse += ((pred - y) ** 2).sum().item()
        sae += (pred - y).abs().sum().item()
        n += y.numel()
        idxs += idx.tolist()
        preds += pred.cpu().tolist()
    stats = torch.tensor([sse, sae, n], dtype=torch.float64)
    dist.all_reduce(stats)
    gathered = [None] * world
    dist.all_gather_object(gathered, (idxs, preds))
    model.train()
    order = {}
    for ii, pp in gathered:
        order.update(zip(ii, pp))
    keys = sorted(order)
    y_all = dataset.tensors[3][keys].numpy()
    rho = spearmanr(np.array([order[k] for k in keys]), y_all).correlation
    return {"mse": (stats[0] / stats[2]).item(), "mae": (stats[1] / stats[2]).item(), "spearman": rho}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    train_ds = tokenize_csv(args.train, tokenizer)
    valid_ds = tokenize_csv(args.valid, tokenizer)
    test_ds = tokenize_csv(args.test, tokenizer)

    model = EsmForSequenceClassification.from_pretrained(args.model_name, num_labels=1,
                                                         problem_type="regression")
    model.esm.contact_head.requires_grad_(False)
    model = DDP(model.to(device), device_ids=[local_rank])

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=2,
                        pin_memory=True, drop_last=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                  weight_decay=0.01)
    total = args.epochs * len(loader)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.05 * total), total)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    best_rho, bad_epochs = -math.inf, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for step, (_, ids, mask, y) in enumerate(loader):
            ids, mask, y = ids.to(device), mask.to(device), y.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(input_ids=ids, attention_mask=mask, labels=y)
            optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step} mse {out.loss.item():.4f}", flush=True)

        metrics = evaluate(model.module, valid_ds, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} valid {metrics}", flush=True)
        # every rank sees the same gathered metrics, so the early-stopping decision agrees
        if metrics["spearman"] > best_rho:
            best_rho, bad_epochs = metrics["spearman"], 0
            if rank == 0:
                model.module.save_pretrained(os.path.join(args.output_dir, "best"))
        else:
            bad_epochs += 1
        dist.barrier()
        if bad_epochs >= args.patience:
            break

    best = EsmForSequenceClassification.from_pretrained(os.path.join(args.output_dir, "best")).to(device)
    metrics = evaluate(best, test_ds, device, rank, world)
    if rank == 0:
        print(f"test {metrics}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
