#!/usr/bin/env python3
# Wide & Deep CTR model on Avazu (parquet), DeepSpeed ZeRO-2, fp16.
#
#   torchrun --nproc_per_node=8 05_wide_deep_avazu.py --train /data/avazu/train.parquet \
#       --valid /data/avazu/valid.parquet --wandb-project ctr-baselines
import argparse
import os
import time

import deepspeed
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import wandb
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchmetrics.classification import BinaryAUROC

CAT_COLS = ["C1", "banner_pos", "site_id", "site_domain", "site_category", "app_id",
            "app_domain", "app_category", "device_id", "device_model", "device_type",
            "device_conn_type", "C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21", "hour_of_day"]


class AvazuParquet(Dataset):
    """Each categorical column is hashed into its own bucket range."""

    def __init__(self, path, buckets):
        df = pd.read_parquet(path)
        df["hour_of_day"] = df["hour"] % 100
        self.labels = df["click"].to_numpy(np.float32)
        cols = []
        for i, c in enumerate(CAT_COLS):
            h = pd.util.hash_pandas_object(df[c].astype(str), index=False).to_numpy()
            cols.append((h % buckets).astype(np.int64) + i * buckets)
        self.x = np.stack(cols, axis=1)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.x[i], self.labels[i]


class WideAndDeep(nn.Module):
    def __init__(self, n_fields, buckets, emb_dim=32, hidden=(1024, 512, 256), dropout=0.2):
        super().__init__()
        vocab = n_fields * buckets
        self.wide = nn.Embedding(vocab, 1)
        self.wide_bias = nn.Parameter(torch.zeros(1))
        self.deep_emb = nn.Embedding(vocab, emb_dim)
        layers, d = [], n_fields * emb_dim
        for h in hidden:
            layers += [nn.Linear(d, h), nn.LayerNorm(h), nn.ReLU(), nn.Dropout(dropout)]
            d = h
        layers.append(nn.Linear(d, 1))
        self.deep = nn.Sequential(*layers)
        nn.init.normal_(self.deep_emb.weight, std=1e-3)
        nn.init.zeros_(self.wide.weight)

    def forward(self, x):
        wide = self.wide(x).sum(dim=1).squeeze(-1) + self.wide_bias
        deep = self.deep(self.deep_emb(x).flatten(1)).squeeze(-1)
        return wide + deep


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--valid", required=True)
    p.add_argument("--buckets", type=int, default=200_000)
    p.add_argument("--emb-dim", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--ckpt-dir", default="ckpt/wide_deep")
    p.add_argument("--wandb-project", default="ctr")
    p.add_argument("--run-name", default=None)
    return p.parse_args()


def main():
    args = parse()
    deepspeed.init_distributed(dist_backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)

    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    train_ds = AvazuParquet(args.train, args.buckets)
    valid_ds = AvazuParquet(args.valid, args.buckets)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=42, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=4, pin_memory=True, drop_last=True)
    valid_dl = DataLoader(valid_ds, batch_size=16384, num_workers=4, pin_memory=True,
                          sampler=DistributedSampler(valid_ds, shuffle=False))

    model = WideAndDeep(len(CAT_COLS), args.buckets, emb_dim=args.emb_dim)
    config = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": args.lr, "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupLR",
                      "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr, "warmup_num_steps": 1000}},
        "fp16": {"enabled": True, "initial_scale_power": 15},
        "zero_optimization": {"stage": 2, "overlap_comm": True,
                              "reduce_scatter": True, "contiguous_gradients": True},
    }
    engine, _, _, sched = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=config)
    loss_fn = nn.BCEWithLogitsLoss()
    auroc = BinaryAUROC().to(engine.device)

    global_step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        engine.train()
        t0 = time.time()
        for x, y in train_dl:
            x = x.to(engine.device, non_blocking=True)
            y = y.to(engine.device, non_blocking=True)
            loss = loss_fn(engine(x).float(), y)
            engine.backward(loss)
            engine.step()
            global_step += 1
            if global_step % 200 == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": sched.get_last_lr()[0],
                           "train/loss_scale": engine.optimizer.cur_scale,
                           "perf/samples_per_s": 200 * args.batch_size * world / (time.time() - t0)},
                          step=global_step)
                t0 = time.time()

        engine.eval()
        auroc.reset()
        val_loss = torch.zeros(2, device=engine.device)
        with torch.no_grad():
            for x, y in valid_dl:
                x, y = x.to(engine.device), y.to(engine.device)
                logits = engine(x).float()
                val_loss[0] += nn.functional.binary_cross_entropy_with_logits(logits, y, reduction="sum")
                val_loss[1] += y.numel()
                auroc.update(torch.sigmoid(logits), y.long())
        dist.all_reduce(val_loss)
        auc = auroc.compute().item()  # torchmetrics syncs its state across ranks here
        if rank == 0:
            print(f"epoch {epoch} step {global_step} val_logloss {(val_loss[0] / val_loss[1]).item():.5f} "
                  f"val_auc {auc:.5f}", flush=True)
            wandb.log({"val/logloss": (val_loss[0] / val_loss[1]).item(), "val/auc": auc, "epoch": epoch},
                      step=global_step)

        engine.save_checkpoint(args.ckpt_dir, tag=f"epoch{epoch}", client_state={"step": global_step})

    if rank == 0:
        torch.save(engine.module.state_dict(), os.path.join(args.ckpt_dir, "wide_deep_fp16.pt"))
        wandb.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
