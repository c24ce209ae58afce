"""TransH with Bernoulli negative sampling ("bern" trick of Wang et al. 2014).

Config in YAML, multi-GPU via torchrun:

    torchrun --nproc_per_node=4 14_transh_bernoulli.py --config configs/transh_wn18rr.yaml
"""
import argparse
import logging
import os
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEFAULT_CFG = {
    "data_dir": "data/WN18RR",
    "output_dir": "outputs/transh_wn18rr",
    "dim": 200,
    "margin": 4.0,
    "C": 0.015625,             # soft-constraint weight
    "epsilon": 1e-3,
    "batch_size": 1200,
    "neg_ratio": 10,
    "lr": 5e-3,
    "epochs": 500,
    "eval_every": 50,
    "eval_batch_size": 32,
    "num_workers": 4,
}

logger = logging.getLogger("transh")


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", type=str, default=None)
    ns = ap.parse_args()
    cfg = dict(DEFAULT_CFG)
    if ns.config:
        with open(ns.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    return cfg


def read_kg(data_dir):
    def dict_file(name):
        with open(os.path.join(data_dir, name)) as f:
            return {k: int(v) for v, k in (line.strip().split("\t") for line in f)}

    e2id, r2id = dict_file("entities.dict"), dict_file("relations.dict")
    out = {}
    for split in ("train", "valid", "test"):
        with open(os.path.join(data_dir, f"{split}.txt")) as f:
            out[split] = np.array([[e2id[h], r2id[r], e2id[t]] for h, r, t in (l.strip().split("\t") for l in f)])
    return out, len(e2id), len(r2id)


def bernoulli_probs(train, num_rel):
    """P(corrupt head | r) = tph / (tph + hpt)."""
    tails_of, heads_of = defaultdict(set), defaultdict(set)
    for h, r, t in train.tolist():
        tails_of[(r, h)].add(t)
        heads_of[(r, t)].add(h)
    tph = np.zeros(num_rel)
    hpt = np.zeros(num_rel)
    cnt_h, cnt_t = np.zeros(num_rel), np.zeros(num_rel)
    for (r, _), ts in tails_of.items():
        tph[r] += len(ts)
        cnt_h[r] += 1
    for (r, _), hs in heads_of.items():
        hpt[r] += len(hs)
        cnt_t[r] += 1
    tph /= np.maximum(cnt_h, 1)
    hpt /= np.maximum(cnt_t, 1)
    return torch.tensor(tph / np.maximum(tph + hpt, 1e-9), dtype=torch.float)


class BernTrainSet(Dataset):
    def __init__(self, triples, num_ent, head_prob, neg_ratio):
        self.triples = torch.as_tensor(triples, dtype=torch.long)
        self.num_ent = num_ent
        self.head_prob = head_prob
        self.neg_ratio = neg_ratio

    def __len__(self):
        return len(self.triples)

    def __getitem__(self, i):
        pos = self.triples[i]
        neg = pos.repeat(self.neg_ratio, 1)
        corrupt_head = torch.rand(self.neg_ratio) < self.head_prob[pos[1]]
        rnd = torch.randint(0, self.num_ent, (self.neg_ratio,))
        neg[:, 0] = torch.where(corrupt_head, rnd, neg[:, 0])
        neg[:, 2] = torch.where(corrupt_head, neg[:, 2], rnd)
        return pos, neg


class TransH(nn.Module):
    def __init__(self, num_ent, num_rel, dim):
        super().__init__()
        self.ent = nn.Embedding(num_ent, dim)
        self.rel = nn.Embedding(num_rel, dim)      # translation d_r
        self.norm = nn.Embedding(num_rel, dim)     # hyperplane normal w_r
        for e in (self.ent, self.rel, self.norm):
            nn.init.xavier_uniform_(e.weight)

    @staticmethod
    def project(e, w):
        w = F.normalize(w, p=2, dim=-1)
        return e - (e * w).sum(-1, keepdim=True) * w

    def distance(self, h, r, t):
        w = self.norm(r)
        return torch.norm(self.project(self.ent(h), w) + self.rel(r) - self.project(self.ent(t), w), p=2, dim=-1)

    def forward(self, pos, neg):
        d_pos = self.distance(pos[:, 0], pos[:, 1], pos[:, 2])
        d_neg = self.distance(neg[..., 0], neg[..., 1], neg[..., 2])
        # soft constraints from the paper: ||e|| <= 1 and w_r . d_r / ||d_r|| <= eps
        ents = self.ent(torch.cat([pos[:, 0], pos[:, 2]]))
        ent_c = F.relu(ents.norm(dim=-1) ** 2 - 1).sum()
        w, d = F.normalize(self.norm(pos[:, 1]), dim=-1), self.rel(pos[:, 1])
        orth_c = F.relu((w * d).sum(-1) ** 2 / d.norm(dim=-1).clamp_min(1e-9) ** 2).sum()
        return d_pos, d_neg, ent_c, orth_c

    @torch.no_grad()
    def all_distances(self, h, r, t, predict):
        """Distances to every entity as head (predict='head') or tail (predict='tail')."""
        w = self.norm(r)
        proj_all = self.project(self.ent.weight.unsqueeze(0), w.unsqueeze(1))    # B x N x d
        if predict == "tail":
            q = self.project(self.ent(h), w) + self.rel(r)
            return (q.unsqueeze(1) - proj_all).norm(dim=-1)
        q = self.project(self.ent(t), w) - self.rel(r)
        return (proj_all - q.unsqueeze(1)).norm(dim=-1)


@torch.no_grad()
def evaluate(model, triples, filters, device, rank, world, bs):
    model.eval()
    part = torch.as_tensor(triples[rank::world])
    res = torch.zeros(5, dtype=torch.float64, device=device)   # rr, mr, h1, h10, n
    for i in range(0, len(part), bs):
        b = part[i:i + bs].to(device)
        for predict, gold_col in (("tail", 2), ("head", 0)):
            d = model.all_distances(b[:, 0], b[:, 1], b[:, 2], predict)
            gold = b[:, gold_col]
            gd = d.gather(1, gold[:, None])
            for j, (h, r, t) in enumerate(b.tolist()):
                known = filters[("t", h, r)] if predict == "tail" else filters[("h", r, t)]
                d[j, known] = float("inf")
            rk = 1 + (d < gd).sum(1).double()
            res += torch.stack([(1 / rk).sum(), rk.sum(), (rk <= 1).sum().double(), (rk <= 10).sum().double(),
                                torch.tensor(float(len(rk)), dtype=torch.float64, device=device)])
    dist.all_reduce(res)
    return {"MRR": (res[0] / res[4]).item(), "MR": (res[1] / res[4]).item(),
            "Hits@1": (res[2] / res[4]).item(), "Hits@10": (res[3] / res[4]).item()}


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s | %(levelname)s | %(message)s")

    data, n_ent, n_rel = read_kg(cfg["data_dir"])
    filters = defaultdict(list)
    for h, r, t in np.concatenate([data["train"], data["valid"], data["test"]]).tolist():
        filters[("t", h, r)].append(t)
        filters[("h", r, t)].append(h)

    train_set = BernTrainSet(data["train"], n_ent, bernoulli_probs(data["train"], n_rel), cfg["neg_ratio"])
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True)
    loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=sampler, num_workers=cfg["num_workers"],
                        pin_memory=True, drop_last=True, persistent_workers=True)

    torch.manual_seed(3)
    model = TransH(n_ent, n_rel, cfg["dim"]).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(ddp.parameters(), lr=cfg["lr"])
    if rank == 0:
        os.makedirs(cfg["output_dir"], exist_ok=True)
        with open(os.path.join(cfg["output_dir"], "config.yaml"), "w") as f:
            yaml.safe_dump(cfg, f)

    best = {"MRR": 0.0}
    for epoch in range(cfg["epochs"]):
        ddp.train()
        t0 = time.time()
        meter = torch.zeros(2, device=device)
        for pos, neg in loader:
            pos = pos.to(device, non_blocking=True)
            neg = neg.to(device, non_blocking=True)
            d_pos, d_neg, ent_c, orth_c = ddp(pos, neg)
            loss = F.relu(cfg["margin"] + d_pos.unsqueeze(1) - d_neg).mean()
            loss = loss + cfg["C"] * (ent_c + orth_c) / pos.size(0)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            meter += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(meter)
        logger.info("epoch %d loss %.4f (%.1fs)", epoch + 1, (meter[0] / meter[1]).item(), time.time() - t0)

        if (epoch + 1) % cfg["eval_every"] == 0:
            metrics = evaluate(model, data["valid"], filters, device, rank, world, cfg["eval_batch_size"])
            logger.info("valid: %s", metrics)
            if rank == 0 and metrics["MRR"] > best["MRR"]:
                best = dict(metrics, epoch=epoch + 1)
                torch.save({"model": model.state_dict(), "epoch": epoch + 1, "metrics": metrics},
                           os.path.join(cfg["output_dir"], "best.ckpt"))
            dist.barrier()

    state = torch.load(os.path.join(cfg["output_dir"], "best.ckpt"), map_location=device)
    model.load_state_dict(state["model"])
    metrics = evaluate(model, data["test"], filters, device, rank, world, cfg["eval_batch_size"])
    logger.info("test @ epoch %d: %s", state["epoch"], metrics)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
