"""TuckER (Balazevic et al., EMNLP 2019), 1-N scoring, multi-GPU.

* reciprocal triples, so only (e1, r, ?) queries are ever scored
* the two BatchNorm layers become SyncBatchNorm (per-GPU batches are small)
* gradient accumulation with DDP.no_sync(); the learning rate is scaled linearly
  from the paper's batch of 128 to batch_size * accum * world_size
* Weights & Biases logging from rank 0

    torchrun --nproc_per_node=4 18_tucker_syncbn_accum.py --dataset data/FB15k-237 --accum 2 --wandb
"""
import argparse
import contextlib
import os
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

try:
    import wandb
except ImportError:
    wandb = None


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="data/FB15k-237")
    p.add_argument("--out", default="runs/tucker")
    p.add_argument("--edim", type=int, default=200)
    p.add_argument("--rdim", type=int, default=200)
    p.add_argument("--batch_size", type=int, default=64, help="per GPU and per micro-step")
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--base_lr", type=float, default=5e-4, help="lr for an effective batch of 128")
    p.add_argument("--dr", type=float, default=1.0, help="exponential lr decay per epoch")
    p.add_argument("--input_dropout", type=float, default=0.3)
    p.add_argument("--hidden_dropout1", type=float, default=0.4)
    p.add_argument("--hidden_dropout2", type=float, default=0.5)
    p.add_argument("--label_smoothing", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=500)
    p.add_argument("--eval_every", type=int, default=10)
    p.add_argument("--resume", default=None)
    p.add_argument("--wandb", action="store_true")
    return p.parse_args()


def load_data(root):
    ents, rels = {}, {}
    splits = {}
    for s in ("train", "valid", "test"):
        with open(os.path.join(root, f"{s}.txt")) as f:
            splits[s] = [l.strip().split() for l in f]
    for s in ("train", "valid", "test"):
        for h, r, t in splits[s]:
            ents.setdefault(h, len(ents))
            ents.setdefault(t, len(ents))
            rels.setdefault(r, len(rels))
    n_rel = len(rels)
    out = {}
    for s, rows in splits.items():
        fwd = [(ents[h], rels[r], ents[t]) for h, r, t in rows]
        inv = [(t, r + n_rel, h) for h, r, t in fwd]
        out[s] = np.array(fwd + inv, dtype=np.int64)
    return out, len(ents), 2 * n_rel


class ERVocab(Dataset):
    def __init__(self, er_vocab):
        self.keys = sorted(er_vocab)
        self.vals = [er_vocab[k] for k in self.keys]

    def __len__(self):
        return len(self.keys)

    def __getitem__(self, i):
        return torch.tensor(self.keys[i]), torch.tensor(self.vals[i])


def collate(batch):
    pairs = torch.stack([b[0] for b in batch])
    rows = torch.cat([torch.full_like(b[1], i) for i, b in enumerate(batch)])
    cols = torch.cat([b[1] for b in batch])
    return pairs, rows, cols


class TuckER(nn.Module):
    def __init__(self, n_ent, n_rel, edim, rdim, d_in, d_h1, d_h2):
        super().__init__()
        self.E = nn.Embedding(n_ent, edim)
        self.R = nn.Embedding(n_rel, rdim)
        self.W = nn.Parameter(torch.empty(rdim, edim, edim).uniform_(-1, 1))
        nn.init.xavier_normal_(self.E.weight)
        nn.init.xavier_normal_(self.R.weight)
        self.input_dropout = nn.Dropout(d_in)
        self.hidden_dropout1 = nn.Dropout(d_h1)
        self.hidden_dropout2 = nn.Dropout(d_h2)
        self.bn0 = nn.BatchNorm1d(edim)
        self.bn1 = nn.BatchNorm1d(edim)
        self.edim = edim

    def forward(self, e1, r):
        x = self.input_dropout(self.bn0(self.E(e1)))
        w = (self.R(r) @ self.W.view(self.R.embedding_dim, -1)).view(-1, self.edim, self.edim)
        w = self.hidden_dropout1(w)
        x = torch.bmm(x.unsqueeze(1), w).squeeze(1)
        x = self.hidden_dropout2(self.bn1(x))
        return x @ self.E.weight.t()


