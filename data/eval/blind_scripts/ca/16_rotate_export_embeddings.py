"""Train RotatE with DDP and export the best entity/relation embeddings to .npy
for the downstream retrieval service.

    torchrun --nproc_per_node=8 16_rotate_export_embeddings.py --cfg configs/rotate_codex_l.json
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

DEFAULTS = dict(data="data/codex-l", out="exports/rotate_codex_l", dim=256, gamma=12.0,
                temp=0.5, neg=128, batch=512, lr=1e-4, epochs=120, eval_every=10,
                eval_bs=64, seed=0)


class RotatE(nn.Module):
    def __init__(self, n_ent, n_rel, dim, gamma):
        super().__init__()
        self.dim, self.gamma = dim, gamma
        self.scale = (gamma + 2.0) / dim
        self.entity = nn.Embedding(n_ent, 2 * dim)
        self.relation = nn.Embedding(n_rel, dim)
        nn.init.uniform_(self.entity.weight, -self.scale, self.scale)
        nn.init.uniform_(self.relation.weight, -self.scale, self.scale)

    def rot(self, r_idx):
        ph = self.relation(r_idx) * (math.pi / self.scale)
        return torch.cos(ph), torch.sin(ph)

    def dist_to(self, h_idx, r_idx, tails):
        hr, hi = self.entity(h_idx).chunk(2, -1)
        c, s = self.rot(r_idx)
        qr = (hr * c - hi * s).unsqueeze(1)
        qi = (hr * s + hi * c).unsqueeze(1)
        tr, ti = tails.chunk(2, -1)
        return torch.sqrt((qr - tr) ** 2 + (qi - ti) ** 2 + 1e-9).sum(-1)

    def forward(self, x, neg):
        d_pos = self.dist_to(x[:, 0], x[:, 1], self.entity(x[:, 2]).unsqueeze(1)).squeeze(1)
        d_neg = self.dist_to(x[:, 0], x[:, 1], self.entity(neg))
        ps, ns = self.gamma - d_pos, self.gamma - d_neg
        return ps, ns


def self_adv_loss(ps, ns, temp):
    w = torch.softmax(ns * temp, dim=-1).detach()
    return -0.5 * (F.logsigmoid(ps).mean() + (w * F.logsigmoid(-ns)).sum(-1).mean())


def load_kg(path):
    ent = json.load(open(os.path.join(path, "entity2id.json")))
    rel = json.load(open(os.path.join(path, "relation2id.json")))
    splits = {}
    for s in ("train", "valid", "test"):
        rows = [l.rstrip("\n").split("\t") for l in open(os.path.join(path, f"{s}.tsv"))]
        splits[s] = torch.tensor([[ent[h], rel[r], ent[t]] for h, r, t in rows])
    return splits, ent, rel


@torch.no_grad()
def filtered_eval(net, triples, filt, device, rank, world, bs):
    net.eval()
    mine = triples[rank::world]
    out = torch.zeros(4, device=device, dtype=torch.float64)
    all_t = net.entity.weight.unsqueeze(0)
    for s in range(0, mine.size(0), bs):
        b = mine[s:s + bs].to(device)
        sc = net.gamma - net.dist_to(b[:, 0], b[:, 1], all_t)
        gold = sc.gather(1, b[:, 2:3]).clone()
        for i, (h, r, t) in enumerate(b.tolist()):
            sc[i, filt[(h, r)]] = -float("inf")
        sc.scatter_(1, b[:, 2:3], gold)
        ranks = (sc > gold).sum(1).double() + 1
        out += torch.stack([(1 / ranks).sum(), (ranks <= 1).double().sum(),
                            (ranks <= 10).double().sum(), ranks.new_tensor(len(ranks))])
    dist.all_reduce(out)
    net.train()
    return {"mrr": (out[0] / out[3]).item(), "h@1": (out[1] / out[3]).item(),
            "h@10": (out[2] / out[3]).item()}


def export_embeddings(ckpt_path, out_dir, n_ent, n_rel, cfg, ent, rel):
    ckpt = torch.load(ckpt_path, map_location="cpu")
    net = RotatE(n_ent, n_rel, cfg["dim"], cfg["gamma"])
    net.load_state_dict(ckpt["state_dict"])
    np.save(os.path.join(out_dir, "entity_embedding.npy"), net.entity.weight.detach().numpy())
    np.save(os.path.join(out_dir, "relation_embedding.npy"), net.relation.weight.detach().numpy())
    with open(os.path.join(out_dir, "ids.json"), "w") as f:
        json.dump({"entity2id": ent, "relation2id": rel}, f)
    print(f"exported embeddings from epoch {ckpt['epoch']} to {out_dir}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    cfg = dict(DEFAULTS)
    a = ap.parse_args()
    if a.cfg:
        cfg.update(json.load(open(a.cfg)))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    splits, ent, rel = load_kg(cfg["data"])
    n_ent, n_rel = len(ent), len(rel)
    inv = lambda x: torch.cat([x, torch.stack([x[:, 2], x[:, 1] + n_rel, x[:, 0]], 1)])
    train, valid, test = inv(splits["train"]), inv(splits["valid"]), inv(splits["test"])
    filt = defaultdict(list)
    for h, r, t in torch.cat([train, valid, test]).tolist():
        filt[(h, r)].append(t)

    ds = TensorDataset(train)
    sampler = DistributedSampler(ds, seed=cfg["seed"], shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=cfg["batch"], sampler=sampler, drop_last=True,
                        num_workers=2, pin_memory=True)

    torch.manual_seed(cfg["seed"])
    model = RotatE(n_ent, 2 * n_rel, cfg["dim"], cfg["gamma"]).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[cfg["epochs"] // 2], gamma=0.1)

    best_path = os.path.join(cfg["out"], "best_model.pt")
    if rank == 0:
        os.makedirs(cfg["out"], exist_ok=True)
    best = -1.0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for (x,) in loader:
            x = x.to(device, non_blocking=True)
            neg = torch.randint(n_ent, (x.size(0), cfg["neg"]), device=device)
            ps, ns = model(x, neg)
            loss = self_adv_loss(ps, ns, cfg["temp"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(run)
        if rank == 0:
            print(f"epoch {epoch:3d} loss {(run[0] / run[1]).item():.4f} ({time.time() - t0:.0f}s)",
                  flush=True)

        if (epoch + 1) % cfg["eval_every"] == 0:
            m = filtered_eval(model.module, valid, filt, device, rank, world, cfg["eval_bs"])
            if rank == 0:
                print(f"   valid {m}", flush=True)
                if m["mrr"] > best:
                    best = m["mrr"]
                    torch.save({"state_dict": model.state_dict(), "epoch": epoch, "valid": m},
                               best_path)
            dist.barrier()

    m = filtered_eval(model.module, test, filt, device, rank, world, cfg["eval_bs"])
    if rank == 0:
        print(f"test (last epoch) {m}", flush=True)
        export_embeddings(best_path, cfg["out"], n_ent, 2 * n_rel, cfg, ent, rel)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
