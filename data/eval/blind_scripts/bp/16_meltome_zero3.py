"""Fine-tune ESM-2 3B on FLIP Meltome (mixed split) to regress melting temperature, DeepSpeed ZeRO-3.

    deepspeed --num_gpus=8 16_meltome_zero3.py --train data/meltome/mixed_train.csv \
        --test data/meltome/mixed_test.csv --out runs/meltome_esm3b
"""
import argparse
import os

import deepspeed
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from scipy.stats import spearmanr
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import EsmModel, EsmTokenizer


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--test", required=True)
    ap.add_argument("--backbone", default="facebook/esm2_t36_3B_UR50D")
    ap.add_argument("--out", default="runs/meltome")
    ap.add_argument("--micro_bs", type=int, default=4)
    ap.add_argument("--grad_accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--max_len", type=int, default=1022)
    ap.add_argument("--local_rank", "--local-rank", type=int, default=-1)
    return ap.parse_args()


def ds_config(args):
    return {
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.98], "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr, "warmup_num_steps": 200,
                                 "total_num_steps": args.total_steps}},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 1e5,
            "stage3_max_live_parameters": 1e9,
        },
        "steps_per_print": 100,
        "wall_clock_breakdown": False,
    }


class Meltome(Dataset):
    def __init__(self, path, mean=None, std=None):
        df = pd.read_csv(path)
        self.seqs = df["sequence"].tolist()
        y = df["target"].astype(np.float32).to_numpy()
        self.mean = float(y.mean()) if mean is None else mean
        self.std = float(y.std()) if std is None else std
        self.y = (y - self.mean) / self.std

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        return self.seqs[i], self.y[i], i


class TmRegressor(nn.Module):
    def __init__(self, backbone):
        super().__init__()
        self.esm = EsmModel.from_pretrained(backbone, add_pooling_layer=False)
        self.esm.contact_head.requires_grad_(False)
        h = self.esm.config.hidden_size
        self.head = nn.Sequential(nn.LayerNorm(h), nn.Linear(h, 256), nn.GELU(), nn.Linear(256, 1))

    def forward(self, input_ids, attention_mask):
        h = self.esm(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1)
        return self.head(pooled).squeeze(-1)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    tok = EsmTokenizer.from_pretrained(args.backbone)
    train_ds = Meltome(args.train)
    test_ds = Meltome(args.test, train_ds.mean, train_ds.std)

    def collate(batch):
        seqs, y, idx = zip(*batch)
        enc = tok(list(seqs), padding=True, truncation=True, max_length=args.max_len + 2, return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"], torch.tensor(y), torch.tensor(idx)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    loader = DataLoader(train_ds, batch_size=args.micro_bs, sampler=sampler, collate_fn=collate,
                        num_workers=4, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=8, sampler=DistributedSampler(test_ds, shuffle=False),
                             collate_fn=collate, num_workers=2)
    args.total_steps = args.epochs * len(loader) // args.grad_accum

    model = TmRegressor(args.backbone)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=ds_config(args))
    device = engine.device

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        for it, (ids, attn, y, _) in enumerate(loader):
            pred = engine(ids.to(device), attn.to(device))
            loss = F.mse_loss(pred.float(), y.to(device))
            engine.backward(loss)
            engine.step()
            if rank == 0 and it % 200 == 0:
                print(f"epoch {epoch} it {it} mse {loss.item():.4f}", flush=True)

        engine.eval()
        preds, ys, idxs = [], [], []
        with torch.no_grad():
            for ids, attn, y, idx in test_loader:
                preds.append(engine(ids.to(device), attn.to(device)).float())
                ys.append(y.to(device))
                idxs.append(idx.to(device))
        local = torch.stack([torch.cat(preds), torch.cat(ys), torch.cat(idxs).float()], dim=1)
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local)
        allp = torch.cat(gathered).cpu().numpy()
        _, first = np.unique(allp[:, 2], return_index=True)
        rho = spearmanr(allp[first, 0], allp[first, 1]).correlation
        if rank == 0:
            rmse = np.sqrt(np.mean((allp[first, 0] - allp[first, 1]) ** 2)) * train_ds.std
            print(f"epoch {epoch}: test spearman {rho:.4f} RMSE {rmse:.2f} C", flush=True)
        engine.save_checkpoint(args.out, tag=f"epoch{epoch}", client_state={"epoch": epoch, "spearman": rho})

    # plain PyTorch weights for downstream inference without DeepSpeed
    if rank == 0:
        torch.save({"state_dict": engine.module.state_dict(), "mean": train_ds.mean, "std": train_ds.std},
                   os.path.join(args.out, "tm_regressor.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
