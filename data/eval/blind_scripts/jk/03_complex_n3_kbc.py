"""ComplEx-N3 (Lacroix et al. 2018) with 1-vs-all training and reciprocal relations.

Multi-GPU data parallel version of the kbc reference code.

    torchrun --nnodes=1 --nproc_per_node=4 03_complex_n3_kbc.py --dataset FB15K237 --rank 1000
"""
import argparse
import os
import pickle
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

DATA_ROOT = os.environ.get("KBC_DATA", "data/kbc")


def get_parser():
    parser = argparse.ArgumentParser("ComplEx-N3")
    parser.add_argument("--dataset", default="FB15K237", choices=["FB15K", "WN", "WN18RR", "FB15K237", "YAGO3-10"])
    parser.add_argument("--rank", type=int, default=1000, help="embedding rank (complex dim)")
    parser.add_argument("--init", type=float, default=1e-3)
    parser.add_argument("--reg", type=float, default=5e-2)
    parser.add_argument("--batch_size", type=int, default=250)
    parser.add_argument("--learning_rate", type=float, default=1e-1)
    parser.add_argument("--max_epochs", type=int, default=100)
    parser.add_argument("--valid", type=int, default=5, help="validate every N epochs")
    parser.add_argument("--eval_chunk", type=int, default=500)
    parser.add_argument("--out", default="out/complex_n3")
    return parser


class KBCDataset:
    def __init__(self, name):
        root = os.path.join(DATA_ROOT, name)
        self.data = {}
        for split in ("train", "valid", "test"):
            with open(os.path.join(root, split + ".pickle"), "rb") as f:
                self.data[split] = pickle.load(f).astype(np.int64)
        maxis = np.max(self.data["train"], axis=0)
        self.n_entities = int(max(maxis[0], maxis[2]) + 1)
        self.n_predicates = int(maxis[1] + 1) * 2
        with open(os.path.join(root, "to_skip.pickle"), "rb") as f:
            self.to_skip = pickle.load(f)

    def get_train(self):
        copy = np.copy(self.data["train"])
        tmp = np.copy(copy[:, 0])
        copy[:, 0] = copy[:, 2]
        copy[:, 2] = tmp
        copy[:, 1] += self.n_predicates // 2
        return np.vstack((self.data["train"], copy))

    def get_queries(self, split):
        """Both directions, as (lhs, rel, rhs) with reciprocal relation ids for the head side."""
        ex = self.data[split]
        inv = np.copy(ex[:, [2, 1, 0]])
        inv[:, 1] += self.n_predicates // 2
        return {"rhs": ex, "lhs": inv}


class ComplEx(nn.Module):
    def __init__(self, sizes, rank, init_size=1e-3):
        super().__init__()
        self.rank = rank
        self.embeddings = nn.ModuleList([nn.Embedding(s, 2 * rank) for s in sizes[:2]])
        self.embeddings[0].weight.data *= init_size
        self.embeddings[1].weight.data *= init_size

    def forward(self, x):
        lhs = self.embeddings[0](x[:, 0])
        rel = self.embeddings[1](x[:, 1])
        rhs = self.embeddings[0](x[:, 2])
        lhs = lhs[:, :self.rank], lhs[:, self.rank:]
        rel = rel[:, :self.rank], rel[:, self.rank:]
        rhs = rhs[:, :self.rank], rhs[:, self.rank:]
        to_score = self.embeddings[0].weight
        to_score = to_score[:, :self.rank], to_score[:, self.rank:]
        scores = ((lhs[0] * rel[0] - lhs[1] * rel[1]) @ to_score[0].t()
                  + (lhs[0] * rel[1] + lhs[1] * rel[0]) @ to_score[1].t())
        factors = (torch.sqrt(lhs[0] ** 2 + lhs[1] ** 2),
                   torch.sqrt(rel[0] ** 2 + rel[1] ** 2),
                   torch.sqrt(rhs[0] ** 2 + rhs[1] ** 2))
        return scores, factors


