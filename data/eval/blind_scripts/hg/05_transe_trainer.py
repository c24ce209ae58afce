"""TransE (Bordes et al. 2013) trainer, following the original recipe:
L1 distance, margin ranking loss, entity vectors projected back onto the unit
sphere after every update, Bernoulli ("bern") corruption of heads / tails.
"""
import argparse
import logging
import os
from collections import defaultdict
from dataclasses import dataclass, asdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger(__name__)


@dataclass
class Config:
    data_dir: str = "data/FB15k"
    ckpt_dir: str = "ckpt/transe_fb15k"
    dim: int = 100
    margin: float = 1.0
    lr: float = 0.01
    batch_size: int = 4800
    epochs: int = 1000
    eval_every: int = 50
    num_workers: int = 4


def parse_config():
    ap = argparse.ArgumentParser()
    for name, default in asdict(Config()).items():
        ap.add_argument(f"--{name}", type=type(default), default=default)
    return Config(**vars(ap.parse_args()))


def load_split(path, e2i, r2i):
    out = []
    with open(path) as f:
        for line in f:
            h, r, t = line.split()
            out.append((e2i[h], r2i[r], e2i[t]))
    return np.asarray(out, dtype=np.int64)


def load_vocab(path):
    with open(path) as f:
        return {name: int(i) for i, name in (l.split() for l in f)}


def bernoulli_probs(triples, n_rel):
    """P(corrupt head) = tph / (tph + hpt) per relation (Wang et al. 2014)."""
    tails_per_head = defaultdict(set)
    heads_per_tail = defaultdict(set)
    for h, r, t in triples:
        tails_per_head[(r, h)].add(t)
        heads_per_tail[(r, t)].add(h)
    tph, hpt = np.zeros(n_rel), np.zeros(n_rel)
    cnt_h, cnt_t = np.zeros(n_rel), np.zeros(n_rel)
    for (r, _), ts in tails_per_head.items():
        tph[r] += len(ts)
        cnt_h[r] += 1
    for (r, _), hs in heads_per_tail.items():
        hpt[r] += len(hs)
        cnt_t[r] += 1
    tph, hpt = tph / np.maximum(cnt_h, 1), hpt / np.maximum(cnt_t, 1)
    return tph / np.maximum(tph + hpt, 1e-12)


class CorruptedTriples(Dataset):
    def __init__(self, triples, n_ent, head_prob):
        self.triples = triples
        self.n_ent = n_ent
        self.head_prob = head_prob

    def __len__(self):
        return len(self.triples)

    def __getitem__(self, i):
        h, r, t = self.triples[i]
        e = np.random.randint(self.n_ent)
        if np.random.rand() < self.head_prob[r]:
            neg = (e, r, t)
        else:
            neg = (h, r, e)
        return torch.tensor([h, r, t]), torch.tensor(neg)


