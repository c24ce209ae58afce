#!/usr/bin/env python3
# Two-tower candidate retrieval with mixed negative sampling (in-batch negatives from all GPUs
# plus uniformly sampled items), large item-id embedding table, step-based checkpoints.
#
#   torchrun --nnodes=1 --nproc_per_node=8 14_two_tower_mns_resume.py --config configs/video_retrieval.yaml
#   (restarts pick the newest checkpoint in ckpt_dir automatically)
import argparse
import glob
import logging
import os
import time

import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

log = logging.getLogger("two_tower")

DEFAULTS = dict(train_path=None, eval_path=None, ckpt_dir="ckpt", n_users=2_000_000, n_items=1_000_000,
                n_cats=3000, dim=128, hist_len=30, batch_size=4096, n_uniform_neg=8192, lr=2e-3,
                temperature=0.05, max_steps=200_000, ckpt_every=5000, eval_every=10000, num_workers=6)


class ParquetInteractions(Dataset):
    def __init__(self, path, hist_len):
        t = pq.read_table(path, columns=["user_id", "hist", "item_id", "item_cat"])
        self.user = torch.as_tensor(t.column("user_id").to_numpy(), dtype=torch.long)
        self.item = torch.as_tensor(t.column("item_id").to_numpy(), dtype=torch.long)
        self.cat = torch.as_tensor(t.column("item_cat").to_numpy(), dtype=torch.long)
        hist = t.column("hist").to_pylist()
        self.hist = torch.zeros(len(hist), hist_len, dtype=torch.long)
        for i, h in enumerate(hist):
            h = h[-hist_len:]
            if h:
                self.hist[i, : len(h)] = torch.as_tensor(h)

    def __len__(self):
        return len(self.user)

    def __getitem__(self, i):
        return self.user[i], self.hist[i], self.item[i], self.cat[i]


class TwoTower(nn.Module):
    def __init__(self, n_users, n_items, n_cats, dim):
        super().__init__()
        self.user_id = nn.Embedding(n_users, dim)
        self.item_id = nn.Embedding(n_items, dim)      # shared by the history encoder and the item tower
        self.item_cat = nn.Embedding(n_cats, dim)
        self.user_mlp = nn.Sequential(nn.Linear(2 * dim, 256), nn.GELU(), nn.Linear(256, dim))
        self.item_mlp = nn.Sequential(nn.Linear(2 * dim, 256), nn.GELU(), nn.Linear(256, dim))

    def user_tower(self, user, hist):
        mask = (hist > 0).unsqueeze(-1).float()
        h = (self.item_id(hist) * mask).sum(1) / mask.sum(1).clamp(min=1)
        return F.normalize(self.user_mlp(torch.cat([self.user_id(user), h], -1)), dim=-1)

    def item_tower(self, item, cat):
        return F.normalize(self.item_mlp(torch.cat([self.item_id(item), self.item_cat(cat)], -1)), dim=-1)

    def forward(self, user, hist, item, cat, neg_item, neg_cat):
        return self.user_tower(user, hist), self.item_tower(item, cat), self.item_tower(neg_item, neg_cat)


def gather_cat(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.detach())
    parts[dist.get_rank()] = t
    return torch.cat(parts)


def mns_loss(u, v, v_neg, temperature):
    all_v = torch.cat([gather_cat(v), v_neg])
    logits = u @ all_v.t() / temperature
    labels = torch.arange(u.size(0), device=u.device) + dist.get_rank() * u.size(0)
    return F.cross_entropy(logits, labels)


@torch.no_grad()
def evaluate(model, loader, device, item_cat_table, k=100, n_cand=200_000):
    """Recall@k of the next item against a fixed random candidate pool (same pool on every rank)."""
    net = model.module
    net.eval()
    g = torch.Generator(device="cpu").manual_seed(1234)
    cand = torch.randint(1, item_cat_table.numel(), (n_cand,), generator=g).to(device)
    cand_vec = net.item_tower(cand, item_cat_table[cand])
    hits = torch.zeros(2, device=device)
    for user, hist, item, cat in loader:
        user, hist, item, cat = user.to(device), hist.to(device), item.to(device), cat.to(device)
        u = net.user_tower(user, hist)
        pos = (u * net.item_tower(item, cat)).sum(-1, keepdim=True)
        rank_of_pos = (u @ cand_vec.t() > pos).sum(1)
        hits += torch.stack([(rank_of_pos < k).float().sum(), torch.tensor(float(user.size(0)), device=device)])
    dist.all_reduce(hits)
    net.train()
    return (hits[0] / hits[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = dict(DEFAULTS)
    with open(ap.parse_args().config) as f:
        cfg.update(yaml.safe_load(f) or {})

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")

    train_ds = ParquetInteractions(cfg["train_path"], cfg["hist_len"])
    eval_ds = ParquetInteractions(cfg["eval_path"], cfg["hist_len"])
    item_cat_table = torch.load(os.path.join(os.path.dirname(cfg["train_path"]), "item_cat.pt"),
                                map_location="cpu").to(device)
    per_gpu = cfg["batch_size"] // world
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=per_gpu, sampler=sampler, num_workers=cfg["num_workers"],
                        pin_memory=True, drop_last=True, persistent_workers=True)
    eval_loader = DataLoader(eval_ds, batch_size=4096, sampler=DistributedSampler(eval_ds, shuffle=False),
                             num_workers=2)

    model = TwoTower(cfg["n_users"], cfg["n_items"], cfg["n_cats"], cfg["dim"]).to(device)
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg["lr"])

    step = 0
    ckpts = sorted(glob.glob(os.path.join(cfg["ckpt_dir"], "step_*.pt")))
    if ckpts:
        state = torch.load(ckpts[-1])
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        log.info("resumed from %s (step %d)", ckpts[-1], step)
    os.makedirs(cfg["ckpt_dir"], exist_ok=True)

    epoch = step // len(loader)
    skip = step % len(loader)
    t0 = time.time()
    while step < cfg["max_steps"]:
        sampler.set_epoch(epoch)
        for i, (user, hist, item, cat) in enumerate(loader):
            if i < skip:
                continue
            user, hist = user.to(device, non_blocking=True), hist.to(device, non_blocking=True)
            item, cat = item.to(device, non_blocking=True), cat.to(device, non_blocking=True)
            # uniformly sampled items correct the popularity bias of the in-batch negatives
            neg_item = torch.randint(1, cfg["n_items"], (cfg["n_uniform_neg"] // world,), device=device)
            u, v, v_neg = model(user, hist, item, cat, neg_item, item_cat_table[neg_item])
            loss = mns_loss(u, v, v_neg, cfg["temperature"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1

            if step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                log.info("step %d epoch %d loss %.4f %.1f steps/s", step, epoch, l.item(), 100 / (time.time() - t0))
                t0 = time.time()
            if step % cfg["eval_every"] == 0:
                r = evaluate(model, eval_loader, device, item_cat_table)
                log.info("step %d recall@100 %.4f", step, r)
            if step % cfg["ckpt_every"] == 0 and rank == 0:
                path = os.path.join(cfg["ckpt_dir"], f"step_{step:08d}.pt")
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "step": step}, path + ".tmp")
                os.replace(path + ".tmp", path)
            if step >= cfg["max_steps"]:
                break
        skip = 0
        epoch += 1

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