def n3(factors, weight):
    norm = 0
    for f in factors:
        norm += weight * torch.sum(torch.abs(f) ** 3)
    return norm / factors[0].shape[0]


@torch.no_grad()
def filtered_ranks(model, queries, to_skip, chunk, device):
    ranks = []
    for b in range(0, len(queries), chunk):
        q = torch.from_numpy(queries[b:b + chunk]).to(device)
        scores, _ = model(q)
        targets = scores.gather(1, q[:, 2:3])
        for i, (lhs, rel, rhs) in enumerate(queries[b:b + chunk].tolist()):
            skip = [e for e in to_skip[(lhs, rel)] if e != rhs]
            if skip:
                scores[i, skip] = -1e6
        ranks.append((1 + (scores > targets).sum(dim=1)).cpu().numpy())
    return np.concatenate(ranks) if ranks else np.zeros(0, dtype=np.int64)


def evaluate(model, dataset, split, chunk, device, rank, world):
    model.eval()
    sums = defaultdict(float)
    for side, queries in dataset.get_queries(split).items():
        skip = dataset.to_skip[side]
        r = filtered_ranks(model, queries[rank::world], skip, chunk, device).astype(np.float64)
        sums["rr"] += float((1.0 / r).sum())
        for k in (1, 3, 10):
            sums[f"h{k}"] += float((r <= k).sum())
        sums["n"] += float(len(r))
    stats = torch.tensor([sums["rr"], sums["h1"], sums["h3"], sums["h10"], sums["n"]], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    rr, h1, h3, h10, n = stats.tolist()
    return {"MRR": rr / n, "hits@1": h1 / n, "hits@3": h3 / n, "hits@10": h10 / n}


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    dataset = KBCDataset(args.dataset)
    train = torch.from_numpy(dataset.get_train())
    if is_main:
        print(f"{args.dataset}: {dataset.n_entities} entities, {dataset.n_predicates} predicates, "
              f"{len(train)} training examples (with reciprocals), world size {world}", flush=True)
        os.makedirs(args.out, exist_ok=True)

    torch.manual_seed(0)
    model = ComplEx((dataset.n_entities, dataset.n_predicates), args.rank, args.init).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=args.learning_rate)
    loss_fn = nn.CrossEntropyLoss(reduction="mean")

    sampler = DistributedSampler(TensorDataset(train), shuffle=True)
    loader = DataLoader(TensorDataset(train), batch_size=args.batch_size, sampler=sampler,
                        num_workers=2, pin_memory=True)

    best = 0.0
    for epoch in range(args.max_epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        tot = torch.zeros(2, device=device)
        for (batch,) in loader:
            batch = batch.to(device, non_blocking=True)
            preds, factors = model(batch)
            l_fit = loss_fn(preds, batch[:, 2])
            l_reg = n3(factors, args.reg)
            loss = l_fit + l_reg
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            tot += torch.stack([l_fit.detach() * batch.size(0), torch.tensor(float(batch.size(0)), device=device)])
        dist.all_reduce(tot)
        if is_main:
            print(f"epoch {epoch + 1} fit-loss {tot[0].item() / tot[1].item():.4f} "
                  f"({time.time() - tic:.0f}s)", flush=True)

        if (epoch + 1) % args.valid == 0:
            valid = evaluate(model.module, dataset, "valid", args.eval_chunk, device, rank, world)
            if is_main:
                print(f"  valid {valid}", flush=True)
                if valid["MRR"] > best:
                    best = valid["MRR"]
                    torch.save({"epoch": epoch + 1, "state_dict": model.module.state_dict(), "valid": valid},
                               os.path.join(args.out, f"{args.dataset}_best.pt"))
            dist.barrier()

    ckpt = torch.load(os.path.join(args.out, f"{args.dataset}_best.pt"), map_location=device)
    model.module.load_state_dict(ckpt["state_dict"])
    test = evaluate(model.module, dataset, "test", args.eval_chunk, device, rank, world)
    if is_main:
        print(f"test (epoch {ckpt['epoch']}): {test}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
