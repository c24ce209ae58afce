"""Two-tower retrieval model (query / listing) with in-batch negatives gathered
across all GPUs. One Slurm task per GPU, env:// wired from the Slurm variables.

#!/bin/bash
#SBATCH --job-name=two-tower
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-task=1
#SBATCH --cpus-per-task=10
#SBATCH --time=1-00:00:00
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=29400
export WANDB_PROJECT=search-two-tower
srun python two_tower.py --train /shared/search/pairs/train --val /shared/search/pairs/val \
    --out /shared/search/ckpt/tt-$SLURM_JOB_ID
"""
import argparse
import glob
import os
import time

import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--encoder", default="sentence-transformers/all-MiniLM-L12-v2")
    p.add_argument("--bs", type=int, default=256, help="per GPU; negatives come from all GPUs")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--temp", type=float, default=0.05)
    p.add_argument("--max-len", type=int, default=64)
    return p.parse_args()


class Pairs(Dataset):
    def __init__(self, folder):
        tables = [pq.read_table(f, columns=["query", "listing"]) for f in sorted(glob.glob(f"{folder}/*.parquet"))]
        self.q, self.d = [], []
        for t in tables:
            self.q += t.column("query").to_pylist()
            self.d += t.column("listing").to_pylist()

    def __len__(self):
        return len(self.q)

    def __getitem__(self, i):
        return self.q[i], self.d[i]


class Tower(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.enc = AutoModel.from_pretrained(name, add_pooling_layer=False)

    def forward(self, ids, mask):
        h = self.enc(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).float()
        return F.normalize((h * m).sum(1) / m.sum(1).clamp(min=1e-6), dim=-1)


class TwoTower(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.query = Tower(name)
        self.doc = Tower(name)

    def forward(self, q, d):
        return self.query(*q), self.doc(*d)


def gather_with_grad(x, rank, world):
    """all_gather, then put the local (grad-carrying) shard back in place."""
    buf = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(buf, x.detach())
    buf[rank] = x
    return torch.cat(buf)


def contrastive_loss(qe, de, temp, rank, world):
    all_d = gather_with_grad(de, rank, world)
    logits = qe @ all_d.t() / temp
    target = torch.arange(qe.size(0), device=qe.device) + rank * qe.size(0)
    return F.cross_entropy(logits, target)


@torch.no_grad()
def recall_at_k(model, loader, device, rank, world, k=10):
    model.eval()
    qs, ds = [], []
    for q, d in loader:
        qe, de = model(tuple(t.to(device) for t in q), tuple(t.to(device) for t in d))
        qs.append(qe)
        ds.append(de)
    qe, de = torch.cat(qs), torch.cat(ds)
    all_d = torch.cat([torch.empty_like(de) for _ in range(world)])
    dist.all_gather_into_tensor(all_d, de)
    top = (qe @ all_d.t()).topk(k, dim=1).indices
    target = torch.arange(qe.size(0), device=device) + rank * qe.size(0)
    hits = torch.stack([(top == target[:, None]).any(1).sum().float(), torch.tensor(float(qe.size(0)), device=device)])
    dist.all_reduce(hits)
    model.train()
    return (hits[0] / hits[1]).item()


def main():
    args = get_args()
    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world)

    wandb.init(name=f"tt-{os.environ['SLURM_JOB_ID']}", config=vars(args), tags=["two-tower", "slurm"])

    tok = AutoTokenizer.from_pretrained(args.encoder)

    def collate(batch):
        q, d = zip(*batch)
        qt = tok(list(q), padding=True, truncation=True, max_length=args.max_len, return_tensors="pt")
        dt = tok(list(d), padding=True, truncation=True, max_length=args.max_len, return_tensors="pt")
        return (qt["input_ids"], qt["attention_mask"]), (dt["input_ids"], dt["attention_mask"])

    train_ds, val_ds = Pairs(args.train), Pairs(args.val)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, collate_fn=collate,
                          num_workers=6, drop_last=True, pin_memory=True)
    val_dl = DataLoader(val_ds, batch_size=512, sampler=val_sampler, collate_fn=collate, num_workers=4,
                        drop_last=True)

    model = DDP(TwoTower(args.encoder).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * (world * args.bs / 2048) ** 0.5, weight_decay=0.01)
    total = len(train_dl) * args.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 500) * max(0.0, 1 - s / total))

    os.makedirs(args.out, exist_ok=True)
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for q, d in train_dl:
            q = tuple(t.to(device, non_blocking=True) for t in q)
            d = tuple(t.to(device, non_blocking=True) for t in d)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                qe, de = model(q, d)
            loss = contrastive_loss(qe.float(), de.float(), args.temp, rank, world)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if step % 50 == 0:
                wandb.log({"train/loss": loss.item(), "lr": sched.get_last_lr()[0], "epoch": epoch}, step=step)

        r10 = recall_at_k(model.module, val_dl, device, rank, world)
        wandb.log({"val/recall@10": r10, "epoch_time": time.time() - t0}, step=step)
        if rank == 0:
            print(f"epoch {epoch} step {step} recall@10 {r10:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "step": step},
                       os.path.join(args.out, f"epoch{epoch}.pt"))
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
