"""
BERT4Rec on Amazon Video Games (2018, 5-core) with HF Accelerate.

    accelerate launch --multi_gpu --num_processes 4 --mixed_precision bf16 \
        11_bert4rec_games.py --data data/Video_Games.csv --output_dir out/b4r_games
"""
import argparse
import math
import os
import random

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset
from transformers import get_linear_schedule_with_warmup

logger = get_logger(__name__)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--output_dir", default="out/b4r_games")
    p.add_argument("--max_len", type=int, default=50)
    p.add_argument("--hidden_size", type=int, default=64)
    p.add_argument("--num_layers", type=int, default=2)
    p.add_argument("--num_heads", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--mask_ratio", type=float, default=0.2)
    p.add_argument("--global_batch_size", type=int, default=512, help="summed over all processes")
    p.add_argument("--eval_batch_size", type=int, default=512)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--num_epochs", type=int, default=100)
    p.add_argument("--warmup_ratio", type=float, default=0.05)
    p.add_argument("--eval_every", type=int, default=5)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def load_games(path):
    df = pd.read_csv(path, names=["item", "user", "rating", "timestamp"])
    for _ in range(10):
        df = df[df.groupby("user")["item"].transform("count") >= 5]
        df = df[df.groupby("item")["user"].transform("count") >= 5]
    df = df.assign(item_id=pd.factorize(df["item"], sort=True)[0] + 1)
    df = df.sort_values(["user", "timestamp"], kind="mergesort")
    seqs = df.groupby("user", sort=True)["item_id"].apply(list).tolist()
    return seqs, int(df["item_id"].max())


class MaskedTrainDataset(Dataset):
    def __init__(self, seqs, num_items, max_len, mask_ratio):
        self.seqs = [s[:-2] for s in seqs]
        self.num_items = num_items
        self.mask_token = num_items + 1
        self.max_len = max_len
        self.mask_ratio = mask_ratio

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, idx):
        seq = self.seqs[idx][-self.max_len:]
        tokens = list(seq)
        labels = [0] * len(seq)
        for i, item in enumerate(seq):
            if random.random() < self.mask_ratio:
                tokens[i] = self.mask_token
                labels[i] = item
        if not any(labels):
            tokens[-1], labels[-1] = self.mask_token, seq[-1]
        pad = self.max_len - len(seq)
        return {"tokens": torch.tensor([0] * pad + tokens), "labels": torch.tensor([0] * pad + labels)}


class RankingEvalDataset(Dataset):
    def __init__(self, seqs, num_items, max_len, split, num_neg=100, seed=0):
        self.items = []
        rng = np.random.default_rng(seed)
        mask_token = num_items + 1
        for s in seqs:
            hist, target = (s[:-2], s[-2]) if split == "valid" else (s[:-1], s[-1])
            inp = (hist + [mask_token])[-max_len:]
            seen = set(s)
            negs = []
            while len(negs) < num_neg:
                c = int(rng.integers(1, num_items + 1))
                if c not in seen:
                    negs.append(c)
            self.items.append((torch.tensor([0] * (max_len - len(inp)) + inp), torch.tensor([target] + negs)))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        tokens, cands = self.items[idx]
        return {"tokens": tokens, "candidates": cands}


class BERT4Rec(nn.Module):
    def __init__(self, num_items, max_len, hidden_size, num_layers, num_heads, dropout):
        super().__init__()
        self.item_embedding = nn.Embedding(num_items + 1, hidden_size, padding_idx=0)
        self.position_embedding = nn.Embedding(max_len, hidden_size)
        self.layer_norm = nn.LayerNorm(hidden_size, eps=1e-12)
        self.dropout = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(hidden_size, num_heads, 4 * hidden_size, dropout,
                                           activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers)
        self.output = nn.Linear(hidden_size, num_items + 1)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.trunc_normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, tokens):
        positions = torch.arange(tokens.size(1), device=tokens.device).unsqueeze(0)
        x = self.item_embedding(tokens) + self.position_embedding(positions)
        x = self.dropout(self.layer_norm(x))
        x = self.encoder(x, src_key_padding_mask=tokens.eq(0))
        return self.output(x)


