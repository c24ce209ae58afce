"""FT-Transformer with per-fold target encoding, DDP, bf16 autocast and grad accumulation.

Launch:
    torchrun --standalone --nproc_per_node=8 02_ft_transformer_te_ddp.py --config configs/ftt_credit.yaml
"""
import argparse
import math
import os
import time
from contextlib import nullcontext

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import KFold, StratifiedKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler


DEFAULTS = dict(
    data="data/credit/train.parquet", target="default", id_col="loan_id",
    cat_cols=[], te_cols=[], num_cols=[], out_dir="runs/ftt_te",
    n_folds=5, seed=2024, epochs=40, batch_size=512, accum_steps=2, lr=3e-4,
    weight_decay=1e-5, d_token=192, n_blocks=3, n_heads=8, attn_dropout=0.2,
    ffn_dropout=0.1, te_smoothing=20.0, patience=6, workers=4,
)


def load_config():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--resume-fold", type=int, default=0)
    a = p.parse_args()
    cfg = dict(DEFAULTS)
    with open(a.config) as f:
        cfg.update(yaml.safe_load(f) or {})
    cfg["resume_fold"] = a.resume_fold
    return argparse.Namespace(**cfg)


class FeatureTokenizer(nn.Module):
    def __init__(self, n_num, cardinalities, d):
        super().__init__()
        self.num_w = nn.Parameter(torch.randn(n_num, d) * d ** -0.5)
        self.num_b = nn.Parameter(torch.zeros(n_num, d))
        self.cat_emb = nn.Embedding(sum(cardinalities), d)
        nn.init.normal_(self.cat_emb.weight, std=d ** -0.5)
        self.register_buffer("cat_offsets", torch.tensor([0] + list(np.cumsum(cardinalities)[:-1])).long())
        self.cls = nn.Parameter(torch.randn(1, 1, d) * d ** -0.5)

    def forward(self, x_num, x_cat):
        num = x_num.unsqueeze(-1) * self.num_w + self.num_b
        cat = self.cat_emb(x_cat + self.cat_offsets)
        cls = self.cls.expand(x_num.size(0), -1, -1)
        return torch.cat([cls, num, cat], dim=1)


class FTTransformer(nn.Module):
    def __init__(self, n_num, cardinalities, d_token, n_blocks, n_heads, attn_dropout, ffn_dropout):
        super().__init__()
        self.tokenizer = FeatureTokenizer(n_num, cardinalities, d_token)
        layer = nn.TransformerEncoderLayer(d_token, n_heads, int(d_token * 4 / 3), ffn_dropout,
                                           activation="gelu", batch_first=True, norm_first=True)
        layer.self_attn.dropout = attn_dropout
        self.blocks = nn.TransformerEncoder(layer, n_blocks, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.LayerNorm(d_token), nn.ReLU(), nn.Linear(d_token, 1))

    def forward(self, x_num, x_cat):
        h = self.blocks(self.tokenizer(x_num, x_cat))
        return self.head(h[:, 0]).squeeze(-1)


def target_encode(tr, va, col, target, smoothing, seed, n_inner=5):
    """Smoothed mean-target encoding. Train rows get inner-fold (out-of-fold) values."""
    prior = tr[target].mean()

    def stats(frame):
        g = frame.groupby(col)[target].agg(["sum", "count"])
        return (g["sum"] + prior * smoothing) / (g["count"] + smoothing)

    tr_enc = np.full(len(tr), prior, dtype=np.float32)
    for in_tr, in_va in KFold(n_inner, shuffle=True, random_state=seed).split(tr):
        m = stats(tr.iloc[in_tr])
        tr_enc[in_va] = tr[col].iloc[in_va].map(m).fillna(prior).values
    va_enc = va[col].map(stats(tr)).fillna(prior).values.astype(np.float32)
    return tr_enc, va_enc


def make_fold_tensors(df, tr_idx, va_idx, args):
    tr, va = df.iloc[tr_idx], df.iloc[va_idx]
    tr_num, va_num = [tr[args.num_cols].values], [va[args.num_cols].values]
    for c in args.te_cols:
        a, b = target_encode(tr, va, c, args.target, args.te_smoothing, args.seed)
        tr_num.append(a[:, None])
        va_num.append(b[:, None])
    tr_num = np.concatenate(tr_num, 1).astype(np.float32)
    va_num = np.concatenate(va_num, 1).astype(np.float32)
    med = np.nanmedian(tr_num, 0)
    tr_num, va_num = np.where(np.isnan(tr_num), med, tr_num), np.where(np.isnan(va_num), med, va_num)
    mu, sd = tr_num.mean(0), tr_num.std(0) + 1e-6
    tr_num, va_num = (tr_num - mu) / sd, (va_num - mu) / sd
    tr_ds = TensorDataset(torch.from_numpy(tr_num), torch.from_numpy(df[args.cat_cols].values[tr_idx]),
                          torch.from_numpy(tr[args.target].values.astype(np.float32)))
    va_ds = TensorDataset(torch.from_numpy(va_num), torch.from_numpy(df[args.cat_cols].values[va_idx]),
                          torch.from_numpy(va[args.target].values.astype(np.float32)))
    return tr_ds, va_ds


