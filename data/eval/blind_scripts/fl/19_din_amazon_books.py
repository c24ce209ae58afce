"""Deep Interest Network (DIN) on Amazon-Books behaviour sequences, DeepSpeed ZeRO-2 bf16.

Input pickles are produced by prepare_amazon.py:
  train.pkl / test.pkl : list of (user, hist_items, hist_cats, target_item, target_cat, label)
  meta.pkl             : {"n_items": ..., "n_cats": ..., "n_users": ...}

    deepspeed --num_gpus 8 19_din_amazon_books.py --data data/amazon_books --epochs 4
"""
import argparse
import os
import pickle
import time

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

MAX_HIST = 100


def parse_args():
    parser = argparse.ArgumentParser(description="DIN with DeepSpeed")
    parser.add_argument("--data", required=True)
    parser.add_argument("--emb-dim", type=int, default=18)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--out", default="runs/din_books")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class BehaviourData(Dataset):
    def __init__(self, path):
        with open(path, "rb") as f:
            self.rows = pickle.load(f)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        user, hist_i, hist_c, item, cat, label = self.rows[i]
        hist_i, hist_c = hist_i[-MAX_HIST:], hist_c[-MAX_HIST:]
        n = len(hist_i)
        hi = torch.zeros(MAX_HIST, dtype=torch.long)
        hc = torch.zeros(MAX_HIST, dtype=torch.long)
        hi[:n], hc[:n] = torch.tensor(hist_i), torch.tensor(hist_c)
        return user, hi, hc, n, item, cat, float(label)


def build_dataloaders(args):
    train_set = BehaviourData(os.path.join(args.data, "train.pkl"))
    test_set = BehaviourData(os.path.join(args.data, "test.pkl"))
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=7)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=4096, sampler=test_sampler,
                             num_workers=args.workers, pin_memory=True)
    return train_loader, train_sampler, test_loader


class Dice(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.bn = nn.BatchNorm1d(dim, affine=False)
        self.alpha = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        shape = x.shape
        p = torch.sigmoid(self.bn(x.reshape(-1, shape[-1]))).reshape(shape)
        return p * x + (1 - p) * self.alpha * x


class AttentionUnit(nn.Module):
    def __init__(self, d, hidden=(80, 40)):
        super().__init__()
        self.fc1 = nn.Linear(4 * d, hidden[0])
        self.act1 = Dice(hidden[0])
        self.fc2 = nn.Linear(hidden[0], hidden[1])
        self.act2 = Dice(hidden[1])
        self.out = nn.Linear(hidden[1], 1)

    def forward(self, query, keys, mask):
        q = query.unsqueeze(1).expand_as(keys)
        x = torch.cat([q, keys, q - keys, q * keys], dim=-1)
        w = self.out(self.act2(self.fc2(self.act1(self.fc1(x))))).squeeze(-1)
        w = w.masked_fill(~mask, 0.0)  # DIN keeps un-normalised weights
        return (w.unsqueeze(-1) * keys).sum(1)


class DIN(nn.Module):
    def __init__(self, n_users, n_items, n_cats, d):
        super().__init__()
        self.user_emb = nn.Embedding(n_users, d)
        self.item_emb = nn.Embedding(n_items, d, padding_idx=0)
        self.cat_emb = nn.Embedding(n_cats, d, padding_idx=0)
        self.att = AttentionUnit(2 * d)
        self.mlp = nn.Sequential(nn.Linear(7 * d, 200), Dice(200), nn.Linear(200, 80), Dice(80), nn.Linear(80, 1))

    def forward(self, user, hist_i, hist_c, hist_len, item, cat):
        keys = torch.cat([self.item_emb(hist_i), self.cat_emb(hist_c)], dim=-1)
        query = torch.cat([self.item_emb(item), self.cat_emb(cat)], dim=-1)
        mask = torch.arange(hist_i.size(1), device=hist_i.device)[None] < hist_len[:, None]
        interest = self.att(query, keys, mask)
        hist_sum = (keys * mask.unsqueeze(-1)).sum(1)
        x = torch.cat([self.user_emb(user), query, interest, hist_sum], dim=-1)
        return self.mlp(x).squeeze(-1)


def to_device(batch, device):
    user, hi, hc, n, item, cat, y = batch
    return (user.to(device), hi.to(device), hc.to(device), n.to(device),
            item.to(device), cat.to(device), y.to(device).float())


@torch.no_grad()
def evaluate(engine, loader):
    engine.eval()
    probs, labels = [], []
    for batch in loader:
        user, hi, hc, n, item, cat, y = to_device(batch, engine.device)
        probs.append(torch.sigmoid(engine(user, hi, hc, n, item, cat).float()))
        labels.append(y)
    probs, labels = torch.cat(probs), torch.cat(labels)
    world = torch.distributed.get_world_size()
    gp = [torch.zeros_like(probs) for _ in range(world)]
    gl = [torch.zeros_like(labels) for _ in range(world)]
    torch.distributed.all_gather(gp, probs)
    torch.distributed.all_gather(gl, labels)
    engine.train()
    return roc_auc_score(torch.cat(gl).cpu().numpy(), torch.cat(gp).cpu().numpy())


def main():
    args = parse_args()
    torch.manual_seed(2023)
    with open(os.path.join(args.data, "meta.pkl"), "rb") as f:
        meta = pickle.load(f)

    train_loader, train_sampler, test_loader = build_dataloaders(args)
    model = DIN(meta["n_users"], meta["n_items"], meta["n_cats"], args.emb_dim)

    ds_config = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": args.lr}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr, "warmup_num_steps": 500,
                                 "total_num_steps": len(train_loader) * args.epochs}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True},
        "steps_per_print": 1000,
    }
    engine, _, _, scheduler = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=ds_config)
    rank = engine.global_rank
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best_auc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for step, batch in enumerate(train_loader):
            user, hi, hc, n, item, cat, y = to_device(batch, engine.device)
            logits = engine(user, hi, hc, n, item, cat)
            loss = F.binary_cross_entropy_with_logits(logits.float(), y)
            engine.backward(loss)
            engine.step()
            if rank == 0 and step % 500 == 0:
                print(f"epoch {epoch} step {step}/{len(train_loader)} loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)

        auc = evaluate(engine, test_loader)
        if rank == 0:
            print(f"epoch {epoch}: test AUC {auc:.4f}", flush=True)
        engine.save_checkpoint(args.out, tag=f"epoch{epoch}", client_state={"epoch": epoch, "auc": auc})
        if rank == 0 and auc > best_auc:
            best_auc = auc
            torch.save({k: v.float().cpu() for k, v in engine.module.state_dict().items()},
                       os.path.join(args.out, "din_best.pt"))

    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
