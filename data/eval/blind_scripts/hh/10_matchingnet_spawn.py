#!/usr/bin/env python3
"""Matching Networks (Vinyals et al. 2016) with full-context embeddings, Omniglot 20-way.

Launched with torch.multiprocessing in the style of the PyTorch ImageNet example:
one process per GPU, --nodes/--node-rank for multi-node runs.

    python 10_matchingnet_spawn.py --data /data/omniglot_84 --dist-url tcp://127.0.0.1:29511
"""
import argparse
import os
import random
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset


def parse_args():
    parser = argparse.ArgumentParser(description="Matching Networks (DDP)")
    parser.add_argument("--data", default="/data/omniglot_84", help="folder with train.npy / test.npy [C,20,28,28]")
    parser.add_argument("--save-dir", default="checkpoints/matchingnet")
    parser.add_argument("--way", type=int, default=20)
    parser.add_argument("--shot", type=int, default=1)
    parser.add_argument("--query", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--episodes-per-epoch", type=int, default=500)
    parser.add_argument("--eval-episodes", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--fce", action="store_true", help="use full-context embeddings (bi-LSTM + attention LSTM)")
    parser.add_argument("--lstm-steps", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=10)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--dist-url", default="tcp://127.0.0.1:29511")
    parser.add_argument("--dist-backend", default="nccl")
    return parser.parse_args()


class OmniglotEpisodes(Dataset):
    """Every item is one episode: (support [W*K,1,28,28], query [W*Q,1,28,28])."""

    def __init__(self, path, n_episodes, way, shot, query, seed):
        self.chars = torch.from_numpy(np.load(path)).float().unsqueeze(2) / 255.0  # [C, 20, 1, 28, 28]
        self.n_episodes, self.way, self.shot, self.query = n_episodes, way, shot, query
        self.seed = seed

    def __len__(self):
        return self.n_episodes

    def __getitem__(self, i):
        rng = np.random.default_rng(self.seed + i)
        classes = rng.choice(self.chars.size(0), self.way, replace=False)
        rot = rng.integers(0, 4, size=self.way)
        sup, qry = [], []
        for c, k in zip(classes, rot):
            idx = rng.choice(self.chars.size(1), self.shot + self.query, replace=False)
            imgs = torch.rot90(self.chars[c, idx], int(k), dims=(2, 3))
            sup.append(imgs[: self.shot])
            qry.append(imgs[self.shot:])
        return torch.cat(sup), torch.cat(qry)


class Encoder(nn.Module):
    def __init__(self, hid=64):
        super().__init__()
        layers, cin = [], 1
        for _ in range(4):
            layers += [nn.Conv2d(cin, hid, 3, padding=1), nn.BatchNorm2d(hid), nn.ReLU(), nn.MaxPool2d(2)]
            cin = hid
        self.net = nn.Sequential(*layers)
        self.out_dim = hid

    def forward(self, x):
        return self.net(x).flatten(1)


class AttentionLSTM(nn.Module):
    def __init__(self, dim, steps):
        super().__init__()
        self.cell = nn.LSTMCell(dim, dim)
        self.steps = steps

    def forward(self, q, support):
        h, c = q, torch.zeros_like(q)
        for _ in range(self.steps):
            attn = F.softmax(h @ support.t(), dim=1)
            r = attn @ support
            h, c = self.cell(q, (h + r, c))
            h = h + q
        return h


class MatchingNet(nn.Module):
    def __init__(self, fce, lstm_steps):
        super().__init__()
        self.encoder = Encoder()
        d = self.encoder.out_dim
        self.fce = fce
        if fce:
            self.g = nn.LSTM(d, d // 2, batch_first=True, bidirectional=True)
            self.f = AttentionLSTM(d, lstm_steps)

    def forward(self, support, query, way, shot):
        s = self.encoder(support)
        q = self.encoder(query)
        if self.fce:
            s = s + self.g(s.unsqueeze(0))[0].squeeze(0)
            q = self.f(q, s)
        sim = F.normalize(q, dim=1) @ F.normalize(s, dim=1).t()  # cosine attention
        attn = F.softmax(sim * 10.0, dim=1)
        one_hot = F.one_hot(torch.arange(way, device=s.device).repeat_interleave(shot), way).float()
        return torch.log(attn @ one_hot + 1e-8)


def run(model, loader, args, device, optimizer=None):
    train = optimizer is not None
    model.train(train)
    y = torch.arange(args.way, device=device).repeat_interleave(args.query)
    stat = torch.zeros(3, device=device)
    with torch.set_grad_enabled(train):
        for sup, qry in loader:
            sup = sup.squeeze(0).to(device, non_blocking=True)
            qry = qry.squeeze(0).to(device, non_blocking=True)
            logp = model(sup, qry, args.way, args.shot)
            loss = F.nll_loss(logp, y)
            if train:
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            stat += torch.stack([loss.detach(), (logp.argmax(1) == y).float().mean(), torch.ones_like(loss)])
    dist.all_reduce(stat)
    return (stat[0] / stat[2]).item(), (stat[1] / stat[2]).item()


def main_worker(gpu, args, ngpus_per_node):
    rank = args.node_rank * ngpus_per_node + gpu
    world_size = args.nodes * ngpus_per_node
    torch.cuda.set_device(gpu)
    dist.init_process_group(backend=args.dist_backend, init_method=args.dist_url,
                            world_size=world_size, rank=rank)
    device = torch.device("cuda", gpu)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    model = MatchingNet(args.fce, args.lstm_steps).to(device)
    model = DDP(model, device_ids=[gpu])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    # episodes are indexed, so each rank gets a disjoint block of seeds
    per_rank = args.episodes_per_epoch // world_size
    eval_ds = OmniglotEpisodes(os.path.join(args.data, "test.npy"), args.eval_episodes // world_size,
                               args.way, args.shot, args.query, seed=10 ** 8 + rank * 10 ** 6)
    eval_loader = DataLoader(eval_ds, batch_size=1, num_workers=args.workers, pin_memory=True)

    best = 0.0
    for epoch in range(args.epochs):
        train_ds = OmniglotEpisodes(os.path.join(args.data, "train.npy"), per_rank, args.way, args.shot,
                                    args.query, seed=(epoch * world_size + rank) * 10 ** 5 + args.seed)
        train_loader = DataLoader(train_ds, batch_size=1, shuffle=False, num_workers=args.workers,
                                  pin_memory=True)
        t0 = time.time()
        tl, ta = run(model, train_loader, args, device, optimizer)
        vl, va = run(model, eval_loader, args, device)
        if rank == 0:
            print(f"[{epoch:03d}] train {tl:.4f}/{ta:.4f}  test {vl:.4f}/{va:.4f}  {time.time() - t0:.1f}s",
                  flush=True)
            state = {"epoch": epoch + 1, "state_dict": model.module.state_dict(),
                     "optimizer": optimizer.state_dict(), "acc": va}
            path = os.path.join(args.save_dir, "checkpoint.pth.tar")
            torch.save(state, path)
            if va > best:
                best = va
                shutil.copyfile(path, os.path.join(args.save_dir, "model_best.pth.tar"))

    dist.destroy_process_group()


def main():
    args = parse_args()
    os.makedirs(args.save_dir, exist_ok=True)
    ngpus_per_node = torch.cuda.device_count()
    mp.spawn(main_worker, nprocs=ngpus_per_node, args=(ngpus_per_node, args))


if __name__ == "__main__":
    main()
