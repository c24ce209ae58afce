"""ComplEx on ogbl-wikikg2 with the entity table sharded by FSDP.

2.5M entities x 2*250 floats plus Adam state does not fit comfortably next to
activations when replicated on every GPU, so parameters and optimizer state are sharded
with FullyShardedDataParallel (one FSDP unit per embedding table).

    torchrun --nproc_per_node=8 12_fsdp_complex_wikikg2.py --root /data/ogb --out ckpt/wikikg2_complex
"""
import argparse
import functools
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from ogb.linkproppred import Evaluator, LinkPropPredDataset
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP, StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/ogb")
    p.add_argument("--out", default="ckpt/wikikg2_complex")
    p.add_argument("--dim", type=int, default=250)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--neg", type=int, default=128, help="negatives per positive, shared in chunks")
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--reg", type=float, default=1e-6)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--eval_batch", type=int, default=64)
    p.add_argument("--eval_every", type=int, default=2)
    return p.parse_args()


class ComplEx(nn.Module):
    def __init__(self, n_ent, n_rel, dim):
        super().__init__()
        self.entity = nn.Embedding(n_ent, 2 * dim)
        self.relation = nn.Embedding(n_rel, 2 * dim)
        nn.init.uniform_(self.entity.weight, -0.01, 0.01)
        nn.init.uniform_(self.relation.weight, -0.01, 0.01)

    @staticmethod
    def _score(h, r, t):
        hr, hi = h.chunk(2, -1)
        rr, ri = r.chunk(2, -1)
        tr, ti = t.chunk(2, -1)
        return ((hr * rr - hi * ri) * tr + (hr * ri + hi * rr) * ti).sum(-1)

    def forward(self, h, r, t, cand=None, corrupt="tail"):
        """Training: cand=[C, K] shared negatives per chunk. Eval: cand=[B, K] per-query candidates."""
        eh, er, et = self.entity(h), self.relation(r), self.entity(t)
        pos = self._score(eh, er, et)
        if cand is None:
            return pos
        ec = self.entity(cand)
        if ec.size(0) != eh.size(0):            # chunked negatives: [C, K, d] -> [B, K, d]
            ec = ec.repeat_interleave(eh.size(0) // ec.size(0), dim=0)
        if corrupt == "tail":
            neg = self._score(eh.unsqueeze(1), er.unsqueeze(1), ec)
        else:
            neg = self._score(ec, er.unsqueeze(1), et.unsqueeze(1))
        reg = eh.pow(2).sum() + er.pow(2).sum() + et.pow(2).sum()
        return pos, neg, reg


def save_model(model, path, rank):
    if rank == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        torch.save(state, path)


@torch.no_grad()
def evaluate(model, split, evaluator, device, rank, world, bs):
    model.eval()
    n = split["head"].shape[0]
    per_rank = math.ceil(n / world)
    lo, hi = rank * per_rank, min(n, (rank + 1) * per_rank)
    idx = torch.arange(lo, max(lo, hi))
    n_batches = math.ceil(per_rank / bs)      # the same on every rank: FSDP forwards are collective
    h_all = torch.from_numpy(split["head"])
    r_all = torch.from_numpy(split["relation"])
    t_all = torch.from_numpy(split["tail"])
    hn_all = torch.from_numpy(split["head_neg"])
    tn_all = torch.from_numpy(split["tail_neg"])
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    for b in range(n_batches):
        sel = idx[b * bs:(b + 1) * bs]
        valid = sel.numel()
        if valid == 0:
            sel = torch.zeros(1, dtype=torch.long)    # dummy query, result is dropped
        h, r, t = h_all[sel].to(device), r_all[sel].to(device), t_all[sel].to(device)
        pos, neg_t, _ = model(h, r, t, tn_all[sel].to(device), corrupt="tail")
        _, neg_h, _ = model(h, r, t, hn_all[sel].to(device), corrupt="head")
        if valid == 0:
            continue
        for neg in (neg_t, neg_h):
            res = evaluator.eval({"y_pred_pos": pos, "y_pred_neg": neg})
            sums[0] += res["mrr_list"].sum()
            sums[1] += res["hits@1_list"].sum()
            sums[2] += res["hits@10_list"].sum()
            sums[3] += valid
    dist.all_reduce(sums)
    return {"mrr": (sums[0] / sums[3]).item(), "hits@1": (sums[1] / sums[3]).item(),
            "hits@10": (sums[2] / sums[3]).item()}


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    dataset = LinkPropPredDataset(name="ogbl-wikikg2", root=args.root)
    split_edge = dataset.get_edge_split()
    evaluator = Evaluator(name="ogbl-wikikg2")
    train = split_edge["train"]
    n_ent = int(dataset.graph["num_nodes"])
    n_rel = int(train["relation"].max()) + 1
    triples = torch.from_numpy(np.stack([train["head"], train["relation"], train["tail"]], axis=1)).long()
    if rank == 0:
        print(f"wikikg2: {n_ent} entities, {n_rel} relations, {len(triples)} train triples", flush=True)
        os.makedirs(args.out, exist_ok=True)

    torch.manual_seed(0)
    model = FSDP(ComplEx(n_ent, n_rel, args.dim),
                 auto_wrap_policy=ModuleWrapPolicy({nn.Embedding}),
                 device_id=local_rank, sync_module_states=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    ds = TensorDataset(triples)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, drop_last=True, num_workers=4, pin_memory=True)
    n_chunks = args.batch // args.chunk

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic, agg = time.time(), torch.zeros(2, device=device)
        for step, (b,) in enumerate(loader):
            b = b.to(device, non_blocking=True)
            cand = torch.randint(0, n_ent, (n_chunks, args.neg), device=device)
            corrupt = "tail" if step % 2 == 0 else "head"
            pos, neg, reg = model(b[:, 0], b[:, 1], b[:, 2], cand, corrupt=corrupt)
            loss = -(F.logsigmoid(pos).mean() + F.logsigmoid(-neg).mean()) / 2 + args.reg * reg / b.size(0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            agg += torch.stack([loss.detach(), torch.ones((), device=device)])
            if rank == 0 and step % 1000 == 0:
                print(f"  epoch {epoch} step {step}/{len(loader)} loss {loss.item():.4f}", flush=True)
        dist.all_reduce(agg)
        if rank == 0:
            print(f"epoch {epoch} mean loss {(agg[0] / agg[1]).item():.4f} ({time.time() - tic:.0f}s)", flush=True)

        if (epoch + 1) % args.eval_every == 0:
            res = evaluate(model, split_edge["valid"], evaluator, device, rank, world, args.eval_batch)
            if rank == 0:
                print(f"valid epoch {epoch}: {res}", flush=True)
            if res["mrr"] > best:
                best = res["mrr"]
                save_model(model, os.path.join(args.out, "best_model.pt"), rank)
            dist.barrier()

    res = evaluate(model, split_edge["test"], evaluator, device, rank, world, args.eval_batch)
    if rank == 0:
        print(f"test (last epoch): {res}", flush=True)
    save_model(model, os.path.join(args.out, "last_model.pt"), rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
