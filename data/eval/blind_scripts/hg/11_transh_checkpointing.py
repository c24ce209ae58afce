"""TransH (Wang et al., AAAI 2014): translation on relation-specific hyperplanes.

Multi-GPU training with periodic checkpoints and embedding export.

    torchrun --nproc_per_node=4 11_transh_checkpointing.py --data_dir data/FB15k-237 --save_dir /shared/kge/transh
"""
import argparse
import logging
import os
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("transh")


def build_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", default="data/FB15k-237")
    p.add_argument("--save_dir", default="ckpt/transh")
    p.add_argument("--dim", type=int, default=200)
    p.add_argument("--margin", type=float, default=4.0)
    p.add_argument("--C", type=float, default=0.015625, help="soft constraint weight")
    p.add_argument("--eps", type=float, default=1e-3)
    p.add_argument("--num_neg", type=int, default=25)
    p.add_argument("--batch_size", type=int, default=2048)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--epochs", type=int, default=500)
    p.add_argument("--ckpt_every", type=int, default=25)
    p.add_argument("--keep_last", type=int, default=3)
    return p


def load_dataset(data_dir):
    def vocab(fname):
        with open(os.path.join(data_dir, fname)) as f:
            return {name: int(i) for i, name in (ln.rstrip("\n").split("\t") for ln in f)}

    e2i, r2i = vocab("entities.dict"), vocab("relations.dict")
    out = {}
    for split in ("train", "valid", "test"):
        with open(os.path.join(data_dir, split + ".txt")) as f:
            rows = [ln.rstrip("\n").split("\t") for ln in f]
        out[split] = torch.tensor([[e2i[h], r2i[r], e2i[t]] for h, r, t in rows])
    return out, len(e2i), len(r2i)


class TransH(nn.Module):
    def __init__(self, n_ent, n_rel, dim):
        super().__init__()
        self.ent = nn.Embedding(n_ent, dim)
        self.rel = nn.Embedding(n_rel, dim)
        self.norm_vec = nn.Embedding(n_rel, dim)
        for e in (self.ent, self.rel, self.norm_vec):
            nn.init.xavier_uniform_(e.weight)

    @staticmethod
    def project(e, w):
        w = F.normalize(w, p=2, dim=-1)
        return e - (e * w).sum(-1, keepdim=True) * w

    def distance(self, h, r, t):
        w = self.norm_vec(r)
        hp, tp = self.project(self.ent(h), w), self.project(self.ent(t), w)
        return (hp + self.rel(r) - tp).norm(p=2, dim=-1)

    def forward(self, pos, neg):
        dp = self.distance(pos[:, 0], pos[:, 1], pos[:, 2])
        dn = self.distance(neg[..., 0], neg[..., 1], neg[..., 2])
        return dp, dn

    def soft_constraints(self, pos, eps):
        ents = self.ent(torch.cat([pos[:, 0], pos[:, 2]]))
        c1 = F.relu(ents.norm(dim=-1) ** 2 - 1).sum()
        w = F.normalize(self.norm_vec(pos[:, 1]), dim=-1)
        d = self.rel(pos[:, 1])
        c2 = F.relu(((w * d).sum(-1) ** 2) / (d.norm(dim=-1) ** 2) - eps ** 2).sum()
        return c1 + c2

    @torch.no_grad()
    def tail_distances(self, h, r):
        w = F.normalize(self.norm_vec(r), dim=-1)                 # B x d
        q = self.project(self.ent(h), w) + self.rel(r)            # B x d
        e = self.ent.weight                                       # N x d
        # ||q - (e - (e.w) w)||, computed per relation row
        ew = e @ w.t()                                            # N x B
        proj = e.unsqueeze(0) - ew.t().unsqueeze(-1) * w.unsqueeze(1)
        return (q.unsqueeze(1) - proj).norm(dim=-1)               # B x N


def corrupt(pos, n_ent, num_neg):
    neg = pos.unsqueeze(1).repeat(1, num_neg, 1)
    rnd = torch.randint(n_ent, neg.shape[:2], device=pos.device)
    side = torch.randint(2, neg.shape[:2], device=pos.device).bool()
    neg[..., 0] = torch.where(side, rnd, neg[..., 0])
    neg[..., 2] = torch.where(side, neg[..., 2], rnd)
    return neg


@torch.no_grad()
def mean_rank(model, triples, filt, device, rank, world, bs=32):
    model.eval()
    part = triples[rank::world].to(device)
    tot = torch.zeros(3, device=device)
    for i in range(0, len(part), bs):
        b = part[i:i + bs]
        d = model.tail_distances(b[:, 0], b[:, 1])
        gold = d.gather(1, b[:, 2:3])
        for j, (h, r, _) in enumerate(b.tolist()):
            d[j, filt[(h, r)]] = float("inf")
        rk = (d < gold).sum(1).float() + 1
        tot += torch.stack([rk.sum(), (rk <= 10).float().sum(), rk.new_tensor(float(len(rk)))])
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[2]).item(), (tot[1] / tot[2]).item()


def save_model(model, optimizer, epoch, save_dir, keep_last):
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, f"epoch_{epoch:04d}.pt")
    torch.save({"epoch": epoch, "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict()}, path)
    np.save(os.path.join(save_dir, "entity_embeddings.npy"),
            model.module.ent.weight.detach().cpu().numpy())
    shutil.copyfile(path, os.path.join(save_dir, "latest.pt"))
    old = sorted(f for f in os.listdir(save_dir) if f.startswith("epoch_"))
    for f in old[:-keep_last]:
        os.remove(os.path.join(save_dir, f))


def main():
    args = build_parser().parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    data, n_ent, n_rel = load_dataset(args.data_dir)
    filt = {}
    for h, r, t in torch.cat([data["train"], data["valid"], data["test"]]).tolist():
        filt.setdefault((h, r), []).append(t)

    ds = TensorDataset(data["train"])
    sampler = DistributedSampler(ds, shuffle=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=2, pin_memory=True)

    model = DDP(TransH(n_ent, n_rel, args.dim).to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    criterion = nn.MarginRankingLoss(margin=args.margin)

    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        tic, s, n = time.time(), 0.0, 0
        for (pos,) in loader:
            pos = pos.to(device, non_blocking=True)
            neg = corrupt(pos, n_ent, args.num_neg)
            dp, dn = model(pos, neg)
            loss = criterion(dp.unsqueeze(1).expand_as(dn), dn, -torch.ones_like(dn))
            loss = loss + args.C * model.module.soft_constraints(pos, args.eps) / len(pos)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            s += loss.item()
            n += 1
        logger.info("epoch %d  loss %.4f  %.1fs", epoch, s / n, time.time() - tic)

        if epoch % args.ckpt_every == 0:
            mr, h10 = mean_rank(model.module, data["valid"], filt, device, rank, world)
            logger.info("epoch %d  valid filtered MR %.1f  Hits@10 %.4f", epoch, mr, h10)
            save_model(model, optimizer, epoch, args.save_dir, args.keep_last)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
