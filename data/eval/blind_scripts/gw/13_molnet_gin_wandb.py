"""Multi-task molecular property prediction over several MoleculeNet datasets.

A shared GIN encoder and one head per dataset (ESOL, FreeSolv, Lipophilicity
regression; BBBP, BACE classification). Each step samples one mini-batch of
graphs from every dataset; losses are weighted by learned uncertainty.

    torchrun --nproc_per_node=4 molnet_mtl.py --root data/molnet --wandb_project molnet-mtl
"""
import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler
from torch_geometric.datasets import MoleculeNet
from torch_geometric.loader import DataLoader
from torch_geometric.nn import GINConv, global_add_pool, global_mean_pool

DATASETS = {"ESOL": "reg", "FreeSolv": "reg", "Lipo": "reg", "BBBP": "cls", "BACE": "cls"}


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="data/molnet")
    ap.add_argument("--hidden", type=int, default=300)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--batch_size", type=int, default=64, help="graphs per dataset per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--steps_per_epoch", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wandb_project", default="molnet-mtl")
    ap.add_argument("--run_name", default=None)
    ap.add_argument("--out", default="ckpt/molnet_mtl")
    return ap.parse_args()


class GIN(nn.Module):
    def __init__(self, hidden, layers, n_atom_feats=9, vocab=128):
        super().__init__()
        self.atom_emb = nn.ModuleList([nn.Embedding(vocab, hidden) for _ in range(n_atom_feats)])
        self.convs = nn.ModuleList()
        self.norms = nn.ModuleList()
        for _ in range(layers):
            mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.LayerNorm(2 * hidden), nn.ReLU(),
                                nn.Linear(2 * hidden, hidden))
            self.convs.append(GINConv(mlp, train_eps=True))
            self.norms.append(nn.LayerNorm(hidden))
        self.drop = nn.Dropout(0.2)

    def forward(self, data):
        x = sum(emb(data.x[:, i].clamp(max=emb.num_embeddings - 1)) for i, emb in enumerate(self.atom_emb))
        for conv, norm in zip(self.convs, self.norms):
            x = x + self.drop(F.relu(norm(conv(x, data.edge_index))))
        return torch.cat([global_mean_pool(x, data.batch), global_add_pool(x, data.batch) / 10.0], -1)


class MolMTL(nn.Module):
    def __init__(self, hidden, layers):
        super().__init__()
        self.encoder = GIN(hidden, layers)
        self.heads = nn.ModuleDict({n: nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))
                                    for n in DATASETS})
        self.log_vars = nn.Parameter(torch.zeros(len(DATASETS)))

    def predict(self, name, data):
        return self.heads[name](self.encoder(data)).squeeze(-1)

    def forward(self, batches, stats):
        losses = []
        for name, data in batches.items():
            pred = self.predict(name, data)
            y = data.y[:, 0].float()
            if DATASETS[name] == "reg":
                mu, sd = stats[name]
                losses.append(F.mse_loss(pred, (y - mu) / sd))
            else:
                losses.append(F.binary_cross_entropy_with_logits(pred, y))
        losses = torch.stack(losses)
        total = (torch.exp(-self.log_vars) * losses + 0.5 * self.log_vars).sum()
        return total, losses.detach()


def split(ds, seed, frac=(0.8, 0.1, 0.1)):
    perm = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed))
    a, b = int(frac[0] * len(ds)), int((frac[0] + frac[1]) * len(ds))
    return ds[perm[:a]], ds[perm[a:b]], ds[perm[b:]]


def forever(loader, sampler):
    ep = 0
    while True:
        sampler.set_epoch(ep)
        yield from loader
        ep += 1


@torch.no_grad()
def evaluate(net, sets, stats, device, rank, world):
    net.eval()
    res = {}
    for name, ds in sets.items():
        part = ds[list(range(rank, len(ds), world))]
        p, t = [], []
        for data in DataLoader(part, batch_size=256):
            data = data.to(device)
            p.append(net.predict(name, data).cpu())
            t.append(data.y[:, 0].float().cpu())
        gathered = [None] * world
        dist.all_gather_object(gathered, (torch.cat(p).numpy(), torch.cat(t).numpy()))
        P = np.concatenate([g[0] for g in gathered])
        T = np.concatenate([g[1] for g in gathered])
        if DATASETS[name] == "reg":
            mu, sd = stats[name]
            res[f"{name}/rmse"] = float(np.sqrt(np.mean((P * sd + mu - T) ** 2)))
        else:
            res[f"{name}/auc"] = float(roc_auc_score(T, P))
    net.train()
    return res


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    run = wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    # rank 0 downloads and processes the raw csv files, the others wait for the processed files
    if rank == 0:
        full = {n: MoleculeNet(args.root, n) for n in DATASETS}
    dist.barrier()
    if rank != 0:
        full = {n: MoleculeNet(args.root, n) for n in DATASETS}

    train, val, test, streams, stats = {}, {}, {}, {}, {}
    for n, ds in full.items():
        train[n], val[n], test[n] = split(ds, args.seed)
        y = torch.cat([d.y[:, 0] for d in train[n]]).float()
        stats[n] = (y.mean().item(), y.std().item()) if DATASETS[n] == "reg" else (0.0, 1.0)
        sampler = DistributedSampler(train[n], shuffle=True, seed=args.seed, drop_last=True)
        loader = DataLoader(train[n], batch_size=args.batch_size, sampler=sampler, num_workers=2, drop_last=True)
        streams[n] = forever(loader, sampler)

    net = MolMTL(args.hidden, args.layers).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * args.steps_per_epoch)

    best = float("inf")
    for epoch in range(args.epochs):
        agg = torch.zeros(len(DATASETS), device=device)
        for _ in range(args.steps_per_epoch):
            batches = {n: next(streams[n]).to(device) for n in DATASETS}
            loss, per_task = model(batches, stats)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            agg += per_task
        dist.all_reduce(agg, op=dist.ReduceOp.AVG)
        log = {f"train/{n}": v / args.steps_per_epoch for n, v in zip(DATASETS, agg.tolist())}
        log.update({f"sigma/{n}": s for n, s in zip(DATASETS, torch.exp(0.5 * net.log_vars.detach()).tolist())})

        if epoch % 5 == 4 or epoch == args.epochs - 1:
            metrics = evaluate(net, val, stats, device, rank, world)
            log.update({f"val/{k}": v for k, v in metrics.items()})
            score = np.mean([v for k, v in metrics.items() if k.endswith("rmse")]) - \
                np.mean([v for k, v in metrics.items() if k.endswith("auc")])
            if rank == 0 and score < best:
                best = score
                os.makedirs(args.out, exist_ok=True)
                torch.save({"model": net.state_dict(), "stats": stats, "epoch": epoch},
                           os.path.join(args.out, "best.pt"))
            dist.barrier()
        wandb.log(log, step=epoch)

    ck = torch.load(os.path.join(args.out, "best.pt"), map_location=device)
    net.load_state_dict(ck["model"])
    test_metrics = evaluate(net, test, stats, device, rank, world)
    if rank == 0:
        print("test:", test_metrics, flush=True)
    run.summary.update({f"test/{k}": v for k, v in test_metrics.items()})
    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
