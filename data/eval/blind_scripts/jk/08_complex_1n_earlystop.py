"""ComplEx, 1-N scoring with reciprocal relations, early stopping on validation MRR.

Multi-GPU with torchrun; per-relation breakdown of the validation ranks is written to
TensorBoard by rank 0.

    torchrun --nproc_per_node=4 08_complex_1n_earlystop.py --data data/codex-m --logdir tb/complex_codexm
"""
import argparse
import os
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/codex-m")
    p.add_argument("--logdir", default="tb/complex")
    p.add_argument("--ckpt", default="ckpt/complex_best.pt")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--reg", type=float, default=1e-2)
    p.add_argument("--label_smoothing", type=float, default=0.1)
    p.add_argument("--max_epochs", type=int, default=400)
    p.add_argument("--patience", type=int, default=5, help="evaluations without improvement")
    p.add_argument("--eval_every", type=int, default=5)
    return p.parse_args()


def read(path):
    with open(path) as f:
        return [tuple(l.split()) for l in f if l.strip()]


class ComplEx(nn.Module):
    def __init__(self, n_ent, n_rel, dim):
        super().__init__()
        self.dim = dim
        self.ent = nn.Embedding(n_ent, 2 * dim)
        self.rel = nn.Embedding(2 * n_rel, 2 * dim)  # second half: reciprocal relations
        nn.init.normal_(self.ent.weight, std=1e-3)
        nn.init.normal_(self.rel.weight, std=1e-3)

    def query(self, s, r):
        a, b = self.ent(s).chunk(2, -1)
        c, d = self.rel(r).chunk(2, -1)
        return torch.cat([a * c - b * d, a * d + b * c], -1), (a, b, c, d)

    def forward(self, s, r):
        q, factors = self.query(s, r)
        scores = q @ self.ent.weight.t()
        return scores, factors

    @torch.no_grad()
    def score_all(self, s, r):
        q, _ = self.query(s, r)
        return q @ self.ent.weight.t()


def gather_variable(t, world):
    """all_gather for 1-D tensors whose length differs between ranks."""
    n = torch.tensor([t.numel()], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    sizes = [int(s.item()) for s in sizes]
    padded = torch.zeros(max(sizes), dtype=t.dtype, device=t.device)
    padded[:t.numel()] = t
    out = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return torch.cat([o[:s] for o, s in zip(out, sizes)])


@torch.no_grad()
def evaluate(net, queries, answers, rank, world, device, bs=1024):
    """queries: [N, 3] (s, r, o) incl. reciprocal rows. Returns ranks of all ranks' queries (on every rank)."""
    net.eval()
    mine = queries[rank::world]
    ranks, rels = [], []
    for i in range(0, len(mine), bs):
        q = mine[i:i + bs].to(device)
        scores = net.score_all(q[:, 0], q[:, 1])
        gold = scores.gather(1, q[:, 2:3])
        rows, cols = [], []
        for j, (s, r) in enumerate(q[:, :2].tolist()):
            objs = answers[(s, r)]
            rows.extend([j] * len(objs))
            cols.extend(objs)
        scores[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = float("-inf")
        ranks.append(1 + (scores > gold).sum(1))
        rels.append(q[:, 1])
    ranks = torch.cat(ranks) if ranks else torch.zeros(0, dtype=torch.long, device=device)
    rels = torch.cat(rels) if rels else torch.zeros(0, dtype=torch.long, device=device)
    return gather_variable(ranks, world).double(), gather_variable(rels, world)


def main():
    args = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    raw = {s: read(os.path.join(args.data, f"{s}.txt")) for s in ("train", "valid", "test")}
    # sorted() so that every process assigns the same ids
    entities = sorted({e for rows in raw.values() for h, _, t in rows for e in (h, t)})
    relations = sorted({r for rows in raw.values() for _, r, _ in rows})
    e2i = {e: i for i, e in enumerate(entities)}
    r2i = {r: i for i, r in enumerate(relations)}
    nr = len(relations)

    def with_reciprocals(rows):
        x = torch.tensor([[e2i[h], r2i[r], e2i[t]] for h, r, t in rows])
        inv = torch.stack([x[:, 2], x[:, 1] + nr, x[:, 0]], 1)
        return torch.cat([x, inv])

    data = {s: with_reciprocals(rows) for s, rows in raw.items()}
    answers = defaultdict(list)
    for s, r, o in torch.cat(list(data.values())).tolist():
        answers[(s, r)].append(o)

    torch.manual_seed(7)
    model = ComplEx(len(entities), nr, args.dim).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adagrad(ddp.parameters(), lr=args.lr)

    ds = TensorDataset(data["train"])
    sampler = DistributedSampler(ds, shuffle=True)
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=2, pin_memory=True)
    writer = SummaryWriter(args.logdir) if rank == 0 else None

    best, bad_evals = -1.0, 0
    for epoch in range(args.max_epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.time()
        agg = torch.zeros(2, device=device)
        for (b,) in loader:
            b = b.to(device, non_blocking=True)
            scores, (a, bb, c, d) = ddp(b[:, 0], b[:, 1])
            fit = F.cross_entropy(scores, b[:, 2], label_smoothing=args.label_smoothing)
            n3 = sum((x.abs() ** 3).sum() for x in (torch.sqrt(a ** 2 + bb ** 2), torch.sqrt(c ** 2 + d ** 2)))
            loss = fit + args.reg * n3 / b.size(0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            agg += torch.stack([fit.detach(), torch.ones((), device=device)])
        dist.all_reduce(agg)
        if writer:
            writer.add_scalar("train/fit_loss", (agg[0] / agg[1]).item(), epoch)
            writer.add_scalar("train/epoch_time", time.time() - t0, epoch)

        if (epoch + 1) % args.eval_every:
            continue
        ranks, rels = evaluate(model, data["valid"], answers, rank, world, device)
        mrr = (1 / ranks).mean().item()
        stop = torch.zeros(1, device=device)
        if rank == 0:
            writer.add_scalar("valid/mrr", mrr, epoch)
            writer.add_scalar("valid/hits@10", (ranks <= 10).double().mean().item(), epoch)
            for r in range(2 * nr):
                sel = ranks[rels == r]
                if sel.numel() >= 20:
                    writer.add_scalar(f"valid_rel/{relations[r % nr]}{'^-1' if r >= nr else ''}",
                                      (1 / sel).mean().item(), epoch)
            print(f"epoch {epoch + 1}: valid MRR {mrr:.4f}", flush=True)
            if mrr > best:
                best, bad_evals = mrr, 0
                os.makedirs(os.path.dirname(args.ckpt) or ".", exist_ok=True)
                torch.save({"epoch": epoch + 1, "model": model.state_dict(), "entities": entities,
                            "relations": relations}, args.ckpt)
            else:
                bad_evals += 1
                stop[0] = float(bad_evals >= args.patience)
        dist.broadcast(stop, src=0)
        if stop.item():
            break

    dist.barrier()
    ckpt = torch.load(args.ckpt, map_location=device)
    model.load_state_dict(ckpt["model"])
    ranks, _ = evaluate(model, data["test"], answers, rank, world, device)
    if rank == 0:
        print(f"test (epoch {ckpt['epoch']}): MRR {(1 / ranks).mean().item():.4f} "
              f"H@1 {(ranks <= 1).double().mean().item():.4f} H@10 {(ranks <= 10).double().mean().item():.4f}",
              flush=True)
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