@torch.no_grad()
def predict_shard(model, ds, idx, device):
    """Predict the rows idx of ds on this rank (shards may differ in length by one row)."""
    model.eval()
    loader = DataLoader(Subset(ds, idx.tolist()), batch_size=2048, shuffle=False)
    out = []
    for x_num, x_cat, _ in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out.append(torch.sigmoid(model(x_num.to(device), x_cat.to(device))).float().cpu())
    return torch.cat(out).numpy() if out else np.zeros(0, dtype=np.float32)


def main():
    args = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed + rank)  # dropout streams differ per rank; weights come from rank 0 via DDP

    df = pd.read_parquet(args.data)
    for c in args.cat_cols:
        df[c] = df[c].astype("category").cat.codes.astype(np.int64) + 1  # -1 (NaN) -> 0
    cards = [int(df[c].max()) + 1 for c in args.cat_cols]
    y = df[args.target].values
    folds = list(StratifiedKFold(args.n_folds, shuffle=True, random_state=args.seed).split(df, y))
    os.makedirs(args.out_dir, exist_ok=True)  # shared FS, idempotent on every rank

    oof_path = os.path.join(args.out_dir, "oof.npy")
    oof = np.load(oof_path) if (args.resume_fold > 0 and os.path.exists(oof_path)) else np.zeros(len(df), np.float32)
    global_batch = args.batch_size * args.accum_steps * world
    lr = args.lr * math.sqrt(global_batch / 1024)

    for fold, (tr_idx, va_idx) in enumerate(folds):
        if fold < args.resume_fold:
            continue
        tr_ds, va_ds = make_fold_tensors(df, tr_idx, va_idx, args)
        sampler = DistributedSampler(tr_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
        loader = DataLoader(tr_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                            pin_memory=True, drop_last=True)
        model = FTTransformer(tr_ds.tensors[0].shape[1], cards, args.d_token, args.n_blocks, args.n_heads,
                              args.attn_dropout, args.ffn_dropout).to(device)
        ddp = DDP(model, device_ids=[local_rank])
        no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "cat_emb" in n or "num_" in n]
        decay = [p for n, p in model.named_parameters() if not (p.ndim < 2 or "cat_emb" in n or "num_" in n)]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=lr)

        my_val = np.arange(len(va_ds))[rank::world]
        best, bad, ckpt = -1.0, 0, os.path.join(args.out_dir, f"fold{fold}.pt")
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            ddp.train()
            t0 = time.time()
            for step, (x_num, x_cat, yb) in enumerate(loader):
                x_num, x_cat, yb = x_num.to(device, non_blocking=True), x_cat.to(device, non_blocking=True), yb.to(device, non_blocking=True)
                sync = (step + 1) % args.accum_steps == 0
                with (nullcontext() if sync else ddp.no_sync()):
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = F.binary_cross_entropy_with_logits(ddp(x_num, x_cat).float(), yb)
                    (loss / args.accum_steps).backward()
                if sync:
                    torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
                    opt.step()
                    opt.zero_grad(set_to_none=True)

            pieces = [None] * world
            dist.all_gather_object(pieces, (my_val, predict_shard(model, va_ds, my_val, device)))
            val_pred = np.zeros(len(va_ds), np.float32)
            for i, p in pieces:
                val_pred[i] = p
            auc = roc_auc_score(y[va_idx], val_pred)  # identical on every rank
            if rank == 0:
                print(f"[fold {fold}] epoch {epoch:02d} loss {loss.item():.4f} auc {auc:.5f} {time.time() - t0:.0f}s", flush=True)
            if auc > best:
                best, bad = auc, 0
                oof[va_idx] = val_pred
                if rank == 0:
                    torch.save({"model": model.state_dict(), "epoch": epoch, "auc": float(auc)}, ckpt)
            else:
                bad += 1
                if bad >= args.patience:
                    break

        dist.barrier()  # checkpoint for this fold is on disk before anyone reads it
        state = torch.load(ckpt, map_location=device)
        model.load_state_dict(state["model"])
        if rank == 0:
            np.save(oof_path, oof)
            print(f"[fold {fold}] best auc {state['auc']:.5f} @ epoch {state['epoch']}", flush=True)
        del ddp, opt

    if rank == 0:
        print(f"OOF AUC {roc_auc_score(y, oof):.5f}")
        pd.DataFrame({args.id_col: df[args.id_col], "oof": oof}).to_csv(os.path.join(args.out_dir, "oof.csv"), index=False)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
