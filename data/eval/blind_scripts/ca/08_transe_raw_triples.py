"""TransE trainer that works directly on raw (string) triple files.

Input: a directory with train.tsv / valid.tsv / test.tsv, each line
"head<TAB>relation<TAB>tail" using whatever identifiers the source uses
(Freebase mids, Wikidata Q-ids, ...). The vocab is written next to the
checkpoint so the embeddings can be looked up later.

    torchrun --nproc_per_node=4 08_transe_raw_triples.py --data data/fb15k237_raw --out runs/transe_raw
"""
import argparse
import csv
import json
import logging
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

logging.basicConfig(format="%(asctime)s | %(message)s", level=logging.INFO)
logger = logging.getLogger("transe")


def read_tsv(path):
    with open(path, newline="") as f:
        return [tuple(row[:3]) for row in csv.reader(f, delimiter="\t") if len(row) >= 3]


def build_vocab(*splits):
    entities, relations = set(), set()
    for split in splits:
        for h, r, t in split:
            entities.add(h)
            entities.add(t)
            relations.add(r)
    ent2id = {e: i for i, e in enumerate(entities)}
    rel2id = {r: i for i, r in enumerate(relations)}
    return ent2id, rel2id


def encode(split, ent2id, rel2id):
    return torch.tensor([[ent2id[h], rel2id[r], ent2id[t]] for h, r, t in split],
                        dtype=torch.long)


class TransE(nn.Module):
    def __init__(self, num_entities, num_relations, dim, margin, norm=2):
        super().__init__()
        self.entity = nn.Embedding(num_entities, dim)
        self.relation = nn.Embedding(num_relations, dim)
        nn.init.xavier_uniform_(self.entity.weight)
        nn.init.xavier_uniform_(self.relation.weight)
        self.margin = margin
        self.norm = norm

    def distance(self, h, r, t):
        return torch.norm(h + r - t, p=self.norm, dim=-1)

    def forward(self, pos, neg):
        d_pos = self.distance(self.entity(pos[:, 0]), self.relation(pos[:, 1]), self.entity(pos[:, 2]))
        d_neg = self.distance(self.entity(neg[..., 0]), self.relation(neg[..., 1]),
                              self.entity(neg[..., 2]))
        return F.relu(self.margin + d_pos.unsqueeze(1) - d_neg).mean()

    @torch.no_grad()
    def predict_tails(self, h, r):
        q = self.entity(h) + self.relation(r)
        return -torch.cdist(q, self.entity.weight, p=self.norm)

    @torch.no_grad()
    def predict_heads(self, r, t):
        q = self.entity(t) - self.relation(r)
        return -torch.cdist(q, self.entity.weight, p=self.norm)


def sample_negatives(pos, num_entities, k):
    neg = pos.unsqueeze(1).repeat(1, k, 1)
    rand = torch.randint(num_entities, neg.shape[:2], device=pos.device)
    head = torch.rand(neg.shape[:2], device=pos.device) < 0.5
    neg[..., 0] = torch.where(head, rand, neg[..., 0])
    neg[..., 2] = torch.where(head, neg[..., 2], rand)
    return neg


@torch.no_grad()
def link_prediction(model, triples, all_true, device, rank, world, bs=200):
    hr_index, rt_index = {}, {}
    for h, r, t in all_true.tolist():
        hr_index.setdefault((h, r), []).append(t)
        rt_index.setdefault((r, t), []).append(h)
    part = triples[rank::world].to(device)
    stats = torch.zeros(4, device=device)
    for s in range(0, part.size(0), bs):
        b = part[s:s + bs]
        for side in ("tail", "head"):
            if side == "tail":
                scores, gold = model.predict_tails(b[:, 0], b[:, 1]), b[:, 2]
                keys, index = [(h, r) for h, r, _ in b.tolist()], hr_index
            else:
                scores, gold = model.predict_heads(b[:, 1], b[:, 2]), b[:, 0]
                keys, index = [(r, t) for _, r, t in b.tolist()], rt_index
            gold_score = scores.gather(1, gold[:, None]).clone()
            for i, key in enumerate(keys):
                scores[i, index[key]] = float("-inf")
            scores.scatter_(1, gold[:, None], gold_score)
            ranks = (scores > gold_score).sum(1).float() + 1
            stats += torch.stack([(1 / ranks).sum(), (ranks <= 1).float().sum(),
                                  (ranks <= 10).float().sum(), ranks.new_tensor(len(ranks))])
    dist.all_reduce(stats)
    return {"MRR": (stats[0] / stats[3]).item(), "Hits@1": (stats[1] / stats[3]).item(),
            "Hits@10": (stats[2] / stats[3]).item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--margin", type=float, default=5.0)
    ap.add_argument("--neg", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--eval_every", type=int, default=20)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank != 0:
        logger.setLevel(logging.WARNING)

    raw = {s: read_tsv(os.path.join(args.data, f"{s}.tsv")) for s in ("train", "valid", "test")}
    ent2id, rel2id = build_vocab(raw["train"], raw["valid"], raw["test"])
    train, valid, test = (encode(raw[s], ent2id, rel2id) for s in ("train", "valid", "test"))
    all_true = torch.cat([train, valid, test])
    logger.info("%d entities, %d relations, %d train triples", len(ent2id), len(rel2id), len(train))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "vocab.json"), "w") as f:
            json.dump({"entities": ent2id, "relations": rel2id}, f)

    ds = TensorDataset(train)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, drop_last=True,
                        num_workers=2, pin_memory=True)

    model = TransE(len(ent2id), len(rel2id), args.dim, args.margin).to(device)
    ddp_model = DistributedDataParallel(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(ddp_model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    best_mrr = 0.0
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        ddp_model.train()
        epoch_loss = torch.zeros((), device=device)
        for (pos,) in loader:
            pos = pos.to(device, non_blocking=True)
            neg = sample_negatives(pos, len(ent2id), args.neg)
            loss = ddp_model(pos, neg)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            epoch_loss += loss.detach()
        scheduler.step()
        dist.all_reduce(epoch_loss, op=dist.ReduceOp.AVG)
        logger.info("epoch %d loss %.4f lr %.2e", epoch, epoch_loss.item() / len(loader),
                    scheduler.get_last_lr()[0])

        if epoch % args.eval_every == 0:
            ddp_model.eval()
            metrics = link_prediction(model, valid, all_true, device, rank, world)
            logger.info("valid %s", json.dumps({k: round(v, 4) for k, v in metrics.items()}))
            if metrics["MRR"] > best_mrr:
                best_mrr = metrics["MRR"]
                if rank == 0:
                    torch.save({"state_dict": model.state_dict(), "epoch": epoch,
                                "valid": metrics}, os.path.join(args.out, "model_best.pt"))
            dist.barrier()

    ckpt = torch.load(os.path.join(args.out, "model_best.pt"), map_location=device)
    model.load_state_dict(ckpt["state_dict"])
    metrics = link_prediction(model, test, all_true, device, rank, world)
    logger.info("test (epoch %d) %s", ckpt["epoch"], metrics)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
