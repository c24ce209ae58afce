"""Multitask ICU outcome model (mortality, prolonged LOS > 7d, 30-day ICU readmission).

Hourly MIMIC-IV features (first 24h) -> bidirectional LSTM + attention pooling -> three heads.
Tracks everything in Weights & Biases.

    torchrun --nproc_per_node=4 16_multitask_icu_wandb.py --data /data/mimic4/mt24.npz \
        --wandb_project icu-multitask --run_name lstm_attn_v3
"""
import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

TASKS = ["mortality", "los_gt7", "readmit30"]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out_dir", default="checkpoints/mt_icu")
    p.add_argument("--wandb_project", default="icu-multitask")
    p.add_argument("--run_name", default=None)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--dropout", type=float, default=0.25)
    p.add_argument("--batch_size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--task_weights", type=float, nargs=3, default=[1.0, 0.5, 0.5])
    return p.parse_args()


def load_split(npz, split):
    x = torch.from_numpy(npz[f"{split}_x"]).float()        # [N, 24, F] (values + masks)
    s = torch.from_numpy(npz[f"{split}_static"]).float()   # [N, S]
    y = torch.from_numpy(npz[f"{split}_y"]).float()        # [N, 3]; -1 = label unavailable
    return TensorDataset(x, s, y, torch.arange(len(y)))


class AttnLSTM(nn.Module):
    def __init__(self, n_feat, n_static, hidden, dropout, n_tasks):
        super().__init__()
        self.inp = nn.Sequential(nn.Linear(n_feat, hidden), nn.ReLU())
        self.lstm = nn.LSTM(hidden, hidden, num_layers=2, batch_first=True, bidirectional=True, dropout=dropout)
        self.att = nn.Linear(2 * hidden, 1)
        self.static = nn.Sequential(nn.Linear(n_static, 32), nn.ReLU())
        self.drop = nn.Dropout(dropout)
        self.heads = nn.Linear(2 * hidden + 32, n_tasks)

    def forward(self, x, s):
        h, _ = self.lstm(self.inp(x))
        a = torch.softmax(self.att(h), dim=1)
        z = torch.cat([(a * h).sum(1), self.static(s)], dim=-1)
        return self.heads(self.drop(z))


def masked_bce(logits, y, weights):
    valid = (y >= 0).float()
    loss = F.binary_cross_entropy_with_logits(logits, y.clamp(min=0), reduction="none") * valid
    per_task = loss.sum(0) / valid.sum(0).clamp(min=1)
    return (per_task * weights).sum(), per_task.detach()


@torch.no_grad()
def evaluate(model, loader, n, device):
    model.eval()
    probs = torch.zeros(n, len(TASKS), device=device)
    labels = torch.zeros(n, len(TASKS), device=device)
    hit = torch.zeros(n, 1, device=device)
    for x, s, y, idx in loader:
        idx = idx.to(device)
        probs[idx] = torch.sigmoid(model(x.to(device), s.to(device)))
        labels[idx] = y.to(device)
        hit[idx] = 1.0
    # sampler padding repeats a few rows on some ranks; normalise by how often each row was seen
    hits = hit.clone()
    dist.all_reduce(hits)
    probs *= hit
    labels *= hit
    dist.all_reduce(probs)
    dist.all_reduce(labels)
    probs, labels = (probs / hits).cpu().numpy(), (labels / hits).cpu().numpy()
    out = {}
    for k, t in enumerate(TASKS):
        m = labels[:, k] >= 0
        out[f"val/{t}_auroc"] = roc_auc_score(labels[m, k], probs[m, k])
        out[f"val/{t}_auprc"] = average_precision_score(labels[m, k], probs[m, k])
    out["val/mean_auroc"] = float(np.mean([out[f"val/{t}_auroc"] for t in TASKS]))
    return out


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(7)

    wandb.init(project=args.wandb_project, name=args.run_name,
               config={**vars(args), "world_size": world})

    npz = np.load(args.data)
    train_ds, val_ds = load_split(npz, "train"), load_split(npz, "val")
    n_feat, n_static = train_ds.tensors[0].shape[-1], train_ds.tensors[1].shape[-1]
    sampler = DistributedSampler(train_ds, shuffle=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=512, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=2)

    model = DDP(AttnLSTM(n_feat, n_static, args.hidden, args.dropout, len(TASKS)).to(device),
                device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", patience=3, factor=0.5)
    w = torch.tensor(args.task_weights, device=device)

    os.makedirs(args.out_dir, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(len(TASKS) + 1, device=device)
        for x, s, y, _ in loader:
            x, s, y = x.to(device, non_blocking=True), s.to(device), y.to(device)
            loss, per_task = masked_bce(model(x, s), y, w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            tot += torch.cat([per_task, torch.ones(1, device=device)])
        dist.all_reduce(tot)
        train_losses = {f"train/{t}_bce": (tot[k] / tot[-1]).item() for k, t in enumerate(TASKS)}

        val = evaluate(model, val_loader, len(val_ds), device)
        sched.step(val["val/mean_auroc"])
        wandb.log({**train_losses, **val, "lr": opt.param_groups[0]["lr"], "epoch": epoch})

        if rank == 0:
            print(f"epoch {epoch} " + " ".join(f"{k}={v:.4f}" for k, v in val.items()), flush=True)
            if val["val/mean_auroc"] > best:
                best = val["val/mean_auroc"]
                path = os.path.join(args.out_dir, "best.pt")
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "val": val}, path)
                wandb.run.summary["best_mean_auroc"] = best
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
