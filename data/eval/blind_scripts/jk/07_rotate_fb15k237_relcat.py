"""RotatE on FB15k-237 with per-relation-category (1-1 / 1-N / N-1 / N-N) filtered metrics.

    torchrun --nproc_per_node=4 07_rotate_fb15k237_relcat.py --config configs/rotate_fb15k237.json
"""
import argparse
import json
import math
import os
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

DEFAULTS = dict(data="data/FB15k-237", out="out/rotate_fb15k237", dim=1000, gamma=9.0, adv_temp=1.0,
                neg=256, batch=256, lr=5e-5, steps=100000, eval_every=10000, log_every=1000,
                eval_batch=16, seed=0)


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    for k, v in DEFAULTS.items():
        ap.add_argument(f"--{k}", type=type(v), default=None)
    ns = ap.parse_args()
    cfg = dict(DEFAULTS)
    if ns.config:
        with open(ns.config) as f:
            cfg.update(json.load(f))
    cfg.update({k: v for k, v in vars(ns).items() if v is not None and k != "config"})
    return argparse.Namespace(**cfg)


def read_ids(path):
    with open(path) as f:
        return {name: int(i) for i, name in (l.rstrip("\n").split("\t") for l in f)}


def read_split(path, e2id, r2id):
    with open(path) as f:
        return torch.tensor([[e2id[h], r2id[r], e2id[t]] for h, r, t in (l.rstrip("\n").split("\t") for l in f)])


def relation_categories(train, n_rel):
    """Bordes et al. 2013: tails-per-head / heads-per-tail averaged per relation, threshold 1.5."""
    hpt, tph = defaultdict(lambda: defaultdict(set)), defaultdict(lambda: defaultdict(set))
    for h, r, t in train.tolist():
        tph[r][h].add(t)
        hpt[r][t].add(h)
    cat = torch.zeros(n_rel, dtype=torch.long)
    for r in range(n_rel):
        a = np.mean([len(v) for v in tph[r].values()]) if tph[r] else 1.0
        b = np.mean([len(v) for v in hpt[r].values()]) if hpt[r] else 1.0
        cat[r] = (a >= 1.5) * 1 + (b >= 1.5) * 2   # 0:1-1 1:1-N 2:N-1 3:N-N
    return cat


class RotatE(nn.Module):
    def __init__(self, n_ent, n_rel, dim, gamma):
        super().__init__()
        self.gamma = gamma
        self.scale = (gamma + 2.0) / dim
        self.ent = nn.Parameter(torch.empty(n_ent, 2 * dim).uniform_(-self.scale, self.scale))
        self.rel = nn.Parameter(torch.empty(n_rel, dim).uniform_(-self.scale, self.scale))

    def _dist(self, head, phase, tail, mode):
        re_h, im_h = head.chunk(2, -1)
        re_t, im_t = tail.chunk(2, -1)
        theta = phase / (self.scale / math.pi)
        re_r, im_r = torch.cos(theta), torch.sin(theta)
        if mode == "head-batch":
            re = re_r * re_t + im_r * im_t - re_h
            im = re_r * im_t - im_r * re_t - im_h
        else:
            re = re_h * re_r - im_h * im_r - re_t
            im = re_h * im_r + im_h * re_r - im_t
        return self.gamma - torch.sqrt(re ** 2 + im ** 2 + 1e-12).sum(-1)

    def forward(self, pos, neg, mode):
        h, r, t = self.ent[pos[:, 0]], self.rel[pos[:, 1]], self.ent[pos[:, 2]]
        p = self._dist(h, r, t, "tail-batch")
        ne = self.ent[neg]
        if mode == "head-batch":
            n = self._dist(ne, r[:, None], t[:, None], mode)
        else:
            n = self._dist(h[:, None], r[:, None], ne, mode)
        return p, n


