"""FT-Transformer for click-through prediction on a large tabular dataset.

    torchrun --nproc_per_node=4 03_ft_transformer_ctr.py --train data/ctr/train.parquet --valid data/ctr/valid.parquet
"""
import argparse
import math
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

CAT_COLS = [f"C{i}" for i in range(1, 27)]
NUM_COLS = [f"I{i}" for i in range(1, 14)]
LABEL = "label"


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--min-freq", type=int, default=10)
    ap.add_argument("--d-token", type=int, default=192)
    ap.add_argument("--n-blocks", type=int, default=3)
    ap.add_argument("--n-heads", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--wd", type=float, default=1e-5)
    ap.add_argument("--amp", action="store_true")
    ap.add_argument("--out", default="out/ft_ctr")
    ap.add_argument("--wandb", action="store_true")
    return ap.parse_args()


def build_vocab(df, min_freq):
    vocab = {}
    for c in CAT_COLS:
        counts = df[c].value_counts()
        keep = sorted(counts[counts >= min_freq].index.astype(str).tolist())
        vocab[c] = {v: i + 1 for i, v in enumerate(keep)}  # 0 = OOV / rare
    return vocab


def encode(df, vocab):
    cats = np.stack([df[c].astype(str).map(vocab[c]).fillna(0).astype(np.int64).values
                     for c in CAT_COLS], axis=1)
    nums = np.log1p(df[NUM_COLS].fillna(0).clip(lower=0).values.astype(np.float32))
    y = df[LABEL].values.astype(np.float32)
    return torch.from_numpy(cats), torch.from_numpy(nums), torch.from_numpy(y)


class FTTransformer(nn.Module):
    def __init__(self, cardinalities, n_num, d, n_blocks, n_heads, dropout=0.1):
        super().__init__()
        self.cat_emb = nn.ModuleList([nn.Embedding(c + 1, d) for c in cardinalities])
        self.num_w = nn.Parameter(torch.randn(n_num, d) / math.sqrt(d))
        self.num_b = nn.Parameter(torch.zeros(n_num, d))
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        layer = nn.TransformerEncoderLayer(d, n_heads, dim_feedforward=int(d * 4 / 3),
                                           dropout=dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_blocks)
        self.head = nn.Sequential(nn.LayerNorm(d), nn.ReLU(), nn.Linear(d, 1))
        self.register_buffer("num_mean", torch.zeros(n_num))
        self.register_buffer("num_std", torch.ones(n_num))

    def forward(self, x_cat, x_num):
        x_num = (x_num - self.num_mean) / self.num_std
        tok_num = x_num.unsqueeze(-1) * self.num_w + self.num_b
        tok_cat = torch.stack([emb(x_cat[:, i]) for i, emb in enumerate(self.cat_emb)], dim=1)
        cls = self.cls.expand(x_cat.size(0), -1, -1)
        h = self.encoder(torch.cat([cls, tok_num, tok_cat], dim=1))
        return self.head(h[:, 0]).squeeze(-1)


def gather_variable(t, world_size):
    """all_gather for 1-D CUDA tensors whose length differs between ranks."""
    n = torch.tensor([t.numel()], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world_size)]
    dist.all_gather(sizes, n)
    max_n = int(max(s.item() for s in sizes))
    padded = torch.zeros(max_n, dtype=t.dtype, device=t.device)
    padded[: t.numel()] = t
    out = [torch.zeros_like(padded) for _ in range(world_size)]
    dist.all_gather(out, padded)
    return torch.cat([o[: int(s.item())] for o, s in zip(out, sizes)])


@torch.no_grad()
def evaluate(model, loader, device, world_size):
    model.eval()
    preds, labels = [], []
    for x_cat, x_num, y in loader:
        logit = model(x_cat.to(device, non_blocking=True), x_num.to(device, non_blocking=True))
        preds.append(torch.sigmoid(logit.float()))
        labels.append(y.to(device))
    p = gather_variable(torch.cat(preds), world_size)
    y = gather_variable(torch.cat(labels), world_size)
    logloss = F.binary_cross_entropy(p.clamp(1e-7, 1 - 1e-7), y).item()
    auc = roc_auc_score(y.cpu().numpy(), p.cpu().numpy())
    return auc, logloss


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_df = pd.read_parquet(args.train)
    valid_df = pd.read_parquet(args.valid)

    # vocabulary from rank 0, shared with everyone so ids agree
    payload = [build_vocab(train_df, args.min_freq) if rank == 0 else None]
    dist.broadcast_object_list(payload, src=0)
    vocab = payload[0]

    tr = TensorDataset(*encode(train_df, vocab))
    va = TensorDataset(*encode(valid_df, vocab))
    del train_df, valid_df

    tr_sampler = DistributedSampler(tr, shuffle=True, seed=17)
    # strided split of the validation rows: no padded duplicates, lengths may differ by one
    va_local = Subset(va, range(rank, len(va), world))
    tr_loader = DataLoader(tr, batch_size=args.batch_size, sampler=tr_sampler,
                           num_workers=4, pin_memory=True, drop_last=True)
    va_loader = DataLoader(va_local, batch_size=4 * args.batch_size, shuffle=False,
                           num_workers=4, pin_memory=True)

    model = FTTransformer([len(vocab[c]) for c in CAT_COLS], len(NUM_COLS),
                          args.d_token, args.n_blocks, args.n_heads).to(device)

    # numeric feature statistics: each rank sums over its own shard, then reduce
    nums = tr.tensors[1][rank::world].to(device)
    stats = torch.stack([nums.sum(0), (nums ** 2).sum(0),
                         torch.full_like(nums[0], nums.size(0))])
    dist.all_reduce(stats)
    mean = stats[0] / stats[2]
    model.num_mean.copy_(mean)
    model.num_std.copy_((stats[1] / stats[2] - mean ** 2).clamp_min(1e-6).sqrt())
    del nums

    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    run = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        if args.wandb:
            import wandb
            run = wandb.init(project="ctr-ft", config=vars(args))

    best_auc = 0.0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device=device)
        for step, (x_cat, x_num, y) in enumerate(tr_loader):
            x_cat = x_cat.to(device, non_blocking=True)
            x_num = x_num.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                logit = model(x_cat, x_num)
            loss = F.binary_cross_entropy_with_logits(logit.float(), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            tot += torch.stack([loss.detach() * y.numel(), torch.tensor(float(y.numel()), device=device)])
            if rank == 0 and step % 200 == 0:
                print(f"ep {epoch} step {step} loss {loss.item():.4f}", flush=True)
        dist.all_reduce(tot)

        auc, logloss = evaluate(model, va_loader, device, world)
        if rank == 0:
            train_loss = (tot[0] / tot[1]).item()
            print(f"epoch {epoch}: train {train_loss:.4f} valid auc {auc:.4f} logloss {logloss:.4f}")
            if run is not None:
                run.log({"train_loss": train_loss, "val_auc": auc, "val_logloss": logloss, "epoch": epoch})
            if auc > best_auc:
                best_auc = auc
                torch.save({"model": model.module.state_dict(), "vocab": vocab, "epoch": epoch,
                            "auc": auc}, os.path.join(args.out, "best.pt"))
        dist.barrier()

    # reload the best weights on every rank for the final report
    ckpt = torch.load(os.path.join(args.out, "best.pt"), map_location=device)
    model.module.load_state_dict(ckpt["model"])
    auc, logloss = evaluate(model, va_loader, device, world)
    if rank == 0:
        print(f"best epoch {ckpt['epoch']}: auc {auc:.4f} logloss {logloss:.4f}")
        if run is not None:
            run.summary["best_auc"] = auc
            run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
