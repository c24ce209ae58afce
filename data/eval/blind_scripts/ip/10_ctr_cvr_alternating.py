"""Shared-bottom CTR/CVR model trained on two log streams.

Impression logs (label = click) and post-click conversion logs (label = purchase within
7 days) come from different tables with very different sizes, so the two tasks are
trained on alternating batches: `--cvr_every` controls how often a CVR batch is taken.

    torchrun --nproc_per_node=8 10_ctr_cvr_alternating.py --config configs/shared_bottom.json
"""
import argparse
import itertools
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEFAULTS = {
    "impressions": "/data/rec/impressions/20240610_20240616.npz",
    "conversions": "/data/rec/conversions/20240610_20240616.npz",
    "eval_impressions": "/data/rec/impressions/20240617.npz",
    "eval_conversions": "/data/rec/conversions/20240617.npz",
    "field_sizes": [1000000, 500000, 200000, 50000, 20000, 10000, 5000, 2000, 1000, 500,
                    200, 100, 50, 24, 7, 3],
    "emb_dim": 32,
    "shared": [512, 256],
    "tower": [128, 64],
    "batch_size": 2048,
    "lr": 1e-3,
    "cvr_every": 4,
    "steps": 60000,
    "eval_every": 10000,
    "out_dir": "/data/rec/ckpt/shared_bottom",
}


class LogTable(Dataset):
    def __init__(self, path, field_sizes):
        z = np.load(path)
        self.ids = z["ids"] % np.asarray(field_sizes, dtype=np.int64)
        self.label = z["label"].astype(np.float32)

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        return torch.from_numpy(self.ids[i]), torch.tensor(self.label[i])


class SharedBottom(nn.Module):
    def __init__(self, field_sizes, emb_dim, shared, tower):
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(n, emb_dim) for n in field_sizes)
        d = len(field_sizes) * emb_dim
        layers = []
        for h in shared:
            layers += [nn.Linear(d, h), nn.ReLU()]
            d = h
        self.bottom = nn.Sequential(*layers)

        def make_tower():
            t, dd = [], d
            for h in tower:
                t += [nn.Linear(dd, h), nn.ReLU()]
                dd = h
            return nn.Sequential(*t, nn.Linear(dd, 1))

        self.ctr_head = make_tower()
        self.cvr_head = make_tower()

    def forward(self, ids):
        x = torch.cat([e(ids[:, i]) for i, e in enumerate(self.embs)], 1)
        h = self.bottom(x)
        return self.ctr_head(h).squeeze(1), self.cvr_head(h).squeeze(1)


def infinite(loader, sampler):
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        for batch in loader:
            yield batch


def make_loader(ds, batch_size, seed, workers=4):
    sampler = DistributedSampler(ds, shuffle=True, seed=seed, drop_last=True)
    loader = DataLoader(ds, batch_size=batch_size, sampler=sampler, num_workers=workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    return loader, sampler


@torch.no_grad()
def eval_task(net, ds, task, device, rank, world, bins=4096):
    net.eval()
    hist = torch.zeros(2, bins, device=device, dtype=torch.float64)
    sub = torch.utils.data.Subset(ds, range(rank, len(ds), world))
    for ids, y in DataLoader(sub, batch_size=16384, num_workers=2):
        ctr_logit, cvr_logit = net(ids.to(device))
        p = torch.sigmoid(ctr_logit if task == "ctr" else cvr_logit)
        b = (p * bins).long().clamp(max=bins - 1)
        y = y.to(device).double()
        hist[0] += torch.bincount(b, weights=y, minlength=bins)
        hist[1] += torch.bincount(b, weights=1 - y, minlength=bins)
    dist.all_reduce(hist)
    net.train()
    pos, neg = hist
    return ((pos * (neg.cumsum(0) - neg / 2)).sum() / (pos.sum() * neg.sum())).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    cfg = dict(DEFAULTS)
    cli = ap.parse_args()
    if cli.config:
        with open(cli.config) as f:
            cfg.update(json.load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    imp = LogTable(cfg["impressions"], cfg["field_sizes"])
    conv = LogTable(cfg["conversions"], cfg["field_sizes"])
    imp_loader, imp_sampler = make_loader(imp, cfg["batch_size"], seed=0)
    conv_loader, conv_sampler = make_loader(conv, cfg["batch_size"], seed=1)
    imp_iter = infinite(imp_loader, imp_sampler)
    conv_iter = infinite(conv_loader, conv_sampler)
    eval_imp = LogTable(cfg["eval_impressions"], cfg["field_sizes"])
    eval_conv = LogTable(cfg["eval_conversions"], cfg["field_sizes"])

    torch.manual_seed(0)
    net = SharedBottom(cfg["field_sizes"], cfg["emb_dim"], cfg["shared"], cfg["tower"]).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)

    t0 = time.time()
    ema = {"ctr": None, "cvr": None}
    for step in range(1, cfg["steps"] + 1):
        task = "cvr" if step % cfg["cvr_every"] == 0 else "ctr"
        ids, y = next(conv_iter if task == "cvr" else imp_iter)
        ids = ids.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        ctr_logit, cvr_logit = model(ids)
        logit = cvr_logit if task == "cvr" else ctr_logit
        loss = F.binary_cross_entropy_with_logits(logit, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

        lv = loss.item()
        ema[task] = lv if ema[task] is None else 0.99 * ema[task] + 0.01 * lv
        if rank == 0 and step % 500 == 0:
            print(f"step {step} ctr_loss {ema['ctr']:.4f} cvr_loss {ema['cvr'] or float('nan'):.4f} "
                  f"{500 / (time.time() - t0):.1f} it/s", flush=True)
            t0 = time.time()

        if step % cfg["eval_every"] == 0 or step == cfg["steps"]:
            ctr_auc = eval_task(model.module, eval_imp, "ctr", device, rank, world)
            cvr_auc = eval_task(model.module, eval_conv, "cvr", device, rank, world)
            if rank == 0:
                print(f"[eval] step {step} ctr_auc {ctr_auc:.5f} cvr_auc {cvr_auc:.5f}", flush=True)
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                            "step": step, "cfg": cfg},
                           os.path.join(cfg["out_dir"], f"step{step}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
