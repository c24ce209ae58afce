"""Distributed TransE trainer (Trainer-class layout used across our KGE experiments).

    torchrun --nproc_per_node=8 11_transe_trainer_class.py --data data/FB15k-237 --dim 400
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("kge")


class TransE(nn.Module):
    def __init__(self, n_ent, n_rel, dim, gamma=12.0):
        super().__init__()
        self.gamma = gamma
        self.ent = nn.Embedding(n_ent, dim)
        self.rel = nn.Embedding(n_rel, dim)
        r = (gamma + 2.0) / dim
        nn.init.uniform_(self.ent.weight, -r, r)
        nn.init.uniform_(self.rel.weight, -r, r)

    def forward(self, pos, neg_idx, mode):
        h, r, t = self.ent(pos[:, 0]), self.rel(pos[:, 1]), self.ent(pos[:, 2])
        n = self.ent(neg_idx)
        pos_s = self.gamma - (h + r - t).norm(p=1, dim=-1)
        if mode == "head":
            neg_s = self.gamma - (n + (r - t).unsqueeze(1)).norm(p=1, dim=-1)
        else:
            neg_s = self.gamma - ((h + r).unsqueeze(1) - n).norm(p=1, dim=-1)
        return pos_s, neg_s

    @torch.no_grad()
    def score_candidates(self, h, r, t, mode, chunk=2048):
        E = self.ent.weight
        out = []
        for s in range(0, E.size(0), chunk):
            c = E[s:s + chunk].unsqueeze(0)
            if mode == "tail":
                q = (self.ent(h) + self.rel(r)).unsqueeze(1)
                out.append(self.gamma - (q - c).norm(p=1, dim=-1))
            else:
                q = (self.rel(r) - self.ent(t)).unsqueeze(1)
                out.append(self.gamma - (c + q).norm(p=1, dim=-1))
        return torch.cat(out, dim=1)


class Trainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        self._load_data()
        self.model = TransE(self.n_ent, self.n_rel, args.dim, args.gamma).to(self.device)
        self.ddp = DDP(self.model, device_ids=[self.local_rank])
        self.opt = torch.optim.Adam(self.ddp.parameters(), lr=args.lr)

    def _load_data(self):
        a = self.args
        e2i = {}
        with open(os.path.join(a.data, "entities.dict")) as f:
            for line in f:
                i, name = line.strip().split("\t")
                e2i[name] = int(i)
        r2i = {}
        with open(os.path.join(a.data, "relations.dict")) as f:
            for line in f:
                i, name = line.strip().split("\t")
                r2i[name] = int(i)

        def read(fn):
            with open(os.path.join(a.data, fn)) as f:
                return np.array([[e2i[h], r2i[r], e2i[t]]
                                 for h, r, t in (l.strip().split("\t") for l in f)], dtype=np.int64)

        self.train, self.valid, self.test = read("train.txt"), read("valid.txt"), read("test.txt")
        self.n_ent, self.n_rel = len(e2i), len(r2i)
        self.tails, self.heads = defaultdict(set), defaultdict(set)
        for h, r, t in np.concatenate([self.train, self.valid, self.test]).tolist():
            self.tails[(h, r)].add(t)
            self.heads[(r, t)].add(h)
        ds = TensorDataset(torch.from_numpy(self.train))
        self.sampler = DistributedSampler(ds, shuffle=True, seed=a.seed)
        self.loader = DataLoader(ds, batch_size=a.batch_size, sampler=self.sampler,
                                 num_workers=2, pin_memory=True)

    def train_epoch(self, epoch):
        a = self.args
        self.sampler.set_epoch(epoch)
        self.ddp.train()
        total, n = 0.0, 0
        for step, (pos,) in enumerate(self.loader):
            pos = pos.to(self.device, non_blocking=True)
            mode = "head" if step % 2 == 0 else "tail"
            neg = torch.randint(self.n_ent, (pos.size(0), a.neg), device=self.device)
            pos_s, neg_s = self.ddp(pos, neg, mode)
            w = torch.softmax(neg_s * a.adv_temp, dim=1).detach()
            loss = -(nn.functional.logsigmoid(pos_s).mean()
                     + (w * nn.functional.logsigmoid(-neg_s)).sum(1).mean()) / 2
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            total += loss.item()
            n += 1
        return total / max(n, 1)

    @torch.no_grad()
    def evaluate(self, triples):
        self.model.eval()
        part = triples[self.rank::self.world]
        rr, hits1, hits3, hits10, count = 0.0, 0, 0, 0, 0
        for s in range(0, len(part), self.args.eval_bs):
            b = torch.from_numpy(part[s:s + self.args.eval_bs]).to(self.device)
            for mode in ("head", "tail"):
                sc = self.model.score_candidates(b[:, 0], b[:, 1], b[:, 2], mode)
                gold = b[:, 0] if mode == "head" else b[:, 2]
                gs = sc.gather(1, gold[:, None]).clone()
                for i, (h, r, t) in enumerate(b.tolist()):
                    known = self.heads[(r, t)] if mode == "head" else self.tails[(h, r)]
                    sc[i, list(known)] = -float("inf")
                sc.scatter_(1, gold[:, None], gs)
                ranks = ((sc > gs).sum(1) + 1).cpu().numpy()
                rr += float((1.0 / ranks).sum())
                hits1 += int((ranks <= 1).sum())
                hits3 += int((ranks <= 3).sum())
                hits10 += int((ranks <= 10).sum())
                count += len(ranks)
        totals = torch.tensor([rr, hits1, hits3, hits10, count], dtype=torch.float64)
        dist.all_reduce(totals)
        rr, hits1, hits3, hits10, count = totals.tolist()
        self.model.train()
        return {"MRR": rr / count, "H@1": hits1 / count, "H@3": hits3 / count,
                "H@10": hits10 / count}

    def save(self, path, epoch, metrics):
        if self.rank == 0:
            torch.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                        "epoch": epoch, "metrics": metrics}, path)
        dist.barrier()

    def fit(self):
        a = self.args
        if self.rank == 0:
            os.makedirs(a.save_dir, exist_ok=True)
        best = 0.0
        for epoch in range(a.epochs):
            t0 = time.time()
            loss = self.train_epoch(epoch)
            logger.info("epoch %d loss %.4f (%.1fs)", epoch, loss, time.time() - t0)
            if (epoch + 1) % a.valid_every == 0:
                m = self.evaluate(self.valid)
                logger.info("valid %s", m)
                if m["MRR"] > best:
                    best = m["MRR"]
                    self.save(os.path.join(a.save_dir, "best.pt"), epoch, m)
        ck = torch.load(os.path.join(a.save_dir, "best.pt"), map_location=self.device)
        self.model.load_state_dict(ck["model"])
        m = self.evaluate(self.test)
        logger.info("test %s (from epoch %d)", m, ck["epoch"])
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--dim", type=int, default=1000)
    p.add_argument("--gamma", type=float, default=9.0)
    p.add_argument("--adv_temp", type=float, default=1.0)
    p.add_argument("--neg", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=1024)
    p.add_argument("--eval_bs", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--valid_every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save_dir", default="models/transe_ddp")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    Trainer(args).fit()


if __name__ == "__main__":
    main()
