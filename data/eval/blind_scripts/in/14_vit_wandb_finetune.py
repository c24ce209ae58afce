"""Fine-tune a pretrained ERA5 ViT forecaster on 2018-2021 with a 6-step rollout loss.
Scores are lat-weighted RMSE on 2022 (00 UTC inits), tracked in Weights & Biases.

    torchrun --nproc_per_node=8 14_vit_wandb_finetune.py --init ckpts/vit_base_pretrain.pt --run-name ft_r6
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
import zarr
from timm.models.vision_transformer import Block
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

HEADLINE = {"z500": 11, "t850": 28, "u850": 41, "t2m": 67}


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--zarr", default="/mnt/era5/era5_1.40625deg_6h.zarr")
    p.add_argument("--init", required=True)
    p.add_argument("--run-name", required=True)
    p.add_argument("--ckpt-dir", default="/mnt/era5/checkpoints")
    p.add_argument("--rollout", type=int, default=6)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-6)
    p.add_argument("--max-steps", type=int, default=6000)
    p.add_argument("--eval-interval", type=int, default=500)
    p.add_argument("--num-workers", type=int, default=6)
    return p.parse_args()


class ZarrRollout(Dataset):
    def __init__(self, store, start_year, end_year, rollout, only_00utc=False):
        root = zarr.open(store, mode="r")
        years = root["time_year"][:]
        hours = root["time_hour"][:]
        ok = (years >= start_year) & (years <= end_year)
        if only_00utc:
            ok &= hours == 0
        idx = np.nonzero(ok)[0]
        self.starts = idx[idx + rollout < len(years)]
        self.store, self.rollout = store, rollout
        self.mean = root["mean"][:].astype(np.float32)[:, None, None]
        self.std = root["std"][:].astype(np.float32)[:, None, None]
        self.data = None

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        if self.data is None:
            self.data = zarr.open(self.store, mode="r")["data"]
        t = int(self.starts[i])
        seq = (self.data[t:t + self.rollout + 1].astype(np.float32) - self.mean) / self.std
        return torch.from_numpy(seq)


class ViTForecaster(nn.Module):
    def __init__(self, ch=69, img=(128, 256), patch=4, dim=768, depth=12, heads=12):
        super().__init__()
        self.ch, self.p = ch, patch
        self.gh, self.gw = img[0] // patch, img[1] // patch
        self.embed = nn.Conv2d(ch, dim, patch, patch)
        self.pos = nn.Parameter(torch.zeros(1, self.gh * self.gw, dim))
        self.blocks = nn.Sequential(*[Block(dim, heads, mlp_ratio=4.0, qkv_bias=True) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, ch * patch * patch)

    def forward(self, x):
        B = x.shape[0]
        h = self.embed(x).flatten(2).transpose(1, 2) + self.pos
        h = self.head(self.norm(self.blocks(h)))
        h = h.view(B, self.gh, self.gw, self.ch, self.p, self.p).permute(0, 3, 1, 4, 2, 5)
        return x + h.reshape(B, self.ch, self.gh * self.p, self.gw * self.p)


def lat_weights(n, device):
    lat = (torch.arange(n, device=device) + 0.5) * 180.0 / n - 90.0
    w = torch.cos(torch.deg2rad(lat))
    return (w / w.mean()).view(1, 1, n, 1)


@torch.no_grad()
def evaluate(net, loader, w, std, rollout, device):
    net.eval()
    sums = torch.zeros(rollout, len(HEADLINE), dtype=torch.float64, device=device)
    n = torch.zeros((), dtype=torch.float64, device=device)
    idx = list(HEADLINE.values())
    for seq in loader:
        seq = seq.to(device, non_blocking=True)
        x = seq[:, 0]
        for k in range(rollout):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                x = net(x).float()
            r = ((((x - seq[:, k + 1]) * std) ** 2) * w).mean(dim=(-2, -1)).sqrt()
            sums[k] += r[:, idx].sum(0).double()
        n += seq.shape[0]
    dist.all_reduce(sums)
    dist.all_reduce(n)
    net.train()
    return (sums / n).cpu()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    run = wandb.init(project="era5-vit-finetune", name=args.run_name, config=vars(args))

    train_ds = ZarrRollout(args.zarr, 2018, 2021, args.rollout)
    val_full = ZarrRollout(args.zarr, 2022, 2022, args.rollout, only_00utc=True)
    val_ds = Subset(val_full, list(range(rank, len(val_full), world)))
    per_gpu = args.global_batch // world
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, per_gpu, sampler=sampler, num_workers=args.num_workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, per_gpu, num_workers=args.num_workers, pin_memory=True)

    net = ViTForecaster()
    state = torch.load(args.init, map_location="cpu")
    net.load_state_dict(state["model"])
    net.to(device)
    model = DDP(net, device_ids=[local_rank])

    decay = [p for n, p in net.named_parameters() if p.ndim >= 2 and "pos" not in n]
    no_decay = [p for n, p in net.named_parameters() if p.ndim < 2 or "pos" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 200) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.max_steps))))
    w = lat_weights(128, device)
    std = torch.from_numpy(train_ds.std).to(device).unsqueeze(0)
    out_dir = os.path.join(args.ckpt_dir, args.run_name)
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)

    step, epoch, best = 0, 0, float("inf")
    t0 = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for seq in train_dl:
            seq = seq.to(device, non_blocking=True)
            x, loss = seq[:, 0], 0.0
            with torch.autocast("cuda", dtype=torch.bfloat16):
                for k in range(args.rollout):
                    x = model(x)
                    loss = loss + ((x.float() - seq[:, k + 1]) ** 2 * w).mean()
            loss = loss / args.rollout
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1

            if step % 20 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                wandb.log({"train/loss": l.item(), "train/grad_norm": gnorm.item(),
                           "train/lr": sched.get_last_lr()[0],
                           "train/sec_per_step": (time.time() - t0) / 20}, step=step)
                t0 = time.time()

            if step % args.eval_interval == 0 or step == args.max_steps:
                rmse = evaluate(net, val_dl, w, std, args.rollout, device)
                wandb.log({f"val/{name}_{6 * (k + 1)}h": rmse[k, j].item()
                           for k in range(args.rollout) for j, name in enumerate(HEADLINE)}, step=step)
                z500_last = rmse[-1, 0].item()
                if rank == 0:
                    torch.save({"model": net.state_dict(), "step": step}, os.path.join(out_dir, "last.pt"))
                    if z500_last < best:
                        torch.save({"model": net.state_dict(), "step": step}, os.path.join(out_dir, "best.pt"))
                best = min(best, z500_last)
                dist.barrier()
            if step >= args.max_steps:
                break
        epoch += 1

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