@torch.no_grad()
def evaluate(model, triples, er_all, device, rank, world, bs=256):
    model.eval()
    ranks = []
    mine = triples[rank::world]
    for i in range(0, len(mine), bs):
        b = torch.from_numpy(mine[i:i + bs]).to(device)
        s = model(b[:, 0], b[:, 1])
        gold = s.gather(1, b[:, 2:3])
        for j, (h, r, _) in enumerate(b.tolist()):
            s[j, er_all[(h, r)]] = -float("inf")
        ranks.extend(((s > gold).sum(1) + 1).tolist())
    gathered = [None] * world
    dist.all_gather_object(gathered, ranks)
    model.train()
    r = np.concatenate([np.asarray(g, dtype=np.float64) for g in gathered])
    return {"mrr": float((1 / r).mean()), "hits@1": float((r <= 1).mean()),
            "hits@3": float((r <= 3).mean()), "hits@10": float((r <= 10).mean())}


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    data, n_ent, n_rel = load_data(args.dataset)
    er_train, er_all = defaultdict(list), defaultdict(list)
    for h, r, t in data["train"].tolist():
        er_train[(h, r)].append(t)
    for s in data.values():
        for h, r, t in s.tolist():
            er_all[(h, r)].append(t)

    ds = ERVocab(er_train)
    sampler = DistributedSampler(ds, shuffle=True, seed=20)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=2, drop_last=True)

    torch.manual_seed(20)
    model = TuckER(n_ent, n_rel, args.edim, args.rdim, args.input_dropout,
                   args.hidden_dropout1, args.hidden_dropout2)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    eff_batch = args.batch_size * args.accum * world
    opt = torch.optim.Adam(ddp.parameters(), lr=args.base_lr * eff_batch / 128)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, args.dr)

    start, best = 0, 0.0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start, best = ck["epoch"] + 1, ck["best"]

    run = None
    if is_main:
        os.makedirs(args.out, exist_ok=True)
        if args.wandb and wandb is not None:
            run = wandb.init(project="tucker-ddp", config={**vars(args), "world_size": world},
                             resume="allow", dir=args.out)
        print(f"{n_ent} entities, {n_rel} relations incl. inverse, {len(ds)} (e1, r) queries, "
              f"effective batch {eff_batch}, lr {opt.param_groups[0]['lr']:.2e}", flush=True)

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        t0, losses = time.time(), []
        opt.zero_grad(set_to_none=True)
        for i, (pairs, rows, cols) in enumerate(loader):
            pairs = pairs.to(device, non_blocking=True)
            target = torch.zeros(len(pairs), n_ent, device=device)
            target[rows.to(device), cols.to(device)] = 1.0
            target = (1.0 - args.label_smoothing) * target + 1.0 / n_ent
            sync_now = (i + 1) % args.accum == 0 or (i + 1) == len(loader)
            ctx = contextlib.nullcontext() if sync_now else ddp.no_sync()
            with ctx:
                logits = ddp(pairs[:, 0], pairs[:, 1])
                loss = F.binary_cross_entropy_with_logits(logits, target) / args.accum
                loss.backward()
            if sync_now:
                opt.step()
                opt.zero_grad(set_to_none=True)
            losses.append(loss.item() * args.accum)
        sched.step()
        if is_main:
            msg = {"epoch": epoch, "loss": float(np.mean(losses)), "lr": sched.get_last_lr()[0],
                   "epoch_time": time.time() - t0}
            print(msg, flush=True)
            if run is not None:
                run.log(msg, step=epoch)

        if (epoch + 1) % args.eval_every == 0:
            res = evaluate(model, data["valid"], er_all, device, rank, world)
            if is_main:
                print("valid", res, flush=True)
                if run is not None:
                    run.log({f"valid/{k}": v for k, v in res.items()}, step=epoch)
                best_now = max(best, res["mrr"])
                ck = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                      "epoch": epoch, "best": best_now}
                torch.save(ck, os.path.join(args.out, "last.pt"))
                if res["mrr"] > best:
                    torch.save(ck, os.path.join(args.out, "best.pt"))
            best = max(best, res["mrr"])
            dist.barrier()

    res = evaluate(model, data["test"], er_all, device, rank, world)
    if is_main:
        print("test (last epoch)", res, flush=True)
        if run is not None:
            run.summary.update({f"test/{k}": v for k, v in res.items()})
            run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
