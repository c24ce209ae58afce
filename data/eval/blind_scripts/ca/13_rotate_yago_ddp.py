# -*- coding: utf-8 -*-
"""
RotatE on YAGO3-10, distributed data parallel.

Usage:
    torchrun --nproc_per_node=4 13_rotate_yago_ddp.py \
        --data_path data/YAGO3-10 --hidden_dim 500 --gamma 24 -adv
"""
import argparse
import json
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    parser = argparse.ArgumentParser(description="RotatE DDP")
    parser.add_argument("--data_path", type=str, required=True)
    parser.add_argument("--save_path", type=str, default="models/RotatE_YAGO3-10")
    parser.add_argument("--hidden_dim", type=int, default=500)
    parser.add_argument("--gamma", type=float, default=24.0)
    parser.add_argument("-adv", "--negative_adversarial_sampling", action="store_true")
    parser.add_argument("-a", "--adversarial_temperature", type=float, default=1.0)
    parser.add_argument("-n", "--negative_sample_size", type=int, default=400)
    parser.add_argument("-b", "--batch_size", type=int, default=1024)
    parser.add_argument("-lr", "--learning_rate", type=float, default=2e-4)
    parser.add_argument("--max_steps", type=int, default=200000)
    parser.add_argument("--valid_steps", type=int, default=20000)
    parser.add_argument("--log_steps", type=int, default=200)
    parser.add_argument("--test_batch_size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


def read_triples(path, e2i, r2i):
    triples = []
    with open(path) as fin:
        for line in fin:
            h, r, t = line.strip().split("\t")
            triples.append((e2i[h], r2i[r], e2i[t]))
    return triples


class TrainDataset(Dataset):
    def __init__(self, triples, nentity, negative_sample_size):
        self.triples = triples
        self.nentity = nentity
        self.k = negative_sample_size

    def __len__(self):
        return len(self.triples)

    def __getitem__(self, idx):
        pos = torch.LongTensor(self.triples[idx])
        neg = torch.randint(0, self.nentity, (self.k,))
        mode = idx % 2  # 0: corrupt head, 1: corrupt tail
        return pos, neg, mode


class RotatE(nn.Module):
    def __init__(self, nentity, nrelation, hidden_dim, gamma):
        super().__init__()
        self.gamma = nn.Parameter(torch.Tensor([gamma]), requires_grad=False)
        self.embedding_range = nn.Parameter(torch.Tensor([(gamma + 2.0) / hidden_dim]),
                                            requires_grad=False)
        self.entity_embedding = nn.Parameter(torch.zeros(nentity, hidden_dim * 2))
        self.relation_embedding = nn.Parameter(torch.zeros(nrelation, hidden_dim))
        nn.init.uniform_(self.entity_embedding, -self.embedding_range.item(), self.embedding_range.item())
        nn.init.uniform_(self.relation_embedding, -self.embedding_range.item(), self.embedding_range.item())

    def distance(self, head, relation, tail):
        pi = 3.14159265358979323846
        re_head, im_head = torch.chunk(head, 2, dim=-1)
        re_tail, im_tail = torch.chunk(tail, 2, dim=-1)
        phase = relation / (self.embedding_range.item() / pi)
        re_rel, im_rel = torch.cos(phase), torch.sin(phase)
        re = re_head * re_rel - im_head * im_rel - re_tail
        im = re_head * im_rel + im_head * re_rel - im_tail
        return torch.stack([re, im], dim=0).norm(dim=0).sum(dim=-1)

    def forward(self, pos, neg, mode):
        head = self.entity_embedding[pos[:, 0]].unsqueeze(1)
        rel = self.relation_embedding[pos[:, 1]].unsqueeze(1)
        tail = self.entity_embedding[pos[:, 2]].unsqueeze(1)
        negs = self.entity_embedding[neg]
        pos_score = self.gamma - self.distance(head, rel, tail).squeeze(1)
        m = mode.view(-1, 1, 1).bool()
        neg_head = torch.where(m, head.expand_as(negs), negs)
        neg_tail = torch.where(m, negs, tail.expand_as(negs))
        neg_score = self.gamma - self.distance(neg_head, rel, neg_tail)
        return pos_score, neg_score


@torch.no_grad()
def test_step(model, triples, all_true, args, device, rank, world):
    model.eval()
    shard = triples[rank::world]
    true_tail, true_head = {}, {}
    for h, r, t in all_true:
        true_tail.setdefault((h, r), []).append(t)
        true_head.setdefault((r, t), []).append(h)
    logs = torch.zeros(5, dtype=torch.float64, device=device)
    ent = model.entity_embedding
    for i in range(0, len(shard), args.test_batch_size):
        b = torch.LongTensor(shard[i:i + args.test_batch_size]).to(device)
        rel = model.relation_embedding[b[:, 1]].unsqueeze(1)
        for mode in ("head", "tail"):
            if mode == "tail":
                s = model.gamma - model.distance(ent[b[:, 0]].unsqueeze(1), rel, ent.unsqueeze(0))
                gold = b[:, 2]
            else:
                s = model.gamma - model.distance(ent.unsqueeze(0), rel, ent[b[:, 2]].unsqueeze(1))
                gold = b[:, 0]
            gs = s.gather(1, gold[:, None]).clone()
            for j, (h, r, t) in enumerate(b.tolist()):
                f = true_tail[(h, r)] if mode == "tail" else true_head[(r, t)]
                s[j, f] = -1e9
            s.scatter_(1, gold[:, None], gs)
            ranking = (s > gs).sum(1).double() + 1
            logs[0] += (1.0 / ranking).sum()
            logs[1] += ranking.sum()
            logs[2] += (ranking <= 1).sum()
            logs[3] += (ranking <= 10).sum()
            logs[4] += ranking.numel()
    dist.all_reduce(logs)
    model.train()
    n = logs[4].item()
    return {"MRR": logs[0].item() / n, "MR": logs[1].item() / n,
            "HITS@1": logs[2].item() / n, "HITS@10": logs[3].item() / n}


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    logging.basicConfig(format="%(asctime)s %(levelname)-8s %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARNING)

    with open(os.path.join(args.data_path, "entities.dict")) as f:
        e2i = {e: int(i) for i, e in (l.strip().split("\t") for l in f)}
    with open(os.path.join(args.data_path, "relations.dict")) as f:
        r2i = {r: int(i) for i, r in (l.strip().split("\t") for l in f)}
    train = read_triples(os.path.join(args.data_path, "train.txt"), e2i, r2i)
    valid = read_triples(os.path.join(args.data_path, "valid.txt"), e2i, r2i)
    test = read_triples(os.path.join(args.data_path, "test.txt"), e2i, r2i)
    logging.info("#entity %d  #relation %d  #train %d", len(e2i), len(r2i), len(train))

    ds = TrainDataset(train, len(e2i), args.negative_sample_size)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        drop_last=True, pin_memory=True)

    model = RotatE(len(e2i), len(r2i), args.hidden_dim, args.gamma).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.Adam(filter(lambda p: p.requires_grad, model.parameters()),
                                 lr=args.learning_rate)

    if rank == 0:
        os.makedirs(args.save_path, exist_ok=True)
        with open(os.path.join(args.save_path, "config.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    step, epoch = 0, 0
    all_true = train + valid + test
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for pos, neg, mode in loader:
            pos, neg, mode = pos.to(device), neg.to(device), mode.to(device)
            pos_score, neg_score = model(pos, neg, mode)
            if args.negative_adversarial_sampling:
                w = F.softmax(neg_score * args.adversarial_temperature, dim=1).detach()
                neg_loss = -(w * F.logsigmoid(-neg_score)).sum(dim=1)
            else:
                neg_loss = -F.logsigmoid(-neg_score).mean(dim=1)
            pos_loss = -F.logsigmoid(pos_score)
            loss = (pos_loss.mean() + neg_loss.mean()) / 2
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step % args.log_steps == 0:
                logging.info("step %d loss %.4f pos %.4f neg %.4f", step, loss.item(),
                             pos_loss.mean().item(), neg_loss.mean().item())
            if step % args.valid_steps == 0:
                metrics = test_step(model.module, valid, all_true, args, device, rank, world)
                logging.info("valid @%d %s", step, metrics)
                if rank == 0:
                    torch.save({"step": step, "model_state_dict": model.module.state_dict(),
                                "optimizer_state_dict": optimizer.state_dict()},
                               os.path.join(args.save_path, "checkpoint.pt"))
                dist.barrier()
            if step >= args.max_steps:
                break
        epoch += 1

    metrics = test_step(model.module, test, all_true, args, device, rank, world)
    logging.info("test %s", metrics)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