def main():
    args = parse_args()
    accelerator = Accelerator(log_with="tensorboard", project_dir=args.output_dir)
    set_seed(args.seed)

    seqs, num_items = load_games(args.data)
    logger.info(f"{len(seqs)} users, {num_items} items", main_process_only=True)

    train_ds = MaskedTrainDataset(seqs, num_items, args.max_len, args.mask_ratio)
    valid_ds = RankingEvalDataset(seqs, num_items, args.max_len, "valid", seed=args.seed)
    test_ds = RankingEvalDataset(seqs, num_items, args.max_len, "test", seed=args.seed + 1)
    per_device_bs = args.global_batch_size // accelerator.num_processes
    train_dl = DataLoader(train_ds, batch_size=per_device_bs, shuffle=True, num_workers=4, drop_last=True)
    valid_dl = DataLoader(valid_ds, batch_size=args.eval_batch_size)
    test_dl = DataLoader(test_ds, batch_size=args.eval_batch_size)

    model = BERT4Rec(num_items, args.max_len, args.hidden_size, args.num_layers, args.num_heads, args.dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01)

    model, optimizer, train_dl, valid_dl, test_dl = accelerator.prepare(model, optimizer, train_dl, valid_dl, test_dl)
    total_steps = len(train_dl) * args.num_epochs
    # stepped once per optimizer step on every process, so it is left out of prepare()
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)
    accelerator.init_trackers("bert4rec_games", config=vars(args))

    def evaluate(dl):
        model.eval()
        all_ranks = []
        with torch.no_grad():
            for batch in dl:
                logits = model(batch["tokens"])[:, -1, :]
                scores = logits.gather(1, batch["candidates"])
                ranks = (scores[:, 1:] > scores[:, :1]).sum(1)
                all_ranks.append(accelerator.gather_for_metrics(ranks))
        model.train()
        r = torch.cat(all_ranks).float()
        return {"HR@10": (r < 10).float().mean().item(),
                "NDCG@10": ((r < 10).float() / torch.log2(r + 2)).mean().item(),
                "MRR": (1.0 / (r + 1)).mean().item()}

    best_ndcg, global_step = 0.0, 0
    for epoch in range(args.num_epochs):
        model.train()
        for batch in train_dl:
            logits = model(batch["tokens"])
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), batch["labels"].view(-1), ignore_index=0)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            global_step += 1
            if global_step % 100 == 0:
                avg = accelerator.reduce(loss.detach(), reduction="mean")
                accelerator.log({"train_loss": avg.item()}, step=global_step)

        if (epoch + 1) % args.eval_every == 0:
            metrics = evaluate(valid_dl)
            accelerator.log({f"valid/{k}": v for k, v in metrics.items()}, step=global_step)
            logger.info(f"epoch {epoch}: {metrics}", main_process_only=True)
            if metrics["NDCG@10"] > best_ndcg:
                best_ndcg = metrics["NDCG@10"]
                accelerator.wait_for_everyone()
                if accelerator.is_main_process:
                    os.makedirs(args.output_dir, exist_ok=True)
                    torch.save(accelerator.unwrap_model(model).state_dict(),
                               os.path.join(args.output_dir, "best_model.pt"))

    accelerator.wait_for_everyone()
    state = torch.load(os.path.join(args.output_dir, "best_model.pt"), map_location="cpu")
    accelerator.unwrap_model(model).load_state_dict(state)
    test_metrics = evaluate(test_dl)
    accelerator.log({f"test/{k}": v for k, v in test_metrics.items()}, step=global_step)
    logger.info(f"test: {test_metrics}", main_process_only=True)
    accelerator.end_training()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