class TransE(nn.Module):
    def __init__(self, n_ent, n_rel, dim, margin):
        super().__init__()
        self.ent = nn.Embedding(n_ent, dim)
        self.rel = nn.Embedding(n_rel, dim)
        r = 6 / np.sqrt(dim)
        nn.init.uniform_(self.ent.weight, -r, r)
        nn.init.uniform_(self.rel.weight, -r, r)
        with torch.no_grad():
            self.rel.weight.copy_(nn.functional.normalize(self.rel.weight, dim=1))
        self.loss_fn = nn.MarginRankingLoss(margin=margin)

    def distance(self, trip):
        return (self.ent(trip[:, 0]) + self.rel(trip[:, 1]) - self.ent(trip[:, 2])).abs().sum(-1)

    def forward(self, pos, neg):
        d_pos, d_neg = self.distance(pos), self.distance(neg)
        target = torch.full_like(d_pos, -1.0)
        return self.loss_fn(d_pos, d_neg, target)

    @torch.no_grad()
    def normalize_entities(self):
        self.ent.weight.copy_(nn.functional.normalize(self.ent.weight, p=2, dim=1))

    @torch.no_grad()
    def rank_tails(self, trip, filt):
        q = self.ent(trip[:, 0]) + self.rel(trip[:, 1])
        d = torch.cdist(q, self.ent.weight, p=1)
        gold = d.gather(1, trip[:, 2:3])
        for i, known in enumerate(filt):
            d[i, known] = float("inf")
        return (d < gold).sum(1) + 1


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.device = torch.device("cuda", self.local_rank)

        e2i = load_vocab(os.path.join(cfg.data_dir, "entity2id.txt"))
        r2i = load_vocab(os.path.join(cfg.data_dir, "relation2id.txt"))
        self.train = load_split(os.path.join(cfg.data_dir, "train.txt"), e2i, r2i)
        self.valid = load_split(os.path.join(cfg.data_dir, "valid.txt"), e2i, r2i)
        self.known = defaultdict(list)
        for h, r, t in np.concatenate([self.train, self.valid]).tolist():
            self.known[(h, r)].append(t)

        ds = CorruptedTriples(self.train, len(e2i), bernoulli_probs(self.train, len(r2i)))
        self.sampler = DistributedSampler(ds)
        self.loader = DataLoader(ds, batch_size=cfg.batch_size, sampler=self.sampler,
                                 num_workers=cfg.num_workers, pin_memory=True)

        net = TransE(len(e2i), len(r2i), cfg.dim, cfg.margin).to(self.device)
        self.model = DistributedDataParallel(net, device_ids=[self.local_rank])
        self.optim = torch.optim.SGD(self.model.parameters(), lr=cfg.lr)
        self.best = 0.0

    def train_epoch(self, epoch):
        self.sampler.set_epoch(epoch)
        self.model.train()
        total = torch.zeros(2, device=self.device)
        for pos, neg in self.loader:
            pos, neg = pos.to(self.device), neg.to(self.device)
            loss = self.model(pos, neg)
            self.optim.zero_grad()
            loss.backward()
            self.optim.step()
            self.model.normalize_entities()
            total += torch.stack([loss.detach() * len(pos), torch.tensor(float(len(pos)), device=self.device)])
        dist.all_reduce(total)
        return (total[0] / total[1]).item()

    def validate(self):
        net = self.model.module
        net.eval()
        part = self.valid[self.rank::self.world]
        acc = torch.zeros(3, device=self.device)  # sum(1/rank), hits@10, n
        for i in range(0, len(part), 500):
            trip = torch.as_tensor(part[i:i + 500], device=self.device)
            filt = [self.known[(h, r)] for h, r, _ in trip.tolist()]
            ranks = net.rank_tails(trip, filt).float()
            acc += torch.stack([(1 / ranks).sum(), (ranks <= 10).float().sum(),
                                torch.tensor(float(len(ranks)), device=self.device)])
        dist.all_reduce(acc)
        return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()

    def save(self, epoch, name):
        if self.rank == 0:
            os.makedirs(self.cfg.ckpt_dir, exist_ok=True)
            torch.save({"epoch": epoch, "model": self.model.module.state_dict(),
                        "optim": self.optim.state_dict(), "config": asdict(self.cfg)},
                       os.path.join(self.cfg.ckpt_dir, name))
        dist.barrier()

    def fit(self):
        for epoch in range(self.cfg.epochs):
            loss = self.train_epoch(epoch)
            if self.rank == 0 and epoch % 10 == 0:
                logger.info("epoch %4d  loss %.5f", epoch, loss)
            if (epoch + 1) % self.cfg.eval_every == 0:
                mrr, h10 = self.validate()
                logger.info("epoch %4d  valid MRR %.4f  Hits@10 %.4f", epoch, mrr, h10)
                if mrr > self.best:
                    self.best = mrr
                    self.save(epoch, "best.pt")
        self.save(self.cfg.epochs - 1, "last.pt")


def main():
    cfg = parse_config()
    dist.init_process_group(backend="nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    logging.basicConfig(level=logging.INFO if dist.get_rank() == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    Trainer(cfg).fit()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
