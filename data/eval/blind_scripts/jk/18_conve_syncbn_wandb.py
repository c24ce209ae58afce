"""ConvE (Dettmers et al. 2018), 1-N scoring, multi-GPU with SyncBatchNorm and W&B logging.

--batch_size is the GLOBAL batch (the paper's 128); each of the N ranks gets batch_size / N,
so the learning rate and schedule stay those of the single-GPU recipe.

    torchrun --nproc_per_node=4 18_conve_syncbn_wandb.py --data data/FB15k-237 --wandb_project kge
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/FB15k-237")
    p.add_argument("--out", default="checkpoints/conve_fb237")
    p.add_argument("--wandb_project", default=None)
    p.add_argument("--embedding_dim", type=int, default=200)
    p.add_argument("--shape1", type=int, default=20)
    p.add_argument("--batch_size", type=int, default=128, help="global batch size")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--label_smoothing", type=float, default=0.1)
    p.add_argument("--input_drop", type=float, default=0.2)
    p.add_argument("--hidden_drop", type=float, default=0.3)
    p.add_argument("--feat_drop", type=float, default=0.2)
    p.add_argument("--epochs", type=int, default=500)
    p.add_argument("--eval_every", type=int, default=10)
    return p.parse_args()


def preprocess(root):
    rows = {}
    for s in ("train", "valid", "test"):
        with open(os.path.join(root, f"{s}.txt")) as f:
            rows[s] = [l.strip().split("\t") for l in f if l.strip()]
    ents = sorted({e for rs in rows.values() for h, _, t in rs for e in (h, t)})
    rels = sorted({r for rs in rows.values() for _, r, _ in rs})
    e2i, r2i = {e: i for i, e in enumerate(ents)}, {r: i for i, r in enumerate(rels)}
    n_rel = len(rels)
    out = {"n_ent": len(ents), "n_rel": n_rel}
    for s, rs in rows.items():
        x = torch.tensor([[e2i[h], r2i[r], e2i[t]] for h, r, t in rs])
        out[s] = torch.cat([x, torch.stack([x[:, 2], x[:, 1] + n_rel, x[:, 0]], 1)])
    return out


def load_data(root, rank):
    cache = os.path.join(root, "conve_processed.pt")
    if rank == 0 and not os.path.exists(cache):
        data = preprocess(root)
        torch.save(data, cache + ".partial")
        os.replace(cache + ".partial", cache)
    dist.barrier()            # everyone waits until rank 0 has written the cache
    return torch.load(cache, map_location="cpu")


class ConvE(nn.Module):
    def __init__(self, n_ent, n_rel, args):
        super().__init__()
        d, s1 = args.embedding_dim, args.shape1
        self.s1, self.s2 = s1, d // s1
        self.emb_e = nn.Embedding(n_ent, d, padding_idx=None)
        self.emb_rel = nn.Embedding(n_rel, d)
        self.inp_drop = nn.Dropout(args.input_drop)
        self.hidden_drop = nn.Dropout(args.hidden_drop)
        self.feature_map_drop = nn.Dropout2d(args.feat_drop)
        self.conv1 = nn.Conv2d(1, 32, (3, 3), 1, 0, bias=True)
        self.bn0 = nn.BatchNorm2d(1)
        self.bn1 = nn.BatchNorm2d(32)
        self.bn2 = nn.BatchNorm1d(d)
        self.fc = nn.Linear(32 * (2 * s1 - 2) * (self.s2 - 2), d)
        self.b = nn.Parameter(torch.zeros(n_ent))
        nn.init.xavier_normal_(self.emb_e.weight)
        nn.init.xavier_normal_(self.emb_rel.weight)

    def forward(self, e1, rel):
        e1_emb = self.emb_e(e1).view(-1, 1, self.s1, self.s2)
        rel_emb = self.emb_rel(rel).view(-1, 1, self.s1, self.s2)
        x = self.bn0(torch.cat([e1_emb, rel_emb], 2))
        x = self.inp_drop(x)
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.feature_map_drop(x)
        x = self.fc(x.flatten(1))
        x = F.relu(self.bn2(self.hidden_drop(x)))
        return x @ self.emb_e.weight.t() + self.b


@torch.no_grad()
def evaluate(net, queries, known, device, rank, world, bs=256):
    net.eval()
    mine = queries[rank::world]
    acc = torch.zeros(5, dtype=torch.float64, device=device)
    for i in range(0, len(mine), bs):
        q = mine[i:i + bs].to(device)
        pred = net(q[:, 0], q[:, 1])
        tgt = pred.gather(1, q[:, 2:3])
        for j, (e1, r) in enumerate(q[:, :2].tolist()):
            pred[j, known[(e1, r)]] = -float("inf")
        rk = 1 + (pred > tgt).sum(1).double()
        acc += torch.stack([(1 / rk).sum(), (rk <= 1).sum(), (rk <= 3).sum(), (rk <= 10).sum(),
                            torch.tensor(float(rk.numel()), dtype=torch.float64, device=device)])
    dist.all_reduce(acc)
    return {"mrr": (acc[0] / acc[4]).item(), "hits@1": (acc[1] / acc[4]).item(),
            "hits@3": (acc[2] / acc[4]).item(), "hits@10": (acc[3] / acc[4]).item()}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    assert args.batch_size % world == 0, "global batch must divide evenly over ranks"
    per_rank_batch = args.batch_size // world

    data = load_data(args.data, rank)
    n_ent, n_rel2 = data["n_ent"], 2 * data["n_rel"]
    known = {}
    for s in ("train", "valid", "test"):
        for e1, r, e2 in data[s].tolist():
            known.setdefault((e1, r), []).append(e2)
    train_sr2o = {}
    for e1, r, e2 in data["train"].tolist():
        train_sr2o.setdefault((e1, r), []).append(e2)
    train_keys = torch.tensor(sorted(train_sr2o))

    torch.manual_seed(17)
    model = ConvE(n_ent, n_rel2, args)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)

    ds = TensorDataset(train_keys)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=per_rank_batch, sampler=sampler, drop_last=True, num_workers=2)

    run = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        if args.wandb_project:
            run = wandb.init(project=args.wandb_project, config={**vars(args), "world_size": world})

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        t0, agg = time.time(), torch.zeros(2, device=device)
        for (sr,) in loader:
            y = torch.zeros(sr.size(0), n_ent)
            for i, (e1, r) in enumerate(sr.tolist()):
                y[i, train_sr2o[(e1, r)]] = 1.0
            y = ((1.0 - args.label_smoothing) * y + 1.0 / n_ent).to(device, non_blocking=True)
            sr = sr.to(device, non_blocking=True)
            logits = ddp(sr[:, 0], sr[:, 1])
            loss = F.binary_cross_entropy_with_logits(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            agg += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(agg)
        log = {"epoch": epoch + 1, "train/loss": (agg[0] / agg[1]).item(), "train/epoch_s": time.time() - t0}

        if (epoch + 1) % args.eval_every == 0:
            m = evaluate(model, data["valid"], known, device, rank, world)
            log.update({f"valid/{k}": v for k, v in m.items()})
            if rank == 0 and m["mrr"] > best:
                best = m["mrr"]
                torch.save({"epoch": epoch + 1, "model": model.state_dict(), "valid": m},
                           os.path.join(args.out, "best.pt"))
            dist.barrier()
        if rank == 0:
            print(log, flush=True)
            if run is not None:
                run.log(log, step=epoch + 1)

    ckpt = torch.load(os.path.join(args.out, "best.pt"), map_location="cpu")
    model.load_state_dict(ckpt["model"])
    m = evaluate(model, data["test"], known, device, rank, world)
    if rank == 0:
        print(f"test @ epoch {ckpt['epoch']}: {m}", flush=True)
        if run is not None:
            run.summary.update({f"test/{k}": v for k, v in m.items()})
            run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
