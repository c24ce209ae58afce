"""Multi-level order-flow-imbalance (MLOFI) model for 1-second mid-price changes
on a basket of liquid US equities. Trained as a pooled model across tickers.

    torchrun --nproc_per_node=8 19_order_flow_imbalance.py --data /mnt/nfs/ofi/2023 --resume
"""
import argparse
import glob
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("mlofi")

LEVELS = 10


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True, help="folder of <ticker>_<date>.npz files")
    parser.add_argument("--lags", type=int, default=30, help="seconds of OFI history")
    parser.add_argument("--val-dates", nargs="+", default=["20231213", "20231214", "20231215"])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--ckpt-dir", default="/mnt/nfs/ofi/checkpoints")
    parser.add_argument("--resume", action="store_true")
    return parser.parse_args()


class OFIDay(Dataset):
    """One ticker-day: ofi (S, LEVELS) per-second order flow imbalance by level, dmid (S,) in ticks."""

    def __init__(self, path, lags):
        z = np.load(path)
        ofi = z["ofi"].astype(np.float32)
        depth = z["avg_depth"].astype(np.float32)  # (LEVELS,) average depth that day, used for scaling
        self.ofi = torch.from_numpy(ofi / (depth[None, :] + 1.0))
        self.dmid = torch.from_numpy(z["dmid"].astype(np.float32))
        self.lags = lags

    def __len__(self):
        return len(self.dmid) - self.lags

    def __getitem__(self, i):
        t = i + self.lags
        return self.ofi[t - self.lags + 1 : t + 1], self.dmid[t]


class MLOFINet(nn.Module):
    def __init__(self, lags, hidden):
        super().__init__()
        self.level_mix = nn.Linear(LEVELS, 16)
        self.mlp = nn.Sequential(
            nn.Flatten(), nn.Linear(lags * 16, hidden), nn.GELU(), nn.Dropout(0.1),
            nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 1),
        )

    def forward(self, x):
        return self.mlp(self.level_mix(x)).squeeze(-1)


def save_checkpoint(path, model, optimizer, scheduler, epoch, best):
    torch.save({
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "epoch": epoch,
        "best_r2": best,
    }, path)


def r2_score(loader, model, device):
    model.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            p = model(x)
            acc += torch.stack([((y - p) ** 2).sum(), (y ** 2).sum(), y.sum()]).double()
    dist.all_reduce(acc)
    return 1.0 - (acc[0] / acc[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s | %(levelname)s | %(message)s")

    files = sorted(glob.glob(os.path.join(args.data, "*.npz")))
    is_val = lambda f: os.path.basename(f).split("_")[-1][:8] in args.val_dates
    train_ds = ConcatDataset([OFIDay(f, args.lags) for f in files if not is_val(f)])
    val_ds = ConcatDataset([OFIDay(f, args.lags) for f in files if is_val(f)])
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, 8192, sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True),
                            num_workers=4, pin_memory=True)

    model = DDP(MLOFINet(args.lags, args.hidden).to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[10, 15], gamma=0.2)

    os.makedirs(args.ckpt_dir, exist_ok=True)
    last_path = os.path.join(args.ckpt_dir, "last.pt")
    start_epoch, best = 0, -float("inf")
    if args.resume and os.path.exists(last_path):
        ckpt = torch.load(last_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best_r2"]
        logger.info("resumed at epoch %d (best R2 %.4f)", start_epoch, best)
    logger.info("%d train / %d val seconds across %d files", len(train_ds), len(val_ds), len(files))

    loss_fn = nn.HuberLoss(delta=2.0)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if step % 1000 == 0:
                logger.info("epoch %d step %d/%d loss %.4f", epoch, step, len(train_loader), loss.item())
        scheduler.step()

        val_r2 = r2_score(val_loader, model, device)
        best = max(best, val_r2)
        logger.info("epoch %d val R2 %.4f best %.4f (%.0fs)", epoch, val_r2, best, time.time() - t0)
        save_checkpoint(last_path, model, optimizer, scheduler, epoch, best)
        if val_r2 >= best and rank == 0:
            save_checkpoint(os.path.join(args.ckpt_dir, "best.pt"), model, optimizer, scheduler, epoch, best)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
