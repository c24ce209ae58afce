"""Masked expression-value pretraining on CELLxGENE Census cells (scGPT-like objective).

Cells were exported to parquet shards with columns gene_ids (list<int32>) and
counts (list<float32>) for non-zero genes. A random 40% of the (gene, value) pairs
have their value hidden and the model regresses the log1p-normalised expression.

    torchrun --nproc_per_node=8 14_census_expr_pretrain.py --shards /data/census_parquet \
        --n_genes 60664 --run_name census-base-v2
"""
import argparse
import glob
import os

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

PAD_GENE = 0
CLS_GENE = 1


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", required=True)
    ap.add_argument("--n_genes", type=int, required=True)
    ap.add_argument("--run_name", default=None)
    ap.add_argument("--project", default="sc-foundation")
    ap.add_argument("--out", default="runs/census")
    ap.add_argument("--max_genes", type=int, default=2048)
    ap.add_argument("--mask_ratio", type=float, default=0.4)
    ap.add_argument("--d_model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch_size", type=int, default=24)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=6)
    return ap.parse_args()


class CensusCells(Dataset):
    def __init__(self, files, max_genes):
        tables = [pq.read_table(f, columns=["gene_ids", "counts"]) for f in files]
        self.genes = [g for t in tables for g in t.column("gene_ids").to_pylist()]
        self.counts = [c for t in tables for c in t.column("counts").to_pylist()]
        self.max_genes = max_genes

    def __len__(self):
        return len(self.genes)

    def __getitem__(self, i):
        g = np.asarray(self.genes[i], dtype=np.int64) + 2  # shift past PAD / CLS
        c = np.asarray(self.counts[i], dtype=np.float32)
        v = np.log1p(c / c.sum() * 1e4)
        if len(g) > self.max_genes - 1:
            keep = np.random.choice(len(g), self.max_genes - 1, replace=False)
            g, v = g[keep], v[keep]
        return np.concatenate([[CLS_GENE], g]), np.concatenate([[0.0], v]).astype(np.float32)


def make_collate(mask_ratio):
    def collate(batch):
        L = max(len(g) for g, _ in batch)
        G = torch.full((len(batch), L), PAD_GENE, dtype=torch.long)
        V = torch.zeros((len(batch), L))
        for k, (g, v) in enumerate(batch):
            G[k, : len(g)] = torch.from_numpy(g)
            V[k, : len(v)] = torch.from_numpy(v)
        real = G > CLS_GENE
        hide = (torch.rand(G.shape) < mask_ratio) & real
        return G, V.masked_fill(hide, -1.0), V, hide
    return collate


class ExprTransformer(nn.Module):
    def __init__(self, n_genes, d, layers):
        super().__init__()
        self.gene = nn.Embedding(n_genes + 2, d, padding_idx=PAD_GENE)
        self.value = nn.Sequential(nn.Linear(1, d), nn.ReLU(), nn.Linear(d, d), nn.LayerNorm(d))
        self.mask_value = nn.Parameter(torch.zeros(d))
        block = nn.TransformerEncoderLayer(d, 8, 4 * d, dropout=0.1, batch_first=True, norm_first=True,
                                           activation="gelu")
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.decoder = nn.Sequential(nn.Linear(2 * d, d), nn.LeakyReLU(), nn.Linear(d, 1))

    def forward(self, G, V_in, hide):
        v = self.value(V_in.clamp(min=0).unsqueeze(-1))
        v = torch.where(hide.unsqueeze(-1), self.mask_value.expand_as(v), v)
        ge = self.gene(G)
        h = self.encoder(ge + v, src_key_padding_mask=G.eq(PAD_GENE))
        return self.decoder(torch.cat([h, ge], -1)).squeeze(-1)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    run = wandb.init(project=args.project, name=args.run_name, config=vars(args))

    files = sorted(glob.glob(os.path.join(args.shards, "*.parquet")))
    train_ds, val_ds = CensusCells(files[:-1], args.max_genes), CensusCells(files[-1:], args.max_genes)
    collate = make_collate(args.mask_ratio)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, args.batch_size, sampler=sampler, collate_fn=collate, num_workers=8,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, args.batch_size, sampler=DistributedSampler(val_ds, shuffle=False),
                            collate_fn=collate, num_workers=4)

    model = ExprTransformer(args.n_genes, args.d_model, args.layers).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(loader),
                                                pct_start=0.03, anneal_strategy="cos")
    scaler = torch.cuda.amp.GradScaler()
    os.makedirs(args.out, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for G, V_in, V, hide in loader:
            G, V_in, V, hide = (t.to(device, non_blocking=True) for t in (G, V_in, V, hide))
            with torch.autocast("cuda", dtype=torch.float16):
                pred = model(G, V_in, hide)
            loss = F.mse_loss(pred.float()[hide], V[hide])
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            gn = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            if step % 50 == 0:
                wandb.log({"train/mse": loss.item(), "train/grad_norm": gn.item(),
                           "lr": sched.get_last_lr()[0], "epoch": epoch}, step=step)

        model.eval()
        s = torch.zeros(3, device=device, dtype=torch.float64)
        with torch.no_grad():
            for G, V_in, V, hide in val_loader:
                G, V_in, V, hide = (t.to(device) for t in (G, V_in, V, hide))
                with torch.autocast("cuda", dtype=torch.float16):
                    pred = model(G, V_in, hide).float()
                err = (pred[hide] - V[hide]) ** 2
                s += torch.stack([err.sum().double(), torch.tensor(err.numel(), device=device, dtype=torch.float64),
                                  (pred[hide] - V[hide]).abs().sum().double()])
        dist.all_reduce(s)
        val_mse, val_mae = (s[0] / s[1]).item(), (s[2] / s[1]).item()
        wandb.log({"val/mse": val_mse, "val/mae": val_mae}, step=step)
        if rank == 0:
            print(f"epoch {epoch} val mse {val_mse:.4f} mae {val_mae:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "args": vars(args)},
                       os.path.join(args.out, f"epoch{epoch}.pt"))
        dist.barrier()

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
