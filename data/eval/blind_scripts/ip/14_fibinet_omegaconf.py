"""FiBiNET CTR model (SENET field re-weighting + bilinear interaction).

Config: conf/fibinet.yaml, overridable from the command line, e.g.
    torchrun --standalone --nproc_per_node=8 14_fibinet_omegaconf.py train.lr=5e-4 data.days=14
"""
import os
import sys
import time
from datetime import date, timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset
from torch.utils.tensorboard import SummaryWriter

DEFAULT_CONF = """
data:
  root: /nas/ctr/hashed_v3
  last_day: 2024-05-31
  days: 7
  num_fields: 30
  hash_size: 150000
model:
  emb_dim: 16
  reduction: 3
  hidden: [400, 400, 400]
train:
  batch_size: 2048
  lr: 1.0e-3
  epochs: 1
  log_every: 200
out_dir: /nas/ctr/runs/fibinet
"""


class HashedDay(Dataset):
    def __init__(self, path, hash_size):
        z = np.load(path)
        self.x = torch.from_numpy(z["x"].astype(np.int64) % hash_size)
        self.y = torch.from_numpy(z["y"].astype(np.float32))

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class SENet(nn.Module):
    def __init__(self, num_fields, reduction):
        super().__init__()
        r = max(1, num_fields // reduction)
        self.fc = nn.Sequential(nn.Linear(num_fields, r), nn.ReLU(), nn.Linear(r, num_fields), nn.ReLU())

    def forward(self, e):                                   # e: B, F, D
        w = self.fc(e.mean(-1))
        return e * w.unsqueeze(-1)


class Bilinear(nn.Module):
    """Field-all bilinear: one shared W."""

    def __init__(self, dim, num_fields):
        super().__init__()
        self.W = nn.Linear(dim, dim, bias=False)
        i, j = torch.triu_indices(num_fields, num_fields, 1)
        self.register_buffer("i", i, persistent=False)
        self.register_buffer("j", j, persistent=False)

    def forward(self, e):
        return self.W(e[:, self.i]) * e[:, self.j]          # B, F(F-1)/2, D


class FiBiNET(nn.Module):
    def __init__(self, num_fields, hash_size, emb_dim, reduction, hidden):
        super().__init__()
        self.num_fields = num_fields
        self.emb = nn.Embedding(num_fields * hash_size, emb_dim)
        nn.init.normal_(self.emb.weight, std=1e-4)
        self.register_buffer("offset", torch.arange(num_fields) * hash_size, persistent=False)
        self.linear = nn.Embedding(num_fields * hash_size, 1)
        nn.init.zeros_(self.linear.weight)
        self.senet = SENet(num_fields, reduction)
        self.bi_p = Bilinear(emb_dim, num_fields)
        self.bi_q = Bilinear(emb_dim, num_fields)
        d = num_fields * (num_fields - 1) * emb_dim
        layers = []
        for h in hidden:
            layers += [nn.Linear(d, h), nn.ReLU()]
            d = h
        self.dnn = nn.Sequential(*layers, nn.Linear(d, 1))

    def forward(self, x):
        idx = x + self.offset
        e = self.emb(idx)
        p = self.bi_p(e)
        q = self.bi_q(self.senet(e))
        deep = self.dnn(torch.cat([p.flatten(1), q.flatten(1)], 1)).squeeze(1)
        return deep + self.linear(idx).sum((1, 2))


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    probs, labels = [], []
    for x, y in loader:
        probs.append(torch.sigmoid(net(x.to(device, non_blocking=True))))
        labels.append(y.to(device, non_blocking=True))
    p, y = torch.cat(probs), torch.cat(labels)
    world = dist.get_world_size()
    ps = [torch.empty_like(p) for _ in range(world)]
    ys = [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(ps, p)
    dist.all_gather(ys, y)
    p, y = torch.cat(ps).double(), torch.cat(ys).double()
    net.train()
    logloss = F.binary_cross_entropy(p.clamp(1e-7, 1 - 1e-7), y).item()
    order = p.argsort()
    r = torch.empty_like(p)
    r[order] = torch.arange(1, p.numel() + 1, device=p.device, dtype=p.dtype)
    npos = y.sum()
    auc = ((r * y).sum() - npos * (npos + 1) / 2) / (npos * (y.numel() - npos))
    return logloss, auc.item()


def main():
    cfg = OmegaConf.merge(OmegaConf.create(DEFAULT_CONF), OmegaConf.from_cli(sys.argv[1:]))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    last = date.fromisoformat(str(cfg.data.last_day))
    train_days = [last - timedelta(days=k) for k in range(cfg.data.days, 0, -1)]
    train_ds = ConcatDataset([HashedDay(os.path.join(cfg.data.root, f"{d:%Y%m%d}.npz"), cfg.data.hash_size)
                              for d in train_days])
    eval_ds = HashedDay(os.path.join(cfg.data.root, f"{last:%Y%m%d}.npz"), cfg.data.hash_size)
    per = len(eval_ds) // world
    eval_shard = Subset(eval_ds, range(rank * per, (rank + 1) * per))

    train_loader = DataLoader(train_ds, batch_size=cfg.train.batch_size, shuffle=True,
                              num_workers=8, pin_memory=True, drop_last=True)
    eval_loader = DataLoader(eval_shard, batch_size=8192, num_workers=4, pin_memory=True)

    torch.manual_seed(0)
    net = FiBiNET(cfg.data.num_fields, cfg.data.hash_size, cfg.model.emb_dim, cfg.model.reduction,
                  list(cfg.model.hidden)).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg.train.lr)

    writer = None
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        OmegaConf.save(cfg, os.path.join(cfg.out_dir, "config.yaml"))
        writer = SummaryWriter(os.path.join(cfg.out_dir, "tb"))

    step = 0
    for epoch in range(cfg.train.epochs):
        t0 = time.time()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step % cfg.train.log_every == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if writer is not None:
                    writer.add_scalar("train/loss", l.item(), step)
                    writer.add_scalar("train/throughput",
                                      cfg.train.log_every * cfg.train.batch_size * world / (time.time() - t0),
                                      step)
                t0 = time.time()

        logloss, auc = evaluate(model.module, eval_loader, device)
        if rank == 0:
            print(f"epoch {epoch} step {step}: eval logloss {logloss:.5f} auc {auc:.5f}", flush=True)
            writer.add_scalar("eval/logloss", logloss, step)
            writer.add_scalar("eval/auc", auc, step)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "step": step},
                       os.path.join(cfg.out_dir, f"fibinet_ep{epoch}.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
