# Feedback Prize ELL - deberta-v3 regression, 4-fold, DDP
# torchrun --nproc_per_node=8 02_feedback_deberta_cached_features.py --config cfg_deberta_base.yaml
import argparse
import math
import os
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoConfig, AutoModel, AutoTokenizer, get_cosine_schedule_with_warmup

TARGETS = ["cohesion", "syntax", "vocabulary", "phraseology", "grammar", "conventions"]


@dataclass
class CFG:
    model_name: str = "microsoft/deberta-v3-base"
    train_csv: str = "data/train_folds.csv"
    cache_dir: str = "cache"
    out_dir: str = "outputs"
    max_len: int = 768
    fold: int = 0
    epochs: int = 4
    batch_size: int = 4
    lr: float = 2e-5
    head_lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1
    num_workers: int = 2
    seed: int = 42
    extra: dict = field(default_factory=dict)


def load_cfg(path):
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    known = {k: v for k, v in raw.items() if k in CFG.__dataclass_fields__}
    return CFG(**known)


def build_features(cfg, tokenizer, df):
    cache_file = os.path.join(cfg.cache_dir, f"{cfg.model_name.split('/')[-1]}_len{cfg.max_len}.pt")
    if os.path.exists(cache_file):
        return torch.load(cache_file, map_location="cpu")
    os.makedirs(cfg.cache_dir, exist_ok=True)
    enc = tokenizer(df.full_text.tolist(), max_length=cfg.max_len, truncation=True,
                    padding=False, add_special_tokens=True)
    feats = {
        "input_ids": enc["input_ids"],
        "attention_mask": enc["attention_mask"],
        "labels": df[TARGETS].values.astype(np.float32),
        "fold": df.fold.values,
    }
    torch.save(feats, cache_file)
    return feats


class EssayDataset(Dataset):
    def __init__(self, feats, indices):
        self.ids = [feats["input_ids"][i] for i in indices]
        self.mask = [feats["attention_mask"][i] for i in indices]
        self.labels = feats["labels"][indices]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def collate(batch, pad_id):
    max_len = max(len(b["input_ids"]) for b in batch)
    ids = torch.full((len(batch), max_len), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), max_len), dtype=torch.long)
    for i, b in enumerate(batch):
        n = len(b["input_ids"])
        ids[i, :n] = torch.tensor(b["input_ids"])
        mask[i, :n] = torch.tensor(b["attention_mask"])
    labels = torch.tensor(np.stack([b["labels"] for b in batch]))
    return ids, mask, labels


class Collator:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        return collate(batch, self.pad_id)


class MeanPool(nn.Module):
    def forward(self, h, mask):
        m = mask.unsqueeze(-1).float()
        return (h * m).sum(1) / m.sum(1).clamp(min=1e-6)


class FBModel(nn.Module):
    def __init__(self, name):
        super().__init__()
        config = AutoConfig.from_pretrained(name)
        config.hidden_dropout_prob = 0.0
        config.attention_probs_dropout_prob = 0.0
        self.backbone = AutoModel.from_pretrained(name, config=config)
        self.pool = MeanPool()
        self.head = nn.Linear(config.hidden_size, len(TARGETS))

    def forward(self, ids, mask):
        h = self.backbone(input_ids=ids, attention_mask=mask).last_hidden_state
        return self.head(self.pool(h, mask))


def mcrmse(y_true, y_pred):
    return np.mean(np.sqrt(np.mean((y_true - y_pred) ** 2, axis=0)))


@torch.no_grad()
def evaluate(model, loader, device):
    # runs on the unwrapped module over this rank's shard only; no collectives inside
    model.eval()
    sq_err = torch.zeros(len(TARGETS), device=device, dtype=torch.float64)
    n = torch.zeros(1, device=device, dtype=torch.float64)
    for ids, mask, labels in loader:
        ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            preds = model(ids, mask).float()
        sq_err += ((preds - labels) ** 2).sum(0).double()
        n += labels.size(0)
    return sq_err, n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="cfg_deberta_base.yaml")
    ap.add_argument("--fold", type=int, default=None)
    args = ap.parse_args()
    cfg = load_cfg(args.config)
    if args.fold is not None:
        cfg.fold = args.fold

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)

    tokenizer = AutoTokenizer.from_pretrained(cfg.model_name)
    df = pd.read_csv(cfg.train_csv)
    feats = build_features(cfg, tokenizer, df)

    trn_idx = np.where(feats["fold"] != cfg.fold)[0]
    val_idx = np.where(feats["fold"] == cfg.fold)[0]
    train_ds = EssayDataset(feats, trn_idx)
    valid_ds = EssayDataset(feats, val_idx)
    valid_shard = Subset(valid_ds, list(range(rank, len(valid_ds), world)))

    collator = Collator(tokenizer.pad_token_id)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=sampler,
                              collate_fn=collator, num_workers=cfg.num_workers, pin_memory=True)
    valid_loader = DataLoader(valid_shard, batch_size=cfg.batch_size * 4, shuffle=False,
                              collate_fn=collator, num_workers=cfg.num_workers)

    model = FBModel(cfg.model_name).to(device)
    params = [
        {"params": model.backbone.parameters(), "lr": cfg.lr},
        {"params": model.head.parameters(), "lr": cfg.head_lr},
    ]
    optimizer = torch.optim.AdamW(params, weight_decay=cfg.weight_decay)
    model = DDP(model, device_ids=[local_rank])

    total_steps = len(train_loader) * cfg.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(cfg.warmup_ratio * total_steps), total_steps)
    scaler = torch.cuda.amp.GradScaler()
    loss_fn = nn.SmoothL1Loss()

    best = math.inf
    os.makedirs(cfg.out_dir, exist_ok=True)
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, (ids, mask, labels) in enumerate(train_loader):
            ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(ids, mask).float(), labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1000.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step}/{len(train_loader)} loss {loss.item():.4f}", flush=True)

        sq_err, n = evaluate(model.module, valid_loader, device)
        dist.all_reduce(sq_err)
        dist.all_reduce(n)
        score = torch.sqrt(sq_err / n).mean().item()
        if rank == 0:
            print(f"fold {cfg.fold} epoch {epoch} MCRMSE {score:.5f}", flush=True)
            if score < best:
                best = score
                torch.save(model.module.state_dict(), os.path.join(cfg.out_dir, f"fold{cfg.fold}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
