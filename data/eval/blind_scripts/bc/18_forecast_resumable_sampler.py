"""Store-level demand forecasting (seq2seq Transformer over daily sales windows).

Runs on the preemptible partition; the checkpoint records the position inside the epoch so a
requeued job continues with the next unseen batch instead of replaying the epoch.

    #SBATCH --nodes=1 --gpus-per-node=8 --requeue --signal=B:TERM@120
    torchrun --standalone --nproc-per-node=8 --max-restarts=3 train_forecast.py --config conf/m5.yaml
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import wandb
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that can skip the first `start_index` samples of an epoch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.start_index = 0

    def __iter__(self):
        indices = list(super().__iter__())
        return iter(indices[self.start_index:])

    def __len__(self):
        return self.num_samples - self.start_index


class SalesWindows(Dataset):
    def __init__(self, npz_path, ctx, horizon):
        z = np.load(npz_path)
        self.sales = z["sales"].astype(np.float32)  # [series, days]
        self.covs = z["covariates"].astype(np.float32)  # [days, n_cov]
        self.scale = self.sales.mean(1, keepdims=True) + 1.0
        self.ctx, self.h = ctx, horizon
        n_starts = self.sales.shape[1] - ctx - horizon + 1
        self.index = [(s, t) for s in range(self.sales.shape[0]) for t in range(0, n_starts, 7)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        s, t = self.index[i]
        y = self.sales[s, t:t + self.ctx + self.h] / self.scale[s]
        c = self.covs[t:t + self.ctx + self.h]
        return torch.from_numpy(y[:self.ctx]), torch.from_numpy(c), torch.from_numpy(y[self.ctx:])


class Forecaster(nn.Module):
    def __init__(self, n_cov, d, heads, layers, horizon):
        super().__init__()
        self.horizon = horizon
        self.in_proj = nn.Linear(1 + n_cov, d)
        self.dec_proj = nn.Linear(n_cov, d)
        self.tf = nn.Transformer(d, heads, layers, layers, 4 * d, dropout=0.1, batch_first=True)
        self.out = nn.Linear(d, 1)

    def forward(self, y_ctx, covs):
        ctx = y_ctx.size(1)
        enc_in = self.in_proj(torch.cat([y_ctx.unsqueeze(-1), covs[:, :ctx]], -1))
        dec_in = self.dec_proj(covs[:, ctx:])
        return self.out(self.tf(enc_in, dec_in)).squeeze(-1)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    for y_ctx, covs, y_fut in loader:
        y_ctx, covs, y_fut = y_ctx.to(device), covs.to(device), y_fut.to(device)
        pred = net(y_ctx, covs)
        acc[0] += (pred - y_fut).abs().sum()
        acc[1] += y_fut.abs().sum()
        acc[2] += ((pred - y_fut) ** 2).sum()
    dist.all_reduce(acc)
    net.train()
    n = len(loader.dataset.dataset) * net.horizon
    return {"wape": (acc[0] / acc[1]).item(), "rmse": math.sqrt(acc[2].item() / n)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])

    train_ds = SalesWindows(cfg["train_npz"], cfg["context"], cfg["horizon"])
    val_ds = SalesWindows(cfg["val_npz"], cfg["context"], cfg["horizon"])
    sampler = ResumableDistributedSampler(train_ds, shuffle=True, seed=cfg["seed"], drop_last=True)
    bs = cfg["batch_size"]
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=1024, num_workers=2)

    net = Forecaster(train_ds.covs.shape[1], cfg["d_model"], cfg["heads"], cfg["layers"], cfg["horizon"]).to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["wd"])
    steps_per_epoch = sampler.num_samples // bs
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=cfg["lr"], pct_start=0.1,
                                                    total_steps=cfg["epochs"] * steps_per_epoch)

    ckpt_path = os.path.join(cfg["run_dir"], "resume.pt")
    epoch, step, wandb_id = 0, 0, None
    if os.path.exists(ckpt_path):
        state = torch.load(ckpt_path)
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        epoch, step, wandb_id = state["epoch"], state["step"], state["wandb_id"]
        sampler.start_index = state["samples_into_epoch"]
        del state
        torch.cuda.empty_cache()

    if rank == 0:
        os.makedirs(cfg["run_dir"], exist_ok=True)
        wandb_id = wandb_id or wandb.util.generate_id()
        wandb.init(project=cfg["wandb_project"], id=wandb_id, resume="allow", config=cfg)

    def save(epoch, samples_into_epoch):
        if rank == 0:
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "step": step,
                        "samples_into_epoch": samples_into_epoch, "wandb_id": wandb_id}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    loss_fn = nn.HuberLoss(delta=1.0)
    while epoch < cfg["epochs"]:
        sampler.set_epoch(epoch)
        loader = DataLoader(train_ds, batch_size=bs, sampler=sampler, num_workers=6,
                            pin_memory=True, drop_last=True)
        seen = sampler.start_index
        t0 = time.time()
        for y_ctx, covs, y_fut in loader:
            y_ctx, covs, y_fut = (x.to(device, non_blocking=True) for x in (y_ctx, covs, y_fut))
            loss = loss_fn(model(y_ctx, covs), y_fut)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            scheduler.step()
            step += 1
            seen += bs
            if step % 200 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"train/huber": l.item(), "lr": scheduler.get_last_lr()[0],
                               "windows_per_s": 200 * bs * world / (time.time() - t0)}, step=step)
                    t0 = time.time()
            if step % cfg["ckpt_every"] == 0:
                save(epoch, seen)

        sampler.start_index = 0
        metrics = evaluate(net, val_loader, device)
        if rank == 0:
            wandb.log({f"val/{k}": v for k, v in metrics.items()} | {"epoch": epoch}, step=step)
        epoch += 1
        save(epoch, 0)

    if rank == 0:
        torch.save(net.state_dict(), os.path.join(cfg["run_dir"], "final.pt"))
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
