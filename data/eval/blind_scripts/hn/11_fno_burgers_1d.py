"""1D FNO for viscous Burgers (nu = 0.1), mapping u(x, 0) -> u(x, 1).

Adapted from the single-GPU fourier_1d.py reference script for multi-GPU training.

    torchrun --standalone --nproc_per_node=4 11_fno_burgers_1d.py --data data/burgers_data_R10.mat
"""
import argparse
import os
from timeit import default_timer

import numpy as np
import scipy.io
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

torch.manual_seed(0)
np.random.seed(0)
device = torch.device("cuda:0")


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="data/burgers_data_R10.mat")
    parser.add_argument("--ntrain", type=int, default=1000)
    parser.add_argument("--ntest", type=int, default=100)
    parser.add_argument("--sub", type=int, default=2 ** 3)
    parser.add_argument("--batch_size", type=int, default=20)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=500)
    parser.add_argument("--modes", type=int, default=16)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--save_path", default="model/fno1d_burgers.pt")
    return parser.parse_args()


class UnitGaussianNormalizer(object):
    def __init__(self, x, eps=0.00001):
        self.mean = torch.mean(x, 0)
        self.std = torch.std(x, 0)
        self.eps = eps

    def encode(self, x):
        return (x - self.mean) / (self.std + self.eps)

    def decode(self, x):
        return (x * (self.std + self.eps)) + self.mean

    def to(self, dev):
        self.mean = self.mean.to(dev)
        self.std = self.std.to(dev)
        return self


class LpLoss(object):
    def __init__(self, p=2, size_average=True):
        self.p = p
        self.size_average = size_average

    def __call__(self, x, y):
        n = x.size(0)
        diff = torch.norm(x.reshape(n, -1) - y.reshape(n, -1), self.p, 1)
        ynorm = torch.norm(y.reshape(n, -1), self.p, 1)
        return torch.mean(diff / ynorm) if self.size_average else torch.sum(diff / ynorm)


class SpectralConv1d(nn.Module):
    def __init__(self, in_channels, out_channels, modes1):
        super().__init__()
        self.modes1 = modes1
        self.scale = 1 / (in_channels * out_channels)
        self.weights1 = nn.Parameter(self.scale * torch.rand(in_channels, out_channels, modes1, dtype=torch.cfloat))

    def forward(self, x):
        batchsize = x.shape[0]
        x_ft = torch.fft.rfft(x)
        out_ft = torch.zeros(batchsize, self.weights1.shape[1], x.size(-1) // 2 + 1, device=x.device, dtype=torch.cfloat)
        out_ft[:, :, :self.modes1] = torch.einsum("bix,iox->box", x_ft[:, :, :self.modes1], self.weights1)
        return torch.fft.irfft(out_ft, n=x.size(-1))


class FNO1d(nn.Module):
    def __init__(self, modes, width):
        super().__init__()
        self.modes1 = modes
        self.width = width
        self.padding = 2
        self.fc0 = nn.Linear(2, self.width)
        self.conv0 = SpectralConv1d(self.width, self.width, self.modes1)
        self.conv1 = SpectralConv1d(self.width, self.width, self.modes1)
        self.conv2 = SpectralConv1d(self.width, self.width, self.modes1)
        self.conv3 = SpectralConv1d(self.width, self.width, self.modes1)
        self.w0 = nn.Conv1d(self.width, self.width, 1)
        self.w1 = nn.Conv1d(self.width, self.width, 1)
        self.w2 = nn.Conv1d(self.width, self.width, 1)
        self.w3 = nn.Conv1d(self.width, self.width, 1)
        self.fc1 = nn.Linear(self.width, 128)
        self.fc2 = nn.Linear(128, 1)

    def get_grid(self, shape, dev):
        batchsize, size_x = shape[0], shape[1]
        gridx = torch.tensor(np.linspace(0, 1, size_x), dtype=torch.float)
        gridx = gridx.reshape(1, size_x, 1).repeat([batchsize, 1, 1])
        return gridx.to(dev)

    def forward(self, x):
        grid = self.get_grid(x.shape, x.device)
        x = torch.cat((x, grid), dim=-1)
        x = self.fc0(x)
        x = x.permute(0, 2, 1)
        x = F.pad(x, [0, self.padding])
        x = F.gelu(self.conv0(x) + self.w0(x))
        x = F.gelu(self.conv1(x) + self.w1(x))
        x = F.gelu(self.conv2(x) + self.w2(x))
        x = self.conv3(x) + self.w3(x)
        x = x[..., :-self.padding]
        x = x.permute(0, 2, 1)
        x = self.fc2(F.gelu(self.fc1(x)))
        return x


def main():
    args = get_args()
    dist.init_process_group(backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    rank = dist.get_rank()
    torch.cuda.set_device(local_rank)

    # ---------------- data ----------------
    data = scipy.io.loadmat(args.data)
    x_data = torch.from_numpy(data["a"].astype(np.float32))[:, ::args.sub]
    y_data = torch.from_numpy(data["u"].astype(np.float32))[:, ::args.sub]
    s = x_data.shape[1]
    x_train, y_train = x_data[:args.ntrain], y_data[:args.ntrain]
    x_test, y_test = x_data[-args.ntest:], y_data[-args.ntest:]

    x_normalizer = UnitGaussianNormalizer(x_train)
    x_train = x_normalizer.encode(x_train).reshape(args.ntrain, s, 1)
    x_test = x_normalizer.encode(x_test).reshape(args.ntest, s, 1)
    y_normalizer = UnitGaussianNormalizer(y_train)
    y_train = y_normalizer.encode(y_train)
    y_normalizer.to(device)

    train_set = TensorDataset(x_train, y_train)
    test_set = TensorDataset(x_test, y_test)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    test_sampler = DistributedSampler(test_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, pin_memory=True)
    test_loader = DataLoader(test_set, batch_size=args.batch_size, sampler=test_sampler)

    # ---------------- model ----------------
    model = FNO1d(args.modes, args.width).to(local_rank)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))
    myloss = LpLoss(size_average=False)

    for ep in range(args.epochs):
        train_sampler.set_epoch(ep)
        model.train()
        t1 = default_timer()
        train_l2 = torch.zeros(2, device=local_rank)
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            out = model(x).reshape(x.shape[0], s)
            out = y_normalizer.decode(out)
            y = y_normalizer.decode(y)
            loss = myloss(out, y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            train_l2[0] += loss.item()
            train_l2[1] += x.shape[0]

        model.eval()
        test_l2 = torch.zeros(2, device=local_rank)
        with torch.no_grad():
            for x, y in test_loader:
                x, y = x.to(device), y.to(device)
                out = y_normalizer.decode(model(x).reshape(x.shape[0], s))
                test_l2[0] += myloss(out, y).item()
                test_l2[1] += x.shape[0]

        dist.all_reduce(train_l2)
        dist.all_reduce(test_l2)
        t2 = default_timer()
        if rank == 0:
            print(ep, t2 - t1, (train_l2[0] / train_l2[1]).item(), (test_l2[0] / test_l2[1]).item(), flush=True)

    if rank == 0:
        os.makedirs(os.path.dirname(args.save_path) or ".", exist_ok=True)
        torch.save(model.module.state_dict(), args.save_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
