"""iTransformer (variates as tokens) on PEMS traffic, long-horizon MSE training.

    torchrun --nproc_per_node=4 15_itransformer_traffic.py --data_path data/traffic.csv --pred_len 336
"""
import argparse
import logging
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser(description="iTransformer multi-GPU")
parser.add_argument("--data_path", type=str, default="data/traffic.csv")
parser.add_argument("--seq_len", type=int, default=96)
parser.add_argument("--pred_len", type=int, default=96)
parser.add_argument("--d_model", type=int, default=512)
parser.add_argument("--n_heads", type=int, default=8)
parser.add_argument("--e_layers", type=int, default=4)
parser.add_argument("--d_ff", type=int, default=512)
parser.add_argument("--dropout", type=float, default=0.1)
parser.add_argument("--batch_size", type=int, default=32)
parser.add_argument("--learning_rate", type=float, default=1e-3)
parser.add_argument("--train_epochs", type=int, default=10)
parser.add_argument("--num_workers", type=int, default=8)
parser.add_argument("--checkpoints", type=str, default="./checkpoints/itransformer_traffic")
parser.add_argument("--seed", type=int, default=2023)
parser.add_argument("--local_rank", type=int, default=0)


class TrafficData(Dataset):
    def __init__(self, path, flag, seq_len, pred_len):
        df = pd.read_csv(path)
        data = df[df.columns[1:]].values.astype(np.float32)
        n = len(data)
        n_train, n_test = int(n * 0.7), int(n * 0.2)
        n_val = n - n_train - n_test
        border1s = [0, n_train - seq_len, n - n_test - seq_len]
        border2s = [n_train, n_train + n_val, n]
        i = {"train": 0, "val": 1, "test": 2}[flag]
        mean, std = data[:n_train].mean(0), data[:n_train].std(0) + 1e-6
        self.data = ((data - mean) / std)[border1s[i]:border2s[i]]
        self.seq_len, self.pred_len = seq_len, pred_len

    def __len__(self):
        return len(self.data) - self.seq_len - self.pred_len + 1

    def __getitem__(self, i):
        return (self.data[i:i + self.seq_len],
                self.data[i + self.seq_len:i + self.seq_len + self.pred_len])


class ITransformer(nn.Module):
    def __init__(self, seq_len, pred_len, d_model, n_heads, e_layers, d_ff, dropout):
        super().__init__()
        self.embed = nn.Linear(seq_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, d_ff, dropout, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, e_layers, norm=nn.LayerNorm(d_model))
        self.project = nn.Linear(d_model, pred_len)

    def forward(self, x):  # x: (B, L, N)
        mean = x.mean(1, keepdim=True).detach()
        std = torch.sqrt(x.var(1, keepdim=True, unbiased=False) + 1e-5).detach()
        x = (x - mean) / std
        tokens = self.embed(x.permute(0, 2, 1))       # (B, N, d_model) one token per variate
        out = self.project(self.encoder(tokens)).permute(0, 2, 1)   # (B, pred_len, N)
        return out * std + mean


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def reduce_mean(t):
    t = t.clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    sums = torch.zeros(3, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        pred = model(x)
        sums[0] += ((pred - y) ** 2).sum()
        sums[1] += (pred - y).abs().sum()
        sums[2] += y.numel()
    dist.all_reduce(sums)
    model.train()
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def main():
    args = parser.parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    set_seed(args.seed)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s [%(levelname)s] %(message)s")

    train_set = TrafficData(args.data_path, "train", args.seq_len, args.pred_len)
    val_set = TrafficData(args.data_path, "val", args.seq_len, args.pred_len)
    test_set = TrafficData(args.data_path, "test", args.seq_len, args.pred_len)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    # --batch_size is the global batch of the reference single-GPU runs
    per_gpu_batch = max(1, args.batch_size // world_size)
    train_loader = DataLoader(train_set, batch_size=per_gpu_batch, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)

    def shard_loader(ds):
        idx = list(range(rank, len(ds), world_size))
        return DataLoader(torch.utils.data.Subset(ds, idx), batch_size=64, num_workers=4)

    val_loader, test_loader = shard_loader(val_set), shard_loader(test_set)

    n_vars = train_set.data.shape[1]
    model = ITransformer(args.seq_len, args.pred_len, args.d_model, args.n_heads, args.e_layers,
                         args.d_ff, args.dropout).to(device)
    model = DistributedDataParallel(model, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.learning_rate,
                                                    steps_per_epoch=len(train_loader),
                                                    epochs=args.train_epochs, pct_start=0.2)
    criterion = nn.MSELoss()
    logging.info("variates=%d train windows=%d world=%d", n_vars, len(train_set), world_size)

    if rank == 0:
        os.makedirs(args.checkpoints, exist_ok=True)
    best_path = os.path.join(args.checkpoints, "checkpoint.pth")
    best_val = float("inf")
    for epoch in range(args.train_epochs):
        train_sampler.set_epoch(epoch)
        epoch_time = time.time()
        train_loss = torch.zeros(1, device=device)
        for i, (batch_x, batch_y) in enumerate(train_loader):
            batch_x = batch_x.to(device, non_blocking=True)
            batch_y = batch_y.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = criterion(model(batch_x), batch_y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            train_loss += loss.detach()
            if (i + 1) % 200 == 0:
                logging.info("\titers: %d, epoch: %d | loss: %.7f", i + 1, epoch + 1, loss.item())
        train_loss = reduce_mean(train_loss / len(train_loader)).item()
        vali_mse, vali_mae = evaluate(model, val_loader, device)
        logging.info("Epoch: %d cost time: %.1fs | Train Loss: %.7f Vali Loss: %.7f (mae %.7f)",
                     epoch + 1, time.time() - epoch_time, train_loss, vali_mse, vali_mae)
        if vali_mse < best_val:
            best_val = vali_mse
            if rank == 0:
                torch.save(model.module.state_dict(), best_path)
        dist.barrier()

    model.module.load_state_dict(torch.load(best_path, map_location=device))
    test_mse, test_mae = evaluate(model, test_loader, device)
    logging.info("test mse: %.4f, mae: %.4f", test_mse, test_mae)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
