"""ComplEx-N3 with reciprocal relations, 1-vs-all cross entropy (Lacroix et al. 2018).

Tail queries (h, r, ?) use the relation table, head queries (?, r, t) are
answered as tail queries of the inverse relation, which has its own table.
Training alternates the two directions step by step.

    torchrun --nproc_per_node=8 02_complex_reciprocal_1vsall.py --data data/FB15k-237
"""
import argparse
import logging
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger(__name__)


def get_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="folder with entities.dict, relations.dict, {train,valid,test}.txt")
    ap.add_argument("--save_dir", default="checkpoints/complex_n3")
    ap.add_argument("--rank_dim", type=int, default=1000, help="complex rank (embedding size is 2x)")
    ap.add_argument("--init_scale", type=float, default=1e-3)
    ap.add_argument("--reg", type=float, default=5e-2, help="N3 weight")
    ap.add_argument("--batch_size", type=int, default=100, help="per process")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--max_epochs", type=int, default=100)
    ap.add_argument("--valid_every", type=int, default=5)
    ap.add_argument("--resume", default=None)
    return ap.parse_args()


def read_dict(path):
    out = {}
    with open(path) as f:
        for line in f:
            idx, name = line.rstrip("\n").split("\t")
            out[name] = int(idx)
    return out


def read_split(path, e2id, r2id):
    rows = []
    with open(path) as f:
        for line in f:
            h, r, t = line.rstrip("\n").split("\t")
            rows.append((e2id[h], r2id[r], e2id[t]))
    return torch.tensor(rows, dtype=torch.long)


class ComplEx(nn.Module):
    def __init__(self, n_ent, n_rel, rank, init_scale):
        super().__init__()
        self.rank = rank
        self.ent = nn.Embedding(n_ent, 2 * rank)
        self.rel = nn.Embedding(n_rel, 2 * rank)
        self.rel_inv = nn.Embedding(n_rel, 2 * rank)
        for emb in (self.ent, self.rel, self.rel_inv):
            emb.weight.data.mul_(init_scale)

    def _split(self, x):
        return x[..., :self.rank], x[..., self.rank:]

    def forward(self, anchor, rel, side):
        """Scores of (anchor, rel, ?) against all entities; side picks the relation table."""
        a = self.ent(anchor)
        r = self.rel(rel) if side == "tail" else self.rel_inv(rel)
        a_re, a_im = self._split(a)
        r_re, r_im = self._split(r)
        e_re, e_im = self._split(self.ent.weight)
        q_re = a_re * r_re - a_im * r_im
        q_im = a_re * r_im + a_im * r_re
        scores = q_re @ e_re.t() + q_im @ e_im.t()
        factors = (torch.sqrt(a_re ** 2 + a_im ** 2),
                   torch.sqrt(r_re ** 2 + r_im ** 2))
        return scores, factors


def n3(factors, target_emb, rank):
    t_re, t_im = target_emb[..., :rank], target_emb[..., rank:]
    norms = list(factors) + [torch.sqrt(t_re ** 2 + t_im ** 2)]
    return sum(torch.sum(torch.abs(f) ** 3) for f in norms) / target_emb.shape[0]


@torch.no_grad()
def filtered_ranks(model, triples, known_tails, known_heads, device, chunk=500):
    ranks = []
    for side in ("tail", "head"):
        for i in range(0, len(triples), chunk):
            b = triples[i:i + chunk].to(device)
            anchor, target = (b[:, 0], b[:, 2]) if side == "tail" else (b[:, 2], b[:, 0])
            scores, _ = model(anchor, b[:, 1], side)
            tgt = scores.gather(1, target[:, None]).clone()
            for j, (h, r, t) in enumerate(b.tolist()):
                filt = known_tails[(h, r)] if side == "tail" else known_heads[(t, r)]
                scores[j, filt] = -1e6
            ranks.append((scores >= tgt).sum(1) + 1)
    return torch.cat(ranks).float()


def evaluate(model, triples, known, device, rank, world):
    # strided slice per rank, then sum/count all-reduce (slices may differ by one)
    part = triples[rank::world]
    r = filtered_ranks(model, part, known[0], known[1], device)
    agg = torch.stack([(1.0 / r).sum(), (r <= 1).sum().float(), (r <= 3).sum().float(),
                       (r <= 10).sum().float(), torch.tensor(float(r.numel()), device=device)])
    dist.all_reduce(agg, op=dist.ReduceOp.SUM)
    n = agg[4]
    return {"MRR": (agg[0] / n).item(), "H@1": (agg[1] / n).item(),
            "H@3": (agg[2] / n).item(), "H@10": (agg[3] / n).item()}


def main():
    args = get_args()
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank{rank}] %(asctime)s %(message)s")

    e2id = read_dict(os.path.join(args.data, "entities.dict"))
    r2id = read_dict(os.path.join(args.data, "relations.dict"))
    train, valid, test = (read_split(os.path.join(args.data, f"{s}.txt"), e2id, r2id)
                          for s in ("train", "valid", "test"))
    known_tails, known_heads = {}, {}
    for h, r, t in torch.cat([train, valid, test]).tolist():
        known_tails.setdefault((h, r), []).append(t)
        known_heads.setdefault((t, r), []).append(h)

    torch.manual_seed(0)
    model = ComplEx(len(e2id), len(r2id), args.rank_dim, args.init_scale).to(device)
    # each step uses only one of rel / rel_inv
    ddp = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.Adagrad(ddp.parameters(), lr=args.lr)

    start_epoch, best = 0, -1.0
    if args.resume:
        state = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start_epoch, best = state["epoch"] + 1, state["best"]
        log.info("resumed from %s at epoch %d", args.resume, start_epoch)

    ds = TensorDataset(train)
    sampler = DistributedSampler(ds, shuffle=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        num_workers=2, pin_memory=True)
    log.info("%d entities, %d relations, %d train triples, %d steps/epoch/rank",
             len(e2id), len(r2id), len(train), len(loader))

    step = 0
    for epoch in range(start_epoch, args.max_epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        running = 0.0
        for (batch,) in loader:
            batch = batch.to(device, non_blocking=True)
            side = "tail" if step % 2 == 0 else "head"
            anchor, target = (batch[:, 0], batch[:, 2]) if side == "tail" else (batch[:, 2], batch[:, 0])
            scores, factors = ddp(anchor, batch[:, 1], side)
            loss = F.cross_entropy(scores, target)
            loss = loss + args.reg * n3(factors, model.ent(target), args.rank_dim)
            opt.zero_grad()
            loss.backward()
            opt.step()
            running += loss.item()
            step += 1
        log.info("epoch %d  loss %.4f", epoch, running / len(loader))

        if (epoch + 1) % args.valid_every == 0:
            model.eval()
            m = evaluate(model, valid, (known_tails, known_heads), device, rank, world)
            log.info("valid %s", " ".join(f"{k}={v:.4f}" for k, v in m.items()))
            if rank == 0:
                os.makedirs(args.save_dir, exist_ok=True)
                state = {"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                         "best": max(best, m["MRR"])}
                torch.save(state, os.path.join(args.save_dir, "last.pt"))
                if m["MRR"] > best:
                    torch.save(state, os.path.join(args.save_dir, "best.pt"))
            best = max(best, m["MRR"])
            dist.barrier()

    state = torch.load(os.path.join(args.save_dir, "best.pt"), map_location="cpu")
    model.load_state_dict(state["model"])
    model.eval()
    m = evaluate(model, test, (known_tails, known_heads), device, rank, world)
    log.info("test %s", " ".join(f"{k}={v:.4f}" for k, v in m.items()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
