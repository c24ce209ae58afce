"""InfoGCN-style training (attention GCN + latent MMD prior) on NTU-60.

loss = CE(y_hat, y) + lambda_1 * MMD(class means of z, class priors) + lambda_2 * ||mean z||
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.linalg as LA
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

INWARD = [(1, 2), (2, 21), (3, 21), (4, 3), (5, 21), (6, 5), (7, 6), (8, 7), (9, 21), (10, 9),
          (11, 10), (12, 11), (13, 1), (14, 13), (15, 14), (16, 15), (17, 1), (18, 17),
          (19, 18), (20, 19), (22, 23), (23, 8), (24, 25), (25, 12)]


def get_mmd_loss(z, z_prior, y, num_cls):
    y_valid = [i_cls in y for i_cls in range(num_cls)]
    z_mean = torch.stack([z[y == i_cls].mean(dim=0) if (y == i_cls).any() else torch.zeros_like(z[0])
                          for i_cls in range(num_cls)], dim=0)
    l2_z_mean = LA.norm(z.mean(dim=0), ord=2)
    mmd_loss = F.mse_loss(z_mean[y_valid], z_prior[y_valid].to(z.device))
    return mmd_loss, l2_z_mean


class Feeder(Dataset):
    def __init__(self, data_path, split, window_size=64, p_interval=(0.5, 1.0), vel=False):
        npz = np.load(data_path)
        x = npz[f"x_{split}"]
        self.label = np.where(npz[f"y_{split}"] > 0)[1]
        n, t, _ = x.shape
        self.data = x.reshape((n, t, 2, 25, 3)).transpose(0, 4, 1, 3, 2)
        self.window_size, self.p_interval, self.vel = window_size, p_interval, vel
        self.train = split == "train"

    def __len__(self):
        return len(self.label)

    def __getitem__(self, index):
        data = self.data[index]
        valid = max(int((data.sum(0).sum(-1).sum(-1) != 0).sum()), 1)
        if self.train:
            p = np.random.uniform(*self.p_interval)
            length = max(min(int(valid * p), valid), 8) if valid >= 8 else valid
            bias = np.random.randint(0, valid - length + 1)
        else:
            length, bias = valid, 0
        idx = np.linspace(bias, bias + length - 1, self.window_size).round().astype(np.int64)
        data = np.ascontiguousarray(data[:, idx]).astype(np.float32)
        if self.vel:
            data[:, :-1] = data[:, 1:] - data[:, :-1]
            data[:, -1] = 0
        return torch.from_numpy(data), int(self.label[index])


def graph_A():
    A = np.eye(25, dtype=np.float32)
    for i, j in INWARD:
        A[i - 1, j - 1] = A[j - 1, i - 1] = 1
    return A / A.sum(0, keepdims=True)


class SAGC(nn.Module):
    """Self-attention graph conv: learned attention on top of the skeleton prior."""

    def __init__(self, cin, cout, A, heads=3):
        super().__init__()
        self.heads = heads
        inter = cout // 4
        self.register_buffer("A", torch.from_numpy(A))
        self.qk = nn.Conv2d(cin, 2 * inter * heads, 1)
        self.v = nn.ModuleList([nn.Conv2d(cin, cout, 1) for _ in range(heads)])
        self.alpha = nn.Parameter(torch.zeros(1))
        self.bn = nn.BatchNorm2d(cout)
        self.down = nn.Identity() if cin == cout else nn.Sequential(nn.Conv2d(cin, cout, 1), nn.BatchNorm2d(cout))

    def forward(self, x):
        n, c, t, v = x.shape
        q, k = self.qk(x).mean(2).view(n, self.heads, 2, -1, v).unbind(2)
        att = torch.tanh(torch.einsum("nhcu,nhcv->nhuv", q, k) / math.sqrt(q.shape[2]))
        out = 0
        for h in range(self.heads):
            adj = self.A.unsqueeze(0) + self.alpha * att[:, h]
            out = out + torch.einsum("nctu,nuv->nctv", self.v[h](x), adj)
        return F.relu(self.bn(out) + self.down(x))


class EncodingBlock(nn.Module):
    def __init__(self, cin, cout, A, stride=1):
        super().__init__()
        self.gcn = SAGC(cin, cout, A)
        self.tcn = nn.Sequential(nn.Conv2d(cout, cout, (5, 1), (stride, 1), (2, 0)), nn.BatchNorm2d(cout))
        self.res = (nn.Identity() if cin == cout and stride == 1
                    else nn.Sequential(nn.Conv2d(cin, cout, 1, (stride, 1)), nn.BatchNorm2d(cout)))

    def forward(self, x):
        return F.relu(self.tcn(self.gcn(x)) + self.res(x))


class InfoGCN(nn.Module):
    def __init__(self, num_class=60, num_point=25, num_person=2, base_channel=64, n_z=256, noise_ratio=0.1):
        super().__init__()
        A = graph_A()
        self.num_class = num_class
        self.data_bn = nn.BatchNorm1d(num_person * base_channel * num_point)
        self.to_joint_embedding = nn.Linear(3, base_channel)
        self.pos_embedding = nn.Parameter(torch.randn(1, num_point, base_channel))
        b = base_channel
        self.layers = nn.Sequential(
            EncodingBlock(b, b, A), EncodingBlock(b, b, A), EncodingBlock(b, b, A),
            EncodingBlock(b, 2 * b, A, 2), EncodingBlock(2 * b, 2 * b, A), EncodingBlock(2 * b, 2 * b, A),
            EncodingBlock(2 * b, 4 * b, A, 2), EncodingBlock(4 * b, 4 * b, A), EncodingBlock(4 * b, 4 * b, A))
        self.fc = nn.Linear(4 * b, 4 * b)
        self.fc_mu = nn.Linear(4 * b, n_z)
        self.fc_logvar = nn.Linear(4 * b, n_z)
        self.decoder = nn.Linear(n_z, num_class)
        self.noise_ratio = noise_ratio
        self.z_prior = torch.empty(num_class, n_z)
        nn.init.orthogonal_(self.z_prior, gain=3)
        nn.init.xavier_uniform_(self.fc_mu.weight)
        nn.init.normal_(self.decoder.weight, 0, math.sqrt(2.0 / num_class))

    def latent_sample(self, mu, logvar):
        if self.training:
            std = logvar.mul(0.5).exp().clamp(max=100)
            return torch.randn_like(std) * self.noise_ratio * std + mu
        return mu

    def forward(self, x):
        n, c, t, v, m = x.shape
        x = x.permute(0, 4, 2, 3, 1).reshape(n * m * t, v, c)
        x = self.to_joint_embedding(x) + self.pos_embedding
        x = x.view(n, m, t, v, -1).permute(0, 1, 3, 4, 2).reshape(n, -1, t)
        x = self.data_bn(x).view(n, m, v, -1, t).permute(0, 1, 3, 4, 2).reshape(n * m, -1, t, v)
        x = self.layers(x)
        x = x.view(n, m, x.size(1), -1).mean(3).mean(1)
        x = F.relu(self.fc(x))
        z = self.latent_sample(self.fc_mu(x), self.fc_logvar(x))
        return self.decoder(z), z


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/ntu/NTU60_CS.npz")
    ap.add_argument("--work-dir", default="results/infogcn_ntu60_xsub_j")
    ap.add_argument("--batch-size", type=int, default=32, help="per GPU")
    ap.add_argument("--base-lr", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=110)
    ap.add_argument("--lambda-1", type=float, default=1e-4)
    ap.add_argument("--lambda-2", type=float, default=1e-1)
    ap.add_argument("--use-vel", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1)

    train_set = Feeder(args.data, "train", vel=args.use_vel)
    test_set = Feeder(args.data, "test", vel=args.use_vel)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=8, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=128, shuffle=False, num_workers=8, pin_memory=True)

    model = InfoGCN(num_class=60).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    lr = args.base_lr * args.batch_size * world / 64
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    warm = 5 * len(train_loader)
    total = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        agg = torch.zeros(3, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            y_hat, z = model(x)
            mmd_loss, l2_z_mean = get_mmd_loss(z, model.z_prior, y, 60)
            cls_loss = F.cross_entropy(y_hat, y)
            loss = cls_loss + args.lambda_2 * mmd_loss + args.lambda_1 * l2_z_mean
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            agg += torch.stack([cls_loss.detach(), mmd_loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(agg)

        if rank == 0:
            net = model.module
            net.eval()
            c1 = c5 = tot = 0
            with torch.no_grad():
                for x, y in test_loader:
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                    y_hat, _ = net(x)
                    top5 = y_hat.topk(5, 1).indices
                    c1 += (top5[:, 0] == y).sum().item()
                    c5 += (top5 == y[:, None]).any(1).sum().item()
                    tot += y.numel()
            top1 = c1 / tot
            print(f"epoch {epoch + 1} cls {(agg[0] / agg[2]).item():.4f} mmd {(agg[1] / agg[2]).item():.5f} "
                  f"top1 {top1:.4f} top5 {c5 / tot:.4f} {time.time() - tic:.0f}s", flush=True)
            torch.save(net.state_dict(), os.path.join(args.work_dir, "last.pt"))
            if top1 > best:
                best = top1
                torch.save(net.state_dict(), os.path.join(args.work_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
