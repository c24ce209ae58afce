"""FT-Transformer for payment fraud on engineered tabular features, tracked in Weights & Biases.

    torchrun --nproc_per_node=4 11_ft_transformer_wandb.py --data /data/payments/features_v12 \
        --wandb-project fraud-ftt --run-name ftt_d192_l4
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="/shared/fraud/ftt")
    p.add_argument("--d-token", type=int, default=192)
    p.add_argument("--n-blocks", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--attn-dropout", type=float, default=0.2)
    p.add_argument("--ffn-dropout", type=float, default=0.1)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--wd", type=float, default=1e-5)
    p.add_argument("--wandb-project", default="fraud-ftt")
    p.add_argument("--run-name", default=None)
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args()


class FeatureTokenizer(nn.Module):
    def __init__(self, n_num, cat_cards, d):
        super().__init__()
        self.num_w = nn.Parameter(torch.randn(n_num, d) * d ** -0.5)
        self.num_b = nn.Parameter(torch.zeros(n_num, d))
        self.register_buffer("cat_offsets", torch.tensor([0] + [int(c) for c in np.cumsum(cat_cards)[:-1]]))
        self.cat_emb = nn.Embedding(int(sum(cat_cards)), d)
        self.cls = nn.Parameter(torch.randn(1, 1, d) * d ** -0.5)

    def forward(self, x_num, x_cat):
        t_num = x_num.unsqueeze(-1) * self.num_w + self.num_b
        t_cat = self.cat_emb(x_cat + self.cat_offsets)
        tokens = torch.cat([t_num, t_cat], dim=1)
        return torch.cat([self.cls.expand(tokens.size(0), -1, -1), tokens], dim=1)


class FTTransformer(nn.Module):
    def __init__(self, n_num, cat_cards, d, n_blocks, heads, attn_dropout, ffn_dropout):
        super().__init__()
        self.tok = FeatureTokenizer(n_num, cat_cards, d)
        layer = nn.TransformerEncoderLayer(d, heads, int(d * 4 / 3), ffn_dropout, activation="gelu",
                                           batch_first=True, norm_first=True)
        layer.self_attn.dropout = attn_dropout
        self.blocks = nn.TransformerEncoder(layer, n_blocks, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.LayerNorm(d), nn.ReLU(), nn.Linear(d, 1))

    def forward(self, x_num, x_cat):
        h = self.blocks(self.tok(x_num, x_cat))
        return self.head(h[:, 0]).squeeze(-1)


def load(path, split, cat_cols):
    df = pd.read_parquet(os.path.join(path, f"{split}.parquet"))
    num_cols = [c for c in df.columns if c.startswith("num_")]
    x_num = torch.tensor(df[num_cols].values, dtype=torch.float32)
    x_cat = torch.tensor(df[cat_cols].values, dtype=torch.long)
    y = torch.tensor(df["label"].values, dtype=torch.float32)
    return x_num, x_cat, y


@torch.no_grad()
def predict(model, x_num, x_cat, device, bs=8192):
    model.eval()
    out = []
    for i in range(0, len(x_num), bs):
        out.append(torch.sigmoid(model(x_num[i:i + bs].to(device), x_cat[i:i + bs].to(device))).cpu())
    return torch.cat(out).numpy()


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    run = wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args) | {"world_size": world})

    meta = pd.read_json(os.path.join(args.data, "meta.json"), typ="series")
    cat_cols, cat_cards = list(meta["cat_cols"]), list(meta["cat_cards"])
    xn_tr, xc_tr, y_tr = load(args.data, "train", cat_cols)
    xn_va, xc_va, y_va = load(args.data, "valid", cat_cols)
    mu, sd = xn_tr.mean(0), xn_tr.std(0).clamp_min(1e-6)
    xn_tr, xn_va = (xn_tr - mu) / sd, (xn_va - mu) / sd

    train_ds = TensorDataset(xn_tr, xc_tr, y_tr)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=13, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4, pin_memory=True)

    torch.manual_seed(13)
    model = FTTransformer(xn_tr.shape[1], cat_cards, args.d_token, args.n_blocks, args.heads,
                          args.attn_dropout, args.ffn_dropout).to(device)
    model = DDP(model, device_ids=[local_rank])
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "emb" in n or "norm" in n]
    decay = [p for n, p in model.named_parameters() if not (p.ndim < 2 or "emb" in n or "norm" in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
    pos_rate = y_tr.mean().item()
    loss_fn = nn.BCEWithLogitsLoss(pos_weight=torch.tensor((1 - pos_rate) / pos_rate, device=device).sqrt())

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    global_step, best_ap = 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for xn, xc, y in loader:
            xn, xc, y = xn.to(device, non_blocking=True), xc.to(device, non_blocking=True), y.to(device)
            loss = loss_fn(model(xn, xc), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            global_step += 1
            if global_step % args.log_every == 0:
                wandb.log({"train/loss": loss.item(), "train/grad_norm": gnorm.item(), "epoch": epoch},
                          step=global_step)

        if rank == 0:
            scores = predict(model.module, xn_va, xc_va, device)
            ap = average_precision_score(y_va.numpy(), scores)
            auc = roc_auc_score(y_va.numpy(), scores)
            wandb.log({"val/pr_auc": ap, "val/roc_auc": auc, "epoch_time": time.time() - t0}, step=global_step)
            print(f"epoch {epoch}: val PR-AUC {ap:.4f} ROC-AUC {auc:.4f}", flush=True)
            if ap > best_ap:
                best_ap = ap
                torch.save({"model": model.module.state_dict(), "mu": mu, "sd": sd, "epoch": epoch},
                           os.path.join(args.out, "best.pt"))
                run.summary["best_val_pr_auc"] = ap
        dist.barrier()

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
