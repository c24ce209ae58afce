"""Thermostability (Meltome Tm) regression with an ESM-2 encoder, FLIP "human_cell" split.

Model selection on the validation Spearman; the best checkpoint is reloaded at
the end and scored on the test set.

    torchrun --nproc_per_node=8 10_stability_regression.py --data_dir data/flip/meltome
"""
import argparse
import os
import random

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from scipy.stats import pearsonr, spearmanr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, EsmModel


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--model_name", default="facebook/esm2_t33_650M_UR50D")
    p.add_argument("--max_length", type=int, default=1024)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--head_lr", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--freeze_layers", type=int, default=20)
    p.add_argument("--output_dir", default="runs/meltome")
    p.add_argument("--seed", type=int, default=7)
    return p.parse_args()


class TmDataset(Dataset):
    def __init__(self, csv_path, mean=None, std=None):
        df = pd.read_csv(csv_path)
        self.seqs = df["sequence"].tolist()
        y = df["target"].to_numpy(dtype=np.float32)
        self.mean = float(y.mean()) if mean is None else mean
        self.std = float(y.std()) if std is None else std
        self.y = (y - self.mean) / self.std

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        return i, self.seqs[i], self.y[i]


class TokenCollate:
    def __init__(self, tokenizer, max_length):
        self.tok, self.max_length = tokenizer, max_length

    def __call__(self, batch):
        idx, seqs, y = zip(*batch)
        enc = self.tok(list(seqs), padding=True, truncation=True, max_length=self.max_length,
                       return_tensors="pt")
        return torch.tensor(idx), enc["input_ids"], enc["attention_mask"], torch.tensor(y)


class TmRegressor(nn.Module):
    def __init__(self, model_name, freeze_layers):
        super().__init__()
        self.encoder = EsmModel.from_pretrained(model_name, add_pooling_layer=False)
        self.encoder.contact_head.requires_grad_(False)
        self.encoder.embeddings.requires_grad_(False)
        for layer in self.encoder.encoder.layer[:freeze_layers]:
            layer.requires_grad_(False)
        d = self.encoder.config.hidden_size
        self.attn_pool = nn.Linear(d, 1)
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Dropout(0.1), nn.Linear(d, 256), nn.GELU(), nn.Linear(256, 1))

    def forward(self, input_ids, attention_mask):
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        scores = self.attn_pool(h).squeeze(-1).masked_fill(attention_mask == 0, float("-inf"))
        pooled = (scores.softmax(-1).unsqueeze(-1) * h).sum(1)
        return self.head(pooled).squeeze(-1)


@torch.no_grad()
def predict(model, loader, device, world):
    model.eval()
    local_idx, local_pred = [], []
    for idx, ids, mask, _ in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(ids.to(device), mask.to(device)).float()
        local_idx.append(idx)
        local_pred.append(pred.cpu())
    local = (torch.cat(local_idx).tolist(), torch.cat(local_pred).tolist()) if local_idx else ([], [])
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    preds = {}
    for idxs, ps in gathered:
        preds.update(zip(idxs, ps))
    return preds


def score(preds, dataset):
    order = sorted(preds)
    p = np.array([preds[i] for i in order])
    y = dataset.y[order]
    return spearmanr(p, y).correlation, pearsonr(p, y)[0]


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    train_set = TmDataset(os.path.join(args.data_dir, "train.csv"))
    val_set = TmDataset(os.path.join(args.data_dir, "valid.csv"), train_set.mean, train_set.std)
    test_set = TmDataset(os.path.join(args.data_dir, "test.csv"), train_set.mean, train_set.std)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    collate = TokenCollate(tokenizer, args.max_length)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=4, drop_last=True)
    # evaluation shards without padding; predictions are gathered by index
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)),
                            batch_size=32, collate_fn=collate)
    test_loader = DataLoader(torch.utils.data.Subset(test_set, range(rank, len(test_set), world)),
                             batch_size=32, collate_fn=collate)

    model = TmRegressor(args.model_name, args.freeze_layers).to(device)
    ddp_model = DDP(model, device_ids=[local_rank])
    head_params = list(model.attn_pool.parameters()) + list(model.head.parameters())
    enc_params = [p for p in model.encoder.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": enc_params, "lr": args.lr},
                                   {"params": head_params, "lr": args.head_lr}], weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=[args.lr, args.head_lr], total_steps=args.epochs * len(train_loader), pct_start=0.1)
    loss_fn = nn.SmoothL1Loss(beta=0.5)

    best_path = os.path.join(args.output_dir, "best.pt")
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    best_rho = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        ddp_model.train()
        for step, (_, ids, mask, y) in enumerate(train_loader):
            ids, mask, y = ids.to(device), mask.to(device), y.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = ddp_model(ids, mask)
            loss = loss_fn(pred.float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and step % 50 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)

        preds = predict(model, val_loader, device, world)
        if rank == 0:
            rho, r = score(preds, val_set)
            print(f"epoch {epoch}: val spearman {rho:.4f} pearson {r:.4f}", flush=True)
            if rho > best_rho:
                best_rho = rho
                torch.save({"model": ddp_model.state_dict(), "epoch": epoch, "spearman": rho,
                            "tm_mean": train_set.mean, "tm_std": train_set.std}, best_path)
        dist.barrier()

    # reload the selected epoch on every rank and score the test split
    ckpt = torch.load(best_path, map_location="cpu")
    model.load_state_dict(ckpt["model"])
    preds = predict(model, test_loader, device, world)
    if rank == 0:
        rho, r = score(preds, test_set)
        print(f"test (epoch {ckpt['epoch']}): spearman {rho:.4f} pearson {r:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
