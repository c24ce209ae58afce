#!/usr/bin/env python3
# -*- coding: utf-8 -*-
"""
Knowledge graph embedding with reciprocal relations (Kazemi & Poole 2018; Lacroix et al. 2018).

Head prediction (?, r, t) is rewritten as tail prediction (t, r^-1, ?), with a separate
embedding for every inverse relation. Batches alternate between tail-batch and
head-batch as in the RotatE code base (BidirectionalOneShotIterator).

Run with:
    torchrun --nproc_per_node=4 10_kge_reciprocal_bidirectional.py --model ComplEx -d 500 -n 256 -b 1024
"""
import argparse
import json
import logging
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args(args=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_path", type=str, default="data/FB15k-237")
    parser.add_argument("--model", default="ComplEx", choices=["DistMult", "ComplEx"])
    parser.add_argument("-d", "--hidden_dim", default=500, type=int)
    parser.add_argument("-n", "--negative_sample_size", default=256, type=int)
    parser.add_argument("-b", "--batch_size", default=1024, type=int)
    parser.add_argument("-a", "--adversarial_temperature", default=1.0, type=float)
    parser.add_argument("-r", "--regularization", default=1e-6, type=float)
    parser.add_argument("-lr", "--learning_rate", default=1e-3, type=float)
    parser.add_argument("--max_steps", default=100000, type=int)
    parser.add_argument("--valid_steps", default=10000, type=int)
    parser.add_argument("--log_steps", default=100, type=int)
    parser.add_argument("-save", "--save_path", default="models/reciprocal", type=str)
    return parser.parse_args(args)


def read_dict(path):
    with open(path) as fin:
        return {e: int(i) for i, e in (line.strip().split("\t") for line in fin)}


def read_triple(path, entity2id, relation2id):
    with open(path) as fin:
        return [(entity2id[h], relation2id[r], entity2id[t])
                for h, r, t in (line.strip().split("\t") for line in fin)]


class TrainDataset(Dataset):
    def __init__(self, triples, nentity, negative_sample_size, mode):
        self.triples = triples
        self.nentity = nentity
        self.negative_sample_size = negative_sample_size
        self.mode = mode

    def __len__(self):
        return len(self.triples)

    def __getitem__(self, idx):
        positive = torch.LongTensor(self.triples[idx])
        negative = torch.randint(0, self.nentity, (self.negative_sample_size,))
        return positive, negative

    @staticmethod
    def collate_fn(data):
        return torch.stack([d[0] for d in data]), torch.stack([d[1] for d in data])


def one_shot_iterator(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for batch in loader:
            yield batch
        epoch += 1


class BidirectionalOneShotIterator:
    def __init__(self, head_loader, head_sampler, tail_loader, tail_sampler):
        self.iterator_head = one_shot_iterator(head_loader, head_sampler)
        self.iterator_tail = one_shot_iterator(tail_loader, tail_sampler)
        self.step = 0

    def __next__(self):
        self.step += 1
        if self.step % 2 == 0:
            return next(self.iterator_head) + ("head-batch",)
        return next(self.iterator_tail) + ("tail-batch",)


class ReciprocalKGE(nn.Module):
    def __init__(self, model_name, nentity, nrelation, hidden_dim):
        super().__init__()
        self.model_name = model_name
        width = hidden_dim * 2 if model_name == "ComplEx" else hidden_dim
        self.entity_embedding = nn.Parameter(torch.empty(nentity, width))
        self.relation_embedding = nn.Parameter(torch.empty(nrelation, width))
        self.inverse_relation_embedding = nn.Parameter(torch.empty(nrelation, width))
        for p in (self.entity_embedding, self.relation_embedding, self.inverse_relation_embedding):
            nn.init.xavier_uniform_(p)

    def query(self, anchor, rel, mode):
        e = self.entity_embedding[anchor]
        table = self.relation_embedding if mode == "tail-batch" else self.inverse_relation_embedding
        r = table[rel]
        if self.model_name == "DistMult":
            return e * r, (e, r)
        re_e, im_e = e.chunk(2, dim=-1)
        re_r, im_r = r.chunk(2, dim=-1)
        return torch.cat([re_e * re_r - im_e * im_r, re_e * im_r + im_e * re_r], dim=-1), (e, r)

    def forward(self, positive, negative, mode):
        if mode == "tail-batch":
            anchor, target = positive[:, 0], positive[:, 2]
        else:
            anchor, target = positive[:, 2], positive[:, 0]
        q, (e, r) = self.query(anchor, positive[:, 1], mode)
        pos_score = (q * self.entity_embedding[target]).sum(-1)
        neg_score = torch.einsum("bd,bkd->bk", q, self.entity_embedding[negative])
        reg = e.pow(2).mean() + r.pow(2).mean() + self.entity_embedding[target].pow(2).mean()
        return pos_score, neg_score, reg

    @torch.no_grad()
    def score_all(self, anchor, rel, mode):
        q, _ = self.query(anchor, rel, mode)
        return q @ self.entity_embedding.t()


@torch.no_grad()
def test_step(model, test_triples, all_true, device, args, rank, world):
    model.eval()
    part = test_triples[rank::world]
    logs = torch.zeros(5, device=device, dtype=torch.float64)
    for i in range(0, len(part), 128):
        batch = torch.LongTensor(part[i:i + 128]).to(device)
        for mode in ("tail-batch", "head-batch"):
            if mode == "tail-batch":
                anchor, target, key = batch[:, 0], batch[:, 2], all_true["tail"]
            else:
                anchor, target, key = batch[:, 2], batch[:, 0], all_true["head"]
            score = model.score_all(anchor, batch[:, 1], mode)
            gold = score.gather(1, target.unsqueeze(1))
            for j, (h, r, t) in enumerate(batch.tolist()):
                score[j, key[(h, r) if mode == "tail-batch" else (t, r)]] = -1e9
            ranking = (score > gold).sum(dim=1).double() + 1
            logs += torch.stack([(1.0 / ranking).sum(), ranking.sum(), (ranking <= 1).sum().double(),
                                 (ranking <= 10).sum().double(), ranking.new_tensor(len(ranking))])
    dist.all_reduce(logs)
    model.train()
    n = logs[4].item()
    return {"MRR": logs[0].item() / n, "MR": logs[1].item() / n, "HITS@1": logs[2].item() / n,
            "HITS@10": logs[3].item() / n}


def main(args):
    dist.init_process_group(backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(format="%(asctime)s %(levelname)-8s %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARNING)

    entity2id = read_dict(os.path.join(args.data_path, "entities.dict"))
    relation2id = read_dict(os.path.join(args.data_path, "relations.dict"))
    train = read_triple(os.path.join(args.data_path, "train.txt"), entity2id, relation2id)
    valid = read_triple(os.path.join(args.data_path, "valid.txt"), entity2id, relation2id)
    test = read_triple(os.path.join(args.data_path, "test.txt"), entity2id, relation2id)
    all_true = {"tail": {}, "head": {}}
    for h, r, t in train + valid + test:
        all_true["tail"].setdefault((h, r), []).append(t)
        all_true["head"].setdefault((t, r), []).append(h)

    loaders = {}
    for mode in ("head-batch", "tail-batch"):
        ds = TrainDataset(train, len(entity2id), args.negative_sample_size, mode)
        sampler = DistributedSampler(ds, shuffle=True)
        loaders[mode] = (DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                                    collate_fn=TrainDataset.collate_fn, drop_last=True), sampler)
    train_iterator = BidirectionalOneShotIterator(*loaders["head-batch"], *loaders["tail-batch"])

    kge_model = ReciprocalKGE(args.model, len(entity2id), len(relation2id), args.hidden_dim).to(device)
    model = DistributedDataParallel(kge_model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate)
    if rank == 0:
        os.makedirs(args.save_path, exist_ok=True)
        with open(os.path.join(args.save_path, "config.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
    logging.info("nentity=%d nrelation=%d #train=%d", len(entity2id), len(relation2id), len(train))

    best_mrr = 0.0
    for step in range(1, args.max_steps + 1):
        positive, negative, mode = next(train_iterator)
        positive, negative = positive.to(device), negative.to(device)
        pos_score, neg_score, reg = model(positive, negative, mode)
        weights = F.softmax(neg_score * args.adversarial_temperature, dim=1).detach()
        neg_loss = -(weights * F.logsigmoid(-neg_score)).sum(dim=1).mean()
        pos_loss = -F.logsigmoid(pos_score).mean()
        loss = (pos_loss + neg_loss) / 2 + args.regularization * reg
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        if step % args.log_steps == 0:
            logging.info("step %d %s loss %.4f (pos %.4f neg %.4f)", step, mode, loss.item(),
                         pos_loss.item(), neg_loss.item())
        if step % args.valid_steps == 0:
            metrics = test_step(kge_model, valid, all_true, device, args, rank, world)
            logging.info("valid at step %d: %s", step, metrics)
            if rank == 0 and metrics["MRR"] > best_mrr:
                best_mrr = metrics["MRR"]
                torch.save({"step": step, "model_state_dict": kge_model.state_dict(),
                            "optimizer_state_dict": optimizer.state_dict()},
                           os.path.join(args.save_path, "checkpoint"))
            dist.barrier()

    ckpt = torch.load(os.path.join(args.save_path, "checkpoint"), map_location=device)
    kge_model.load_state_dict(ckpt["model_state_dict"])
    logging.info("test (step %d): %s", ckpt["step"], test_step(kge_model, test, all_true, device, args, rank, world))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
