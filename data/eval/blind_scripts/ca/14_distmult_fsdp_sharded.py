"""DistMult with FSDP-sharded embedding tables.

For KGs with tens of millions of entities the entity table (and Adagrad
state) does not fit on one GPU when replicated, so we shard it with FSDP
(FULL_SHARD). Filtered evaluation needs the full table; we gather it
temporarily with summon_full_params.

    torchrun --nproc_per_node=8 14_distmult_fsdp_sharded.py --data /data/kg/wikikg90m_sub --dim 200
"""
import argparse
import functools
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullStateDictConfig, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class DistMult(nn.Module):
    def __init__(self, num_ent, num_rel, dim):
        super().__init__()
        self.entity = nn.Embedding(num_ent, dim)
        self.relation = nn.Embedding(num_rel, dim)
        nn.init.normal_(self.entity.weight, std=0.01)
        nn.init.normal_(self.relation.weight, std=0.01)

    def forward(self, h, r, t, neg):
        q = self.entity(h) * self.relation(r)
        pos = (q * self.entity(t)).sum(-1, keepdim=True)
        negs = torch.bmm(self.entity(neg), q.unsqueeze(-1)).squeeze(-1)
        logits = torch.cat([pos, negs], dim=1)
        reg = (self.entity(h).pow(2).sum(-1) + self.entity(t).pow(2).sum(-1)
               + self.relation(r).pow(2).sum(-1)).mean()
        return logits, reg


def load_arrays(root):
    out = {}
    for s in ("train", "valid", "test"):
        out[s] = torch.from_numpy(np.load(os.path.join(root, f"{s}_hrt.npy")).astype(np.int64))
    meta = np.load(os.path.join(root, "meta.npz"))
    return out, int(meta["num_entities"]), int(meta["num_relations"])


def build_filter(all_triples):
    key = all_triples[:, 0] * 100_000 + all_triples[:, 1]
    order = torch.argsort(key)
    return key[order].contiguous(), all_triples[order, 2].contiguous()


@torch.no_grad()
def evaluate(model, triples, fkeys, ftails, device, rank, world, chunk=128):
    mine = triples[rank::world].to(device)
    acc = torch.zeros(4, dtype=torch.float64, device=device)
    model.eval()
    with FSDP.summon_full_params(model, writeback=False):
        E = model.entity.weight
        R = model.relation.weight
        for s in range(0, mine.size(0), chunk):
            b = mine[s:s + chunk]
            sc = (E[b[:, 0]] * R[b[:, 1]]) @ E.t()
            gold = sc.gather(1, b[:, 2:3]).clone()
            q = b[:, 0] * 100_000 + b[:, 1]
            lo = torch.searchsorted(fkeys, q).tolist()
            hi = torch.searchsorted(fkeys, q, right=True).tolist()
            for i in range(b.size(0)):
                sc[i, ftails[lo[i]:hi[i]]] = float("-inf")
            sc.scatter_(1, b[:, 2:3], gold)
            rk = (sc > gold).sum(1).double() + 1
            acc[0] += (1 / rk).sum()
            acc[1] += (rk <= 1).sum()
            acc[2] += (rk <= 10).sum()
            acc[3] += rk.numel()
    model.train()
    dist.all_reduce(acc)
    return {"mrr": (acc[0] / acc[3]).item(), "hits@1": (acc[1] / acc[3]).item(),
            "hits@10": (acc[2] / acc[3]).item()}


def save_full_checkpoint(model, path, rank):
    if rank == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        torch.save(state, path)
        print(f"saved {path}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="ckpt/distmult_fsdp")
    ap.add_argument("--dim", type=int, default=200)
    ap.add_argument("--batch_size", type=int, default=8192)
    ap.add_argument("--neg", type=int, default=512)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--reg", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--eval_size", type=int, default=10000)
    ap.add_argument("--bf16", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    data, n_ent, n_rel = load_arrays(args.data)
    fkeys, ftails = build_filter(torch.cat([data["train"], data["valid"], data["test"]]))
    fkeys, ftails = fkeys.to(device), ftails.to(device)
    valid = data["valid"][:args.eval_size]

    torch.manual_seed(0)
    # materialise on CPU; FSDP moves each rank's shard to its GPU
    model = DistMult(n_ent, n_rel, args.dim)
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                        buffer_dtype=torch.float32) if args.bf16 else None
    model = FSDP(model, device_id=local_rank, sharding_strategy=ShardingStrategy.FULL_SHARD,
                 mixed_precision=mp, use_orig_params=True, sync_module_states=True)
    opt = torch.optim.Adagrad(model.parameters(), lr=args.lr)

    ds = TensorDataset(data["train"])
    sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        num_workers=4, pin_memory=True)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (x,) in enumerate(loader):
            x = x.to(device, non_blocking=True)
            neg = torch.randint(0, n_ent, (x.size(0), args.neg), device=device)
            logits, reg = model(x[:, 0], x[:, 1], x[:, 2], neg)
            target = torch.zeros(x.size(0), dtype=torch.long, device=device)
            loss = F.cross_entropy(logits.float(), target) + args.reg * reg
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} it {it}/{len(loader)} loss {loss.item():.4f} "
                      f"({time.time() - t0:.0f}s)", flush=True)

        m = evaluate(model, valid, fkeys, ftails, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} valid {m}", flush=True)
        if m["mrr"] > best:
            best = m["mrr"]
            save_full_checkpoint(model, os.path.join(args.out, "best.pt"), rank)
        dist.barrier()

    m = evaluate(model, data["test"], fkeys, ftails, device, rank, world)
    if rank == 0:
        print(f"final-model test {m}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
