#!/usr/bin/env python3
"""RotatE with explicit inverse-relation embeddings on YAGO3-10.

Follows the KnowledgeGraphEmbedding codebase (TrainDataset / BidirectionalOneShotIterator,
subsampling weights, self-adversarial sampling), extended to multi-GPU with DDP.

    torchrun --nproc_per_node=4 11_rotate_inverse_yago.py -d data/YAGO3-10 -save models/RotatE_YAGO_inv
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("-d", "--data_path", required=True)
    p.add_argument("-save", "--save_path", required=True)
    p.add_argument("-n", "--negative_sample_size", type=int, default=400)
    p.add_argument("-dim", "--hidden_dim", type=int, default=500)
    p.add_argument("-g", "--gamma", type=float, default=24.0)
    p.add_argument("-a", "--adversarial_temperature", type=float, default=1.0)
    p.add_argument("-b", "--batch_size", type=int, default=256)
    p.add_argument("-lr", "--learning_rate", type=float, default=2e-4)
    p.add_argument("--max_steps", type=int, default=150000)
    p.add_argument("--valid_steps", type=int, default=10000)
    p.add_argument("--log_steps", type=int, default=1000)
    p.add_argument("--test_batch_size", type=int, default=4)
    p.add_argument("-cpu", "--cpu_num", type=int, default=4)
    return p.parse_args()


def read_triple(path, entity2id, relation2id):
    triples = []
    with open(path) as fin:
        for line in fin:
            h, r, t = line.strip().split("\t")
            triples.append((entity2id[h], relation2id[r], entity2id[t]))
    return triples


class TrainDataset(Dataset):
    def __init__(self, triples, nentity, negative_sample_size, mode):
        self.triples = triples
        self.nentity = nentity
        self.negative_sample_size = negative_sample_size
        self.mode = mode
        self.count = {}
        for h, r, t in triples:
            self.count[(h, r)] = self.count.get((h, r), 3) + 1
            self.count[(t, -r - 1)] = self.count.get((t, -r - 1), 3) + 1

    def __len__(self):
        return len(self.triples)

    def __getitem__(self, idx):
        h, r, t = self.triples[idx]
        weight = torch.sqrt(1 / torch.tensor([self.count[(h, r)] + self.count[(t, -r - 1)]], dtype=torch.float))
        neg = torch.randint(self.nentity, (self.negative_sample_size,))
        return torch.LongTensor((h, r, t)), neg, weight

    @staticmethod
    def collate_fn(data):
        pos = torch.stack([d[0] for d in data])
        neg = torch.stack([d[1] for d in data])
        w = torch.cat([d[2] for d in data])
        return pos, neg, w


class BidirectionalOneShotIterator:
    def __init__(self, head_loader, tail_loader):
        self.iters = [self._one_shot(head_loader, "head-batch"), self._one_shot(tail_loader, "tail-batch")]
        self.step = 0

    def __next__(self):
        self.step += 1
        return next(self.iters[self.step % 2])

    @staticmethod
    def _one_shot(loader, mode):
        epoch = 0
        while True:
            loader.sampler.set_epoch(epoch)
            for pos, neg, w in loader:
                yield pos, neg, w, mode
            epoch += 1


class KGEModel(nn.Module):
    def __init__(self, nentity, nrelation, hidden_dim, gamma):
        super().__init__()
        self.gamma = nn.Parameter(torch.Tensor([gamma]), requires_grad=False)
        self.embedding_range = nn.Parameter(torch.Tensor([(gamma + 2.0) / hidden_dim]), requires_grad=False)
        self.entity_embedding = nn.Embedding(nentity, hidden_dim * 2)
        self.relation_embedding = nn.Embedding(nrelation, hidden_dim)
        self.inverse_relation_embedding = nn.Embedding(nrelation, hidden_dim)
        for emb in (self.entity_embedding, self.relation_embedding, self.inverse_relation_embedding):
            nn.init.uniform_(emb.weight, -self.embedding_range.item(), self.embedding_range.item())

    def rotate(self, src, phase_emb, dst):
        phase = phase_emb / (self.embedding_range.item() / np.pi)
        re_s, im_s = torch.chunk(src, 2, dim=-1)
        re_d, im_d = torch.chunk(dst, 2, dim=-1)
        re = re_s * torch.cos(phase) - im_s * torch.sin(phase) - re_d
        im = re_s * torch.sin(phase) + im_s * torch.cos(phase) - im_d
        return self.gamma.item() - torch.stack([re, im]).norm(dim=0).sum(dim=-1)

    def forward(self, pos, neg, mode):
        if mode == "tail-batch":   # (h, r, ?) : rotate h by r
            src = self.entity_embedding(pos[:, 0]).unsqueeze(1)
            phase = self.relation_embedding(pos[:, 1]).unsqueeze(1)
            gold = self.entity_embedding(pos[:, 2]).unsqueeze(1)
        else:                      # (?, r, t) : rotate t by r^-1
            src = self.entity_embedding(pos[:, 2]).unsqueeze(1)
            phase = self.inverse_relation_embedding(pos[:, 1]).unsqueeze(1)
            gold = self.entity_embedding(pos[:, 0]).unsqueeze(1)
        positive = self.rotate(src, phase, gold).squeeze(1)
        negative = self.rotate(src, phase, self.entity_embedding(neg))
        return positive, negative

    @torch.no_grad()
    def predict(self, src_idx, rel_idx, mode):
        table = self.relation_embedding if mode == "tail-batch" else self.inverse_relation_embedding
        src = self.entity_embedding(src_idx).unsqueeze(1)
        return self.rotate(src, table(rel_idx).unsqueeze(1), self.entity_embedding.weight.unsqueeze(0))


@torch.no_grad()
def test_step(model, test_triples, all_true, args, device, rank, world):
    model.eval()
    mine = torch.LongTensor(test_triples[rank::world])
    logs = torch.zeros(5, dtype=torch.float64, device=device)
    for i in range(0, len(mine), args.test_batch_size):
        batch = mine[i:i + args.test_batch_size].to(device)
        for mode in ("head-batch", "tail-batch"):
            src = batch[:, 2] if mode == "head-batch" else batch[:, 0]
            gold = batch[:, 0] if mode == "head-batch" else batch[:, 2]
            score = model.predict(src, batch[:, 1], mode)
            gold_score = score.gather(1, gold.unsqueeze(1))
            for j, (h, r, t) in enumerate(batch.tolist()):
                key = ("h", r, t) if mode == "head-batch" else ("t", h, r)
                score[j, all_true[key]] = -float("inf")
            ranking = 1 + (score > gold_score).sum(1).double()
            logs += torch.stack([(1 / ranking).sum(), ranking.sum(), (ranking <= 1).sum().double(),
                                 (ranking <= 10).sum().double(), torch.tensor(float(len(ranking)), device=device).double()])
    dist.all_reduce(logs)
    return {"MRR": (logs[0] / logs[4]).item(), "MR": (logs[1] / logs[4]).item(),
            "HITS@1": (logs[2] / logs[4]).item(), "HITS@10": (logs[3] / logs[4]).item()}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(format="%(asctime)s %(levelname)-8s %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARNING)

    with open(os.path.join(args.data_path, "entities.dict")) as f:
        entity2id = {e: int(i) for i, e in (l.strip().split("\t") for l in f)}
    with open(os.path.join(args.data_path, "relations.dict")) as f:
        relation2id = {r: int(i) for i, r in (l.strip().split("\t") for l in f)}
    train = read_triple(os.path.join(args.data_path, "train.txt"), entity2id, relation2id)
    valid = read_triple(os.path.join(args.data_path, "valid.txt"), entity2id, relation2id)
    test = read_triple(os.path.join(args.data_path, "test.txt"), entity2id, relation2id)
    all_true = {}
    for h, r, t in train + valid + test:
        all_true.setdefault(("t", h, r), []).append(t)
        all_true.setdefault(("h", r, t), []).append(h)

    model = KGEModel(len(entity2id), len(relation2id), args.hidden_dim, args.gamma).to(device)
    ddp_model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(filter(lambda p: p.requires_grad, ddp_model.parameters()), lr=args.learning_rate)

    loaders = []
    for mode in ("head-batch", "tail-batch"):
        ds = TrainDataset(train, len(entity2id), args.negative_sample_size, mode)
        loaders.append(DataLoader(ds, batch_size=args.batch_size, sampler=DistributedSampler(ds, shuffle=True),
                                  num_workers=max(1, args.cpu_num // 2), collate_fn=TrainDataset.collate_fn,
                                  drop_last=True))
    train_iterator = BidirectionalOneShotIterator(*loaders)

    if rank == 0:
        os.makedirs(args.save_path, exist_ok=True)
        with open(os.path.join(args.save_path, "config.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    logs = torch.zeros(2, device=device)
    for step in range(1, args.max_steps + 1):
        ddp_model.train()
        pos, neg, weight, mode = next(train_iterator)
        pos, neg, weight = pos.to(device), neg.to(device), weight.to(device)
        positive, negative = ddp_model(pos, neg, mode)
        negative = (F.softmax(negative * args.adversarial_temperature, dim=1).detach()
                    * F.logsigmoid(-negative)).sum(dim=1)
        positive = F.logsigmoid(positive)
        loss = (-(weight * positive).sum() / weight.sum() - (weight * negative).sum() / weight.sum()) / 2
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        logs += torch.stack([loss.detach(), torch.ones((), device=device)])

        if step % args.log_steps == 0:
            dist.all_reduce(logs)
            logging.info("step %d: loss %.4f", step, (logs[0] / logs[1]).item())
            logs.zero_()
        if step % args.valid_steps == 0:
            metrics = test_step(model, valid, all_true, args, device, rank, world)
            logging.info("valid @%d %s", step, metrics)
            if rank == 0:
                torch.save({"step": step, "model_state_dict": model.state_dict(),
                            "optimizer_state_dict": optimizer.state_dict()},
                           os.path.join(args.save_path, "checkpoint"))
            dist.barrier()

    logging.info("test %s", test_step(model, test, all_true, args, device, rank, world))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
