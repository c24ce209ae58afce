"""SimplE (Kazemi & Poole, NeurIPS 2018) with DistributedDataParallel.

Each entity has a head vector and a tail vector; each relation a forward and an
inverse vector. Trained with softplus loss over uniformly corrupted triples.
"""
import argparse
import logging
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def get_args():
    parser = argparse.ArgumentParser(description="SimplE multi-GPU")
    parser.add_argument("--dataset", default="data/WN18")
    parser.add_argument("--output", default="outputs/simple")
    parser.add_argument("--emb_dim", type=int, default=200)
    parser.add_argument("--neg_ratio", type=int, default=10)
    parser.add_argument("--batch_size", type=int, default=1415)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--reg_lambda", type=float, default=0.03)
    parser.add_argument("--ne", type=int, default=1000, help="number of epochs")
    parser.add_argument("--save_each", type=int, default=50)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class KG:
    def __init__(self, root):
        self.ent2id, self.rel2id = {}, {}
        self.data = {s: self._read(os.path.join(root, f"{s}.txt")) for s in ("train", "valid", "test")}

    def _id(self, table, key):
        return table.setdefault(key, len(table))

    def _read(self, path):
        with open(path) as f:
            lines = [l.strip().split("\t") for l in f if l.strip()]
        return np.array([(self._id(self.ent2id, h), self._id(self.rel2id, r), self._id(self.ent2id, t))
                         for h, r, t in lines], dtype=np.int64)

    @property
    def num_ent(self):
        return len(self.ent2id)

    @property
    def num_rel(self):
        return len(self.rel2id)


class Corrupted(Dataset):
    def __init__(self, triples, num_ent, neg_ratio):
        self.triples = triples
        self.num_ent = num_ent
        self.neg_ratio = neg_ratio

    def __len__(self):
        return len(self.triples)

    def __getitem__(self, i):
        pos = self.triples[i]
        batch = np.repeat(pos[None], 2 * self.neg_ratio + 1, axis=0)
        batch[1:self.neg_ratio + 1, 0] = np.random.randint(self.num_ent, size=self.neg_ratio)
        batch[self.neg_ratio + 1:, 2] = np.random.randint(self.num_ent, size=self.neg_ratio)
        labels = -np.ones(len(batch), dtype=np.float32)
        labels[0] = 1.0
        return torch.from_numpy(batch), torch.from_numpy(labels)


class SimplE(nn.Module):
    def __init__(self, num_ent, num_rel, emb_dim):
        super().__init__()
        self.ent_h = nn.Embedding(num_ent, emb_dim)
        self.ent_t = nn.Embedding(num_ent, emb_dim)
        self.rel = nn.Embedding(num_rel, emb_dim)
        self.rel_inv = nn.Embedding(num_rel, emb_dim)
        bound = 6.0 / emb_dim ** 0.5
        for e in (self.ent_h, self.ent_t, self.rel, self.rel_inv):
            nn.init.uniform_(e.weight, -bound, bound)

    def forward(self, h, r, t):
        hh, ht = self.ent_h(h), self.ent_t(h)
        th, tt = self.ent_h(t), self.ent_t(t)
        r_f, r_i = self.rel(r), self.rel_inv(r)
        score = 0.5 * ((hh * r_f * tt).sum(-1) + (th * r_i * ht).sum(-1))
        reg = (hh ** 2 + ht ** 2 + th ** 2 + tt ** 2 + r_f ** 2 + r_i ** 2).sum(-1)
        return torch.clamp(score, -20, 20), reg

    @torch.no_grad()
    def all_tails(self, h, r):
        a = (self.ent_h(h) * self.rel(r)) @ self.ent_t.weight.t()
        b = (self.ent_t(h) * self.rel_inv(r)) @ self.ent_h.weight.t()
        return 0.5 * (a + b)


@torch.no_grad()
def evaluate(model, kg, split, device, rank, world, bs=200):
    known = {}
    for h, r, t in np.concatenate([kg.data["train"], kg.data["valid"], kg.data["test"]]).tolist():
        known.setdefault((h, r), []).append(t)
    part = kg.data[split][rank::world]
    out = torch.zeros(3, device=device)
    for i in range(0, len(part), bs):
        b = torch.from_numpy(part[i:i + bs]).to(device)
        s = model.all_tails(b[:, 0], b[:, 1])
        gold = s.gather(1, b[:, 2:3])
        for j, (h, r, _) in enumerate(b.tolist()):
            s[j, known[(h, r)]] = float("-inf")
        rk = (s > gold).sum(1).float() + 1
        out += torch.stack([(1.0 / rk).sum(), (rk <= 10).float().sum(), rk.new_tensor(float(len(rk)))])
    dist.all_reduce(out)
    return (out[0] / out[2]).item(), (out[1] / out[2]).item()


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    seed_everything(args.seed + rank)  # DDP broadcasts rank 0's initial weights
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")

    kg = KG(args.dataset)
    logging.info("entities %d relations %d train %d", kg.num_ent, kg.num_rel, len(kg.data["train"]))
    ds = Corrupted(kg.data["train"], kg.num_ent, args.neg_ratio)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.batch_size // world, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=False)

    model = SimplE(kg.num_ent, kg.num_rel, args.emb_dim).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=args.lr, initial_accumulator_value=0.1)

    writer = None
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.output, "tb"))

    for epoch in range(1, args.ne + 1):
        sampler.set_epoch(epoch)
        t0 = time.time()
        total = torch.zeros(2, device=device)
        for trip, lab in loader:
            trip = trip.view(-1, 3).to(device, non_blocking=True)
            lab = lab.view(-1).to(device, non_blocking=True)
            score, reg = model(trip[:, 0], trip[:, 1], trip[:, 2])
            loss = F.softplus(-lab * score).sum() + args.reg_lambda * reg.sum() / len(score)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(total)
        if rank == 0:
            writer.add_scalar("loss", (total[0] / total[1]).item(), epoch)
            logging.info("epoch %d loss %.3f (%.1fs)", epoch, (total[0] / total[1]).item(), time.time() - t0)

        if epoch % args.save_each == 0:
            model.eval()
            mrr, h10 = evaluate(model.module, kg, "valid", device, rank, world)
            model.train()
            if rank == 0:
                writer.add_scalar("valid/mrr", mrr, epoch)
                writer.add_scalar("valid/hits10", h10, epoch)
                logging.info("epoch %d valid filtered MRR %.4f Hits@10 %.4f", epoch, mrr, h10)
                torch.save(model.module.state_dict(), os.path.join(args.output, f"simple_{epoch}.pt"))
            dist.barrier()

    mrr, h10 = evaluate(model.module, kg, "test", device, rank, world)
    if rank == 0:
        logging.info("final test MRR %.4f Hits@10 %.4f", mrr, h10)
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