@torch.no_grad()
def evaluate(model, triples, filters, rel_cat, args, rank, world, device):
    model.eval()
    shard = triples[rank::world]
    ranks, cats = [], []
    for i in range(0, len(shard), args.eval_batch):
        b = shard[i:i + args.eval_batch].to(device)
        h, r, t = b[:, 0], b[:, 1], b[:, 2]
        for mode in ("head-batch", "tail-batch"):
            if mode == "head-batch":
                s = model._dist(model.ent[None], model.rel[r][:, None], model.ent[t][:, None], mode)
                gold, keys, filt = h, zip(r.tolist(), t.tolist()), filters["head"]
            else:
                s = model._dist(model.ent[h][:, None], model.rel[r][:, None], model.ent[None], mode)
                gold, keys, filt = t, zip(h.tolist(), r.tolist()), filters["tail"]
            g = s.gather(1, gold[:, None])
            for j, k in enumerate(keys):
                s[j, filt[k]] = float("-inf")
            ranks.append(1 + (s > g).sum(1))
            cats.append(rel_cat.to(device)[r] * 2 + (mode == "tail-batch"))
    ranks, cats = torch.cat(ranks), torch.cat(cats)

    all_ranks = [torch.zeros_like(ranks) for _ in range(world)]
    all_cats = [torch.zeros_like(cats) for _ in range(world)]
    dist.all_gather(all_ranks, ranks)
    dist.all_gather(all_cats, cats)
    if rank != 0:
        return None
    ranks, cats = torch.cat(all_ranks).double(), torch.cat(all_cats)
    out = {"MRR": (1 / ranks).mean().item(), "MR": ranks.mean().item(),
           "H@1": (ranks <= 1).double().mean().item(), "H@10": (ranks <= 10).double().mean().item()}
    names = ["1-1", "1-N", "N-1", "N-N"]
    for c in range(4):
        for side, off in (("head", 0), ("tail", 1)):
            sel = ranks[cats == c * 2 + off]
            if sel.numel():
                out[f"{names[c]}/{side}/MRR"] = (1 / sel).mean().item()
    return out


def main():
    args = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    e2id = read_ids(os.path.join(args.data, "entities.dict"))
    r2id = read_ids(os.path.join(args.data, "relations.dict"))
    splits = {s: read_split(os.path.join(args.data, f"{s}.txt"), e2id, r2id) for s in ("train", "valid", "test")}
    filters = {"head": defaultdict(list), "tail": defaultdict(list)}
    for h, r, t in torch.cat(list(splits.values())).tolist():
        filters["tail"][(h, r)].append(t)
        filters["head"][(r, t)].append(h)
    rel_cat = relation_categories(splits["train"], len(r2id))

    ds = TensorDataset(splits["train"])
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, drop_last=True, num_workers=2)

    model = RotatE(len(e2id), len(r2id), args.dim, args.gamma).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    step, epoch, best = 0, 0, 0.0
    loss_acc = torch.zeros(2, device=device)
    tic = time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for (pos,) in loader:
            ddp.train()
            pos = pos.to(device, non_blocking=True)
            neg = torch.randint(0, len(e2id), (pos.size(0), args.neg), device=device)
            mode = "head-batch" if step % 2 else "tail-batch"
            p, n = ddp(pos, neg, mode)
            n_loss = -(F.softmax(n * args.adv_temp, 1).detach() * F.logsigmoid(-n)).sum(1).mean()
            loss = 0.5 * (-F.logsigmoid(p).mean() + n_loss)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            loss_acc += torch.stack([loss.detach(), torch.ones((), device=device)])
            if step % args.log_every == 0:
                dist.all_reduce(loss_acc)
                if rank == 0:
                    print(f"step {step} loss {(loss_acc[0] / loss_acc[1]).item():.4f} "
                          f"{(time.time() - tic) / args.log_every * 1000:.0f} ms/step", flush=True)
                loss_acc.zero_()
                tic = time.time()
            if step % args.eval_every == 0:
                res = evaluate(model, splits["valid"], filters, rel_cat, args, rank, world, device)
                if rank == 0:
                    print(f"valid @ {step}: {json.dumps(res)}", flush=True)
                    if res["MRR"] > best:
                        best = res["MRR"]
                        torch.save({"step": step, "model": model.state_dict(), "valid": res},
                                   os.path.join(args.out, "best.pt"))
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    model.load_state_dict(torch.load(os.path.join(args.out, "best.pt"), map_location=device)["model"])
    res = evaluate(model, splits["test"], filters, rel_cat, args, rank, world, device)
    if rank == 0:
        print(f"test: {json.dumps(res, indent=1)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
