#!/usr/bin/env python
"""Extended TDNN x-vector with AM-softmax on precomputed Kaldi features.

Features are read from Kaldi ark files (kaldiio), 200-frame chunks, CMN per chunk.

Launch:
    torchrun --nproc_per_node=4 09_etdnn_amsoftmax.py --feats-scp data/vox2/feats.scp \
        --utt2spk data/vox2/utt2spk --exp exp/etdnn_am
"""
import argparse
import logging
import os
import random
import time

import kaldiio
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from local.score import compute_eer, read_trials


def get_args():
    parser = argparse.ArgumentParser(description="E-TDNN x-vector training")
    parser.add_argument("--feats-scp", required=True)
    parser.add_argument("--utt2spk", required=True)
    parser.add_argument("--eval-scp", default="data/vox1_test/feats.scp")
    parser.add_argument("--trials", default="data/vox1_test/trials")
    parser.add_argument("--exp", default="exp/etdnn_am")
    parser.add_argument("--chunk", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=128, help="per GPU")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--lr", type=float, default=0.2, help="for 4 GPUs")
    parser.add_argument("--margin", type=float, default=0.25)
    parser.add_argument("--scale", type=float, default=30.0)
    parser.add_argument("--resume", default="")
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


class TDNNLayer(nn.Module):
    def __init__(self, in_dim, out_dim, context, dilation=1):
        super().__init__()
        self.conv = nn.Conv1d(in_dim, out_dim, context, dilation=dilation, padding=dilation * (context // 2))
        self.bn = nn.BatchNorm1d(out_dim)

    def forward(self, x):
        return self.bn(F.relu(self.conv(x)))


class ETDNN(nn.Module):
    def __init__(self, feat_dim=30, hidden=512, emb_dim=512):
        super().__init__()
        self.frame = nn.Sequential(
            TDNNLayer(feat_dim, hidden, 5), TDNNLayer(hidden, hidden, 1),
            TDNNLayer(hidden, hidden, 3, 2), TDNNLayer(hidden, hidden, 1),
            TDNNLayer(hidden, hidden, 3, 3), TDNNLayer(hidden, hidden, 1),
            TDNNLayer(hidden, hidden, 3, 4), TDNNLayer(hidden, hidden, 1),
            TDNNLayer(hidden, 1500, 1))
        self.segment6 = nn.Linear(3000, emb_dim)
        self.bn6 = nn.BatchNorm1d(emb_dim)

    def forward(self, x):  # x: (B, T, F)
        h = self.frame(x.transpose(1, 2))
        stats = torch.cat([h.mean(-1), h.std(-1)], dim=1)
        return self.bn6(self.segment6(stats))


class AMSoftmax(nn.Module):
    def __init__(self, emb_dim, n_cls, margin, scale):
        super().__init__()
        self.W = nn.Parameter(torch.randn(emb_dim, n_cls) * 0.01)
        self.m, self.s = margin, scale

    def forward(self, x, y):
        cos = F.normalize(x, dim=1) @ F.normalize(self.W, dim=0)
        logits = self.s * (cos - self.m * F.one_hot(y, cos.size(1)))
        return F.cross_entropy(logits, y), (cos.argmax(1) == y).float().mean()


class XVectorNet(nn.Module):
    def __init__(self, feat_dim, n_spk, args):
        super().__init__()
        self.tdnn = ETDNN(feat_dim)
        self.am = AMSoftmax(512, n_spk, args.margin, args.scale)

    def forward(self, feats, y):
        return self.am(self.tdnn(feats), y)


class ChunkDataset(Dataset):
    def __init__(self, scp, utt2spk, chunk):
        self.feats = kaldiio.load_scp(scp)
        u2s = dict(l.split() for l in open(utt2spk))
        self.spk2id = {s: i for i, s in enumerate(sorted(set(u2s.values())))}
        self.utts = sorted(u for u in self.feats.keys() if u in u2s)
        self.labels = [self.spk2id[u2s[u]] for u in self.utts]
        self.chunk = chunk

    def __len__(self):
        return len(self.utts)

    def __getitem__(self, i):
        m = self.feats[self.utts[i]]
        if m.shape[0] < self.chunk:
            m = np.concatenate([m] * (self.chunk // m.shape[0] + 1))
        s = random.randint(0, m.shape[0] - self.chunk)
        x = m[s:s + self.chunk]
        x = x - x.mean(0, keepdims=True)
        return torch.from_numpy(x.astype(np.float32)), self.labels[i]


@torch.no_grad()
def evaluate(tdnn, args, device, rank, world):
    tdnn.eval()
    feats = kaldiio.load_scp(args.eval_scp)
    utts = sorted(feats.keys())
    local = {}
    for u in utts[rank::world]:
        m = feats[u]
        x = torch.from_numpy((m - m.mean(0, keepdims=True)).astype(np.float32)).unsqueeze(0).to(device)
        local[u] = F.normalize(tdnn(x), dim=1)[0].cpu()
    out = [None] * world
    dist.all_gather_object(out, local)
    if rank != 0:
        return None
    emb = {k: v for d in out for k, v in d.items()}
    trials = read_trials(args.trials)
    scores = [float(emb[e] @ emb[t]) for e, t, _ in trials]
    return compute_eer(scores, [lab for _, _, lab in trials])


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")

    train_set = ChunkDataset(args.feats_scp, args.utt2spk, args.chunk)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True)
    feat_dim = train_set[0][0].shape[1]

    net = XVectorNet(feat_dim, len(train_set.spk2id), args).to(device)
    net = DistributedDataParallel(net, device_ids=[args.local_rank], output_device=args.local_rank)
    lr = args.lr * world / 4
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[20, 30, 36], gamma=0.1)

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        net.module.load_state_dict(ckpt["net"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)
        logging.info("%d utts / %d speakers, world size %d", len(train_set), len(train_set.spk2id), world)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        net.train()
        t0 = time.time()
        agg = torch.zeros(3, device=device)
        for batch_idx, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss, acc = net(x, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            agg += torch.stack([loss.detach(), acc.detach(), torch.tensor(1.0, device=device)])
        scheduler.step()
        dist.all_reduce(agg)
        logging.info("epoch %d loss %.4f acc %.2f%% lr %.4f (%.0fs)", epoch, agg[0] / agg[2],
                     100 * agg[1] / agg[2], optimizer.param_groups[0]["lr"], time.time() - t0)

        if epoch % 5 == 4 or epoch == args.epochs - 1:
            eer = evaluate(net.module.tdnn, args, device, rank, world)
            if rank == 0:
                logging.info("epoch %d Vox1-O EER %.3f%%", epoch, eer)
        if rank == 0:
            torch.save({"net": net.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(args.exp, f"epoch_{epoch}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
