#!/usr/bin/env python
# ParticleNet-lite for the top-tagging reference dataset (Kasieczka et al., 1.2M/400k/400k jets).
# Input files are the converted h5 (see convert_toptag.py): per jet up to 100 constituents
# with (pt, eta, phi, E) ordered by pt, plus jet-level pt/eta/phi and the label.
#
#   torchrun --nproc_per_node=4 06_toptag_particlenet.py --data-dir /data/toptag/h5 --epochs 20
import argparse
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score, roc_curve
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset


def load_split(path, n_const=100):
    with h5py.File(path, "r") as f:
        p4 = f["constituents"][:, :n_const, :].astype(np.float32)  # pt, eta, phi, E
        jet = f["jet"][:].astype(np.float32)                        # pt, eta, phi, m
        label = f["label"][:].astype(np.int64)
    mask = p4[..., 0] > 0
    deta = p4[..., 1] - jet[:, None, 1]
    dphi = np.mod(p4[..., 2] - jet[:, None, 2] + np.pi, 2 * np.pi) - np.pi
    with np.errstate(divide="ignore"):
        log_pt = np.where(mask, np.log(p4[..., 0]), 0.0)
        log_e = np.where(mask, np.log(p4[..., 3]), 0.0)
        log_ptrel = np.where(mask, np.log(p4[..., 0] / jet[:, None, 0]), 0.0)
        log_erel = np.where(mask, np.log(p4[..., 3] / p4[..., 3].sum(1, keepdims=True)), 0.0)
    dr = np.hypot(deta, dphi)
    feats = np.stack([deta, dphi, log_pt, log_e, log_ptrel, log_erel, dr], axis=1)
    feats *= mask[:, None, :]
    points = np.stack([deta, dphi], axis=1) * mask[:, None, :]
    return (torch.from_numpy(points), torch.from_numpy(feats.astype(np.float32)),
            torch.from_numpy(mask[:, None, :].astype(np.float32)), torch.from_numpy(label))


def knn(x, k):
    inner = -2 * torch.matmul(x.transpose(2, 1), x)
    xx = torch.sum(x ** 2, dim=1, keepdim=True)
    pairwise = -xx - inner - xx.transpose(2, 1)
    return pairwise.topk(k=k + 1, dim=-1)[1][:, :, 1:]


def get_graph_feature(x, k, idx):
    b, c, n = x.shape
    base = torch.arange(0, b, device=x.device).view(-1, 1, 1) * n
    idx = (idx + base).view(-1)
    fts = x.transpose(2, 1).reshape(b * n, c)[idx].view(b, n, k, c).permute(0, 3, 1, 2)
    x = x.unsqueeze(-1).expand(-1, -1, -1, k)
    return torch.cat([x, fts - x], dim=1)


class EdgeConvBlock(nn.Module):
    def __init__(self, k, in_feat, out_feats):
        super().__init__()
        self.k = k
        layers, c = [], 2 * in_feat
        for o in out_feats:
            layers += [nn.Conv2d(c, o, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU()]
            c = o
        self.convs = nn.Sequential(*layers)
        self.sc = nn.Sequential(nn.Conv1d(in_feat, out_feats[-1], 1, bias=False),
                                nn.BatchNorm1d(out_feats[-1]))

    def forward(self, points, features):
        idx = knn(points, self.k)
        x = self.convs(get_graph_feature(features, self.k, idx)).mean(dim=-1)
        return F.relu(x + self.sc(features))


class ParticleNetLite(nn.Module):
    def __init__(self, in_dim=7, n_classes=2, k=7):
        super().__init__()
        self.bn_fts = nn.BatchNorm1d(in_dim)
        self.edge_convs = nn.ModuleList([EdgeConvBlock(k, in_dim, [32, 32, 32]),
                                         EdgeConvBlock(k, 32, [64, 64, 64])])
        self.fusion = nn.Sequential(nn.Conv1d(96, 128, 1, bias=False), nn.BatchNorm1d(128), nn.ReLU())
        self.fc = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, n_classes))

    def forward(self, points, features, mask):
        coord_shift = (mask == 0) * 1e9
        fts = self.bn_fts(features) * mask
        outs = []
        for i, conv in enumerate(self.edge_convs):
            pts = (points if i == 0 else fts) + coord_shift
            fts = conv(pts, fts) * mask
            outs.append(fts)
        x = self.fusion(torch.cat(outs, dim=1)) * mask
        x = x.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
        return self.fc(x)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", default="/data/toptag/h5")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=384)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--n-const", type=int, default=100)
    ap.add_argument("--save", default="models/particlenet_lite_toptag.pt")
    return ap.parse_args()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device(f"cuda:{local_rank}")

    train = TensorDataset(*load_split(os.path.join(args.data_dir, "train.h5"), args.n_const))
    val_full = load_split(os.path.join(args.data_dir, "val.h5"), args.n_const)
    val = TensorDataset(*[t[rank::world] for t in val_full])

    train_loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, num_workers=4,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val, batch_size=1024, shuffle=False, num_workers=2, pin_memory=True)

    model = ParticleNetLite().to(dev)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=len(train_loader))

    best_acc = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for step, (pts, fts, msk, y) in enumerate(train_loader):
            pts, fts, msk, y = (t.to(dev, non_blocking=True) for t in (pts, fts, msk, y))
            loss = F.cross_entropy(model(pts, fts, msk), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and step % 500 == 0:
                print(f"  ep {epoch} step {step}/{len(train_loader)} loss {loss.item():.4f}", flush=True)

        model.eval()
        tally = torch.zeros(3, device=dev)
        with torch.no_grad():
            for pts, fts, msk, y in val_loader:
                pts, fts, msk, y = (t.to(dev, non_blocking=True) for t in (pts, fts, msk, y))
                logits = model.module(pts, fts, msk)
                tally[0] += F.cross_entropy(logits, y, reduction="sum")
                tally[1] += (logits.argmax(1) == y).sum()
                tally[2] += y.numel()
        dist.all_reduce(tally)
        val_loss, val_acc = (tally[0] / tally[2]).item(), (tally[1] / tally[2]).item()
        if rank == 0:
            print(f"epoch {epoch} val_loss {val_loss:.4f} val_acc {val_acc:.4f} ({time.time() - t0:.0f}s)",
                  flush=True)
            if val_acc > best_acc:
                best_acc = val_acc
                os.makedirs(os.path.dirname(args.save), exist_ok=True)
                torch.save(model.module.state_dict(), args.save)
        dist.barrier()

    dist.destroy_process_group()

    # test-set ROC on rank 0 only, after the process group is gone
    if rank == 0:
        pts, fts, msk, y = load_split(os.path.join(args.data_dir, "test.h5"), args.n_const)
        net = ParticleNetLite().to(dev)
        net.load_state_dict(torch.load(args.save, map_location=dev))
        net.eval()
        scores = []
        with torch.no_grad():
            for i in range(0, len(y), 2048):
                s = slice(i, i + 2048)
                out = net(pts[s].to(dev), fts[s].to(dev), msk[s].to(dev))
                scores.append(torch.softmax(out, 1)[:, 1].cpu())
        scores = torch.cat(scores).numpy()
        fpr, tpr, _ = roc_curve(y.numpy(), scores)
        eps_b = fpr[np.searchsorted(tpr, 0.3)]
        print(f"TEST auc {roc_auc_score(y.numpy(), scores):.4f}  1/eps_B @ eps_S=0.3: {1.0 / eps_b:.0f}")


if __name__ == "__main__":
    main()
