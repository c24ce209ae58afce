# -*- coding: utf-8 -*-
"""
Rolling-mill stand sensors (roll force, torque, gap, strip tension) - multi-step
forecasting with a PatchTST encoder and a small exogenous-covariate branch.

launch:
    torchrun --standalone --nproc_per_node=4 11_rolling_mill_forecast.py \
        --data_root /gpfs/mill/stands --exp_name pst_mill_v2
"""
import argparse
import logging
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger(__name__)


def get_parser():
    parser = argparse.ArgumentParser("PatchTST rolling mill")
    parser.add_argument("--data_root", type=str, required=True)
    parser.add_argument("--exp_name", type=str, default="pst_mill")
    parser.add_argument("--output_root", type=str, default="./experiments")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--pred_len", type=int, default=64)
    parser.add_argument("--patch_len", type=int, default=16)
    parser.add_argument("--stride", type=int, default=8)
    parser.add_argument("--d_model", type=int, default=128)
    parser.add_argument("--n_heads", type=int, default=8)
    parser.add_argument("--e_layers", type=int, default=3)
    parser.add_argument("--dropout", type=float, default=0.15)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--train_epochs", type=int, default=30)
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--num_workers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=2023)
    return parser


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class MillDataset(Dataset):
    """targets: (T, C) stand sensors, covs: (T, K) setpoints known in advance."""

    def __init__(self, root, flag, seq_len, pred_len):
        z = np.load(os.path.join(root, f"{flag}.npz"))
        stats = np.load(os.path.join(root, "train_stats.npz"))  # per-sensor mean/std of train
        self.targets = ((z["targets"] - stats["mean"]) / stats["std"]).astype(np.float32)
        self.covs = ((z["covs"] - stats["cov_mean"]) / stats["cov_std"]).astype(np.float32)
        self.seq_len, self.pred_len = seq_len, pred_len

    def __len__(self):
        return len(self.targets) - self.seq_len - self.pred_len + 1

    def __getitem__(self, idx):
        e = idx + self.seq_len
        return (self.targets[idx:e], self.covs[e:e + self.pred_len],
                self.targets[e:e + self.pred_len])


class PatchEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.patch_len, self.stride = cfg.patch_len, cfg.stride
        num_patches = (cfg.seq_len - cfg.patch_len) // cfg.stride + 1
        self.value_embedding = nn.Linear(cfg.patch_len, cfg.d_model)
        self.position_embedding = nn.Parameter(torch.randn(1, num_patches, cfg.d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(cfg.d_model, cfg.n_heads, cfg.d_model * 4,
                                           cfg.dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, cfg.e_layers, norm=nn.LayerNorm(cfg.d_model))
        self.out_dim = num_patches * cfg.d_model

    def forward(self, x):  # (N, L)
        p = x.unfold(-1, self.patch_len, self.stride)
        return self.encoder(self.value_embedding(p) + self.position_embedding).flatten(1)


class MillForecaster(nn.Module):
    def __init__(self, cfg, n_targets, n_covs):
        super().__init__()
        self.pred_len = cfg.pred_len
        self.backbone = PatchEncoder(cfg)
        self.cov_mlp = nn.Sequential(nn.Linear(n_covs, 32), nn.GELU(), nn.Linear(32, 1))
        self.head = nn.Linear(self.backbone.out_dim, cfg.pred_len)

    def forward(self, x, covs):  # x (B, L, C), covs (B, H, K)
        B, L, C = x.shape
        means = x.mean(1, keepdim=True).detach()
        stdev = torch.sqrt(x.var(1, keepdim=True, unbiased=False) + 1e-5).detach()
        x = (x - means) / stdev
        h = self.backbone(x.permute(0, 2, 1).reshape(B * C, L))
        y = self.head(h).view(B, C, self.pred_len).permute(0, 2, 1)
        y = y + self.cov_mlp(covs)  # setpoint effect, shared over sensors
        return y * stdev + means


def evaluate(model, loader, device):
    model.eval()
    sse = torch.zeros(1, device=device, dtype=torch.float64)
    sae = torch.zeros(1, device=device, dtype=torch.float64)
    cnt = torch.zeros(1, device=device, dtype=torch.float64)
    with torch.no_grad():
        for x, c, y in loader:
            x, c, y = x.to(device), c.to(device), y.to(device)
            pred = model(x, c)
            sse += ((pred - y) ** 2).sum()
            sae += (pred - y).abs().sum()
            cnt += y.numel()
    for t in (sse, sae, cnt):
        dist.all_reduce(t)
    model.train()
    return (sse / cnt).item(), (sae / cnt).item()


def main():
    args = get_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    set_seed(args.seed)

    out_dir = os.path.join(args.output_root, args.exp_name)
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s",
                            handlers=[logging.StreamHandler(),
                                      logging.FileHandler(os.path.join(out_dir, "train.log"))])
    else:
        logging.basicConfig(level=logging.ERROR)

    train_set = MillDataset(args.data_root, "train", args.seq_len, args.pred_len)
    val_set = MillDataset(args.data_root, "val", args.seq_len, args.pred_len)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    val_sampler = DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False,
                                     drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size * 2, sampler=val_sampler,
                            num_workers=args.num_workers, pin_memory=True)

    model = MillForecaster(args, train_set.targets.shape[1], train_set.covs.shape[1]).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    lr = args.learning_rate * world_size
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, pct_start=0.2,
                                                    steps_per_epoch=len(train_loader),
                                                    epochs=args.train_epochs)
    criterion = nn.MSELoss()
    logger.info("world_size=%d train=%d val=%d lr=%.2e", world_size, len(train_set), len(val_set), lr)

    best_mse = float("inf")
    for epoch in range(args.train_epochs):
        train_sampler.set_epoch(epoch)
        epoch_time = time.time()
        loss_acc = torch.zeros(2, device=device)
        for i, (x, c, y) in enumerate(train_loader):
            x, c, y = x.to(device, non_blocking=True), c.to(device, non_blocking=True), \
                y.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = criterion(model(x, c), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            loss_acc += torch.stack([loss.detach(), torch.ones_like(loss)])
            if (i + 1) % 100 == 0:
                logger.info("\titers: %d, epoch: %d | loss: %.7f", i + 1, epoch + 1, loss.item())
        dist.all_reduce(loss_acc)

        vali_mse, vali_mae = evaluate(model, val_loader, device)
        logger.info("Epoch: %d cost time: %.1fs | Train Loss: %.7f Vali MSE: %.7f MAE: %.7f",
                    epoch + 1, time.time() - epoch_time, (loss_acc[0] / loss_acc[1]).item(),
                    vali_mse, vali_mae)
        if rank == 0 and vali_mse < best_mse:
            best_mse = vali_mse
            torch.save(model.module.state_dict(), os.path.join(out_dir, "checkpoint.pth"))
            logger.info("Validation MSE improved -> saved checkpoint")

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
