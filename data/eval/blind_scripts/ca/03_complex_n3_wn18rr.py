"""ComplEx-N3 with reciprocal relations (Lacroix et al., 2018), multi-GPU.

1-vs-all cross-entropy over every entity, N3 regulariser, Adagrad.

torchrun --nproc_per_node=4 03_complex_n3_wn18rr.py --config configs/wn18rr_complex.yaml
"""
import argparse
import json
import os
import pickle
from dataclasses import dataclass, asdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


@dataclass
class Config:
    data: str = "data/WN18RR"
    rank: int = 1000
    init_scale: float = 1e-3
    reg: float = 0.1
    lr: float = 0.1
    batch_size: int = 250
    epochs: int = 100
    eval_every: int = 5
    eval_batch: int = 500
    out_dir: str = "out/complex_wn18rr"
    seed: int = 0


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--override", nargs="*", default=[])
    a = ap.parse_args()
    cfg = Config()
    if a.config:
        with open(a.config) as f:
            for k, v in (yaml.safe_load(f) or {}).items():
                setattr(cfg, k, type(getattr(cfg, k))(v))
    for kv in a.override:
        k, v = kv.split("=", 1)
        setattr(cfg, k, type(getattr(cfg, k))(v))
    return cfg


class ComplEx(nn.Module):
    def __init__(self, n_ent, n_rel, rank, init_scale):
        super().__init__()
        self.rank = rank
        self.ent = nn.Embedding(n_ent, 2 * rank)
        self.rel = nn.Embedding(n_rel, 2 * rank)
        self.ent.weight.data *= init_scale
        self.rel.weight.data *= init_scale

    def forward(self, x):
        lhs = self.ent(x[:, 0])
        rel = self.rel(x[:, 1])
        rhs = self.ent(x[:, 2])
        lhs = lhs[:, :self.rank], lhs[:, self.rank:]
        rel = rel[:, :self.rank], rel[:, self.rank:]
        rhs = rhs[:, :self.rank], rhs[:, self.rank:]
        to_score = self.ent.weight
        to_score = to_score[:, :self.rank], to_score[:, self.rank:]
        q_re = lhs[0] * rel[0] - lhs[1] * rel[1]
        q_im = lhs[0] * rel[1] + lhs[1] * rel[0]
        scores = q_re @ to_score[0].t() + q_im @ to_score[1].t()
        factors = (
            torch.sqrt(lhs[0] ** 2 + lhs[1] ** 2),
            torch.sqrt(rel[0] ** 2 + rel[1] ** 2),
            torch.sqrt(rhs[0] ** 2 + rhs[1] ** 2),
        )
        return scores, factors


def n3(factors, weight):
    norm = 0
    for f in factors:
        norm = norm + weight * torch.sum(torch.abs(f) ** 3)
    return norm / factors[0].shape[0]


def read_ids(data_dir):
    # preprocessed with the kbc scripts: train/valid/test.pickle hold int64 [N, 3]
    splits = {}
    for s in ("train", "valid", "test"):
        with open(os.path.join(data_dir, s + ".pickle"), "rb") as f:
            splits[s] = pickle.load(f).astype(np.int64)
    with open(os.path.join(data_dir, "to_skip.pickle"), "rb") as f:
        to_skip = pickle.load(f)
    n_ent = int(max(splits[s][:, [0, 2]].max() for s in splits)) + 1
    n_rel = int(max(splits[s][:, 1].max() for s in splits)) + 1
    return splits, to_skip, n_ent, n_rel


def add_reciprocals(x, n_rel):
    inv = np.stack([x[:, 2], x[:, 1] + n_rel, x[:, 0]], axis=1)
    return np.concatenate([x, inv])


@torch.no_grad()
def evaluate(model, loader, to_skip, device):
    model.eval()
    rr_sum, h1, h3, h10, n = 0.0, 0, 0, 0, 0
    for (x,) in loader:
        x = x.to(device)
        scores, _ = model(x)
        tgt = scores.gather(1, x[:, 2:3])
        for i, (h, r, t) in enumerate(x.tolist()):
            skip = [e for e in to_skip[(h, r)] if e != t]
            if skip:
                scores[i, skip] = -1e6
        ranks = (scores > tgt).sum(1) + 1
        rr_sum += (1.0 / ranks.float()).sum().item()
        h1 += (ranks <= 1).sum().item()
        h3 += (ranks <= 3).sum().item()
        h10 += (ranks <= 10).sum().item()
        n += ranks.numel()
    model.train()
    return {"MRR": rr_sum / n, "hits@1": h1 / n, "hits@3": h3 / n, "hits@10": h10 / n}


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)

    splits, to_skip, n_ent, n_rel = read_ids(cfg.data)
    train = torch.from_numpy(add_reciprocals(splits["train"], n_rel))
    valid = torch.from_numpy(add_reciprocals(splits["valid"], n_rel))
    test = torch.from_numpy(add_reciprocals(splits["test"], n_rel))

    train_ds = TensorDataset(train)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=train_sampler,
                              num_workers=2, pin_memory=True)

    def eval_loader(t):
        ds = TensorDataset(t)
        return DataLoader(ds, batch_size=cfg.eval_batch,
                          sampler=DistributedSampler(ds, shuffle=False))

    valid_loader, test_loader = eval_loader(valid), eval_loader(test)

    model = ComplEx(n_ent, 2 * n_rel, cfg.rank, cfg.init_scale).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adagrad(ddp.parameters(), lr=cfg.lr)

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=2)

    best_mrr, history = -1.0, []
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        running, steps = 0.0, 0
        for (x,) in train_loader:
            x = x.to(device, non_blocking=True)
            scores, factors = ddp(x)
            l_fit = F.cross_entropy(scores, x[:, 2])
            l_reg = n3(factors, cfg.reg)
            loss = l_fit + l_reg
            opt.zero_grad()
            loss.backward()
            opt.step()
            running += l_fit.item()
            steps += 1
        if rank == 0:
            print(f"[epoch {epoch:03d}] fit loss {running / steps:.4f}", flush=True)

        if (epoch + 1) % cfg.eval_every == 0:
            metrics = evaluate(model, valid_loader, to_skip, device)
            history.append({"epoch": epoch, **metrics})
            if rank == 0:
                print(f"  valid: {metrics}", flush=True)
                if metrics["MRR"] > best_mrr:
                    best_mrr = metrics["MRR"]
                    torch.save(model.state_dict(), os.path.join(cfg.out_dir, "best.pt"))
            dist.barrier()

    state = torch.load(os.path.join(cfg.out_dir, "best.pt"), map_location=device)
    model.load_state_dict(state)
    test_metrics = evaluate(model, test_loader, to_skip, device)
    if rank == 0:
        print(f"test: {test_metrics}")
        with open(os.path.join(cfg.out_dir, "results.json"), "w") as f:
            json.dump({"valid_history": history, "test": test_metrics}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
