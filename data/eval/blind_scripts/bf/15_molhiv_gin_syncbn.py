"""ogbg-molhiv GIN, multi-GPU with SyncBatchNorm and distributed evaluation.

Evaluation is sharded too: each rank scores a strided, unpadded slice of
the split and the predictions are collected with all_gather_object, so
the ROC-AUC is computed over exactly the official split.

    torchrun --standalone --nproc_per_node=4 15_molhiv_gin_syncbn.py
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Subset
from torch.utils.data.distributed import DistributedSampler
from ogb.graphproppred import Evaluator, PygGraphPropPredDataset
from ogb.graphproppred.mol_encoder import AtomEncoder, BondEncoder
from torch_geometric.loader import DataLoader
from torch_geometric.nn import GINEConv, global_mean_pool


class MolGIN(nn.Module):
    def __init__(self, hidden=300, num_layers=5, dropout=0.5, num_tasks=1):
        super().__init__()
        self.atom_encoder = AtomEncoder(hidden)
        self.bond_encoders = nn.ModuleList([BondEncoder(hidden) for _ in range(num_layers)])
        self.convs = nn.ModuleList()
        self.norms = nn.ModuleList()
        for _ in range(num_layers):
            mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.BatchNorm1d(2 * hidden),
                                nn.ReLU(), nn.Linear(2 * hidden, hidden))
            self.convs.append(GINEConv(mlp, train_eps=True))
            self.norms.append(nn.BatchNorm1d(hidden))
        self.dropout = dropout
        self.head = nn.Linear(hidden, num_tasks)

    def forward(self, data):
        h = self.atom_encoder(data.x)
        for i, (conv, norm, enc) in enumerate(zip(self.convs, self.norms, self.bond_encoders)):
            h_new = norm(conv(h, data.edge_index, enc(data.edge_attr)))
            if i < len(self.convs) - 1:
                h_new = F.relu(h_new)
            h = h + F.dropout(h_new, self.dropout, training=self.training)
        return self.head(global_mean_pool(h, data.batch))


@torch.no_grad()
def distributed_eval(model, dataset, idx, evaluator, device, rank, world_size, batch_size=512):
    model.eval()
    shard = idx[rank::world_size]
    loader = DataLoader(Subset(dataset, shard.tolist()), batch_size=batch_size, shuffle=False)
    ys, ps = [], []
    for batch in loader:
        batch = batch.to(device)
        ps.append(model(batch).cpu())
        ys.append(batch.y.cpu())
    local = (torch.cat(ys).numpy(), torch.cat(ps).numpy())
    gathered = [None] * world_size
    dist.all_gather_object(gathered, local)
    y_true = np.concatenate([g[0] for g in gathered])
    y_pred = np.concatenate([g[1] for g in gathered])
    return evaluator.eval({"y_true": y_true, "y_pred": y_pred})["rocauc"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="dataset")
    ap.add_argument("--hidden", type=int, default=300)
    ap.add_argument("--num_layers", type=int, default=5)
    ap.add_argument("--dropout", type=float, default=0.5)
    ap.add_argument("--batch_size", type=int, default=32, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--project", default="molhiv-ddp")
    ap.add_argument("--save", default="checkpoints/molhiv_gin.pt")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    run = wandb.init(project=args.project, config=vars(args)) if rank == 0 else None

    if rank == 0:
        PygGraphPropPredDataset("ogbg-molhiv", root=args.root)
    dist.barrier()
    dataset = PygGraphPropPredDataset("ogbg-molhiv", root=args.root)
    split_idx = dataset.get_idx_split()
    evaluator = Evaluator("ogbg-molhiv")

    train_set = dataset[split_idx["train"]]
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    # drop_last on the loader too: a trailing batch of one molecule breaks BatchNorm
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              drop_last=True, num_workers=2)

    model = MolGIN(args.hidden, args.num_layers, args.dropout, dataset.num_tasks)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    criterion = nn.BCEWithLogitsLoss()

    best_val = 0.0
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for batch in train_loader:
            batch = batch.to(device)
            logits = model(batch)
            loss = criterion(logits, batch.y.float())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            tot += torch.stack([loss.detach() * batch.num_graphs,
                                torch.tensor(float(batch.num_graphs), device=device)])
        dist.all_reduce(tot)
        train_loss = (tot[0] / tot[1]).item()

        val_auc = distributed_eval(model.module, dataset, split_idx["valid"], evaluator,
                                   device, rank, world_size)
        test_auc = distributed_eval(model.module, dataset, split_idx["test"], evaluator,
                                    device, rank, world_size)

        if rank == 0:
            print(f"epoch {epoch:3d} | loss {train_loss:.4f} | val {val_auc:.4f} | "
                  f"test {test_auc:.4f} | {time.time() - t0:.1f}s", flush=True)
            run.log({"train/loss": train_loss, "val/rocauc": val_auc,
                     "test/rocauc": test_auc}, step=epoch)
            if val_auc > best_val:
                best_val = val_auc
                os.makedirs(os.path.dirname(args.save), exist_ok=True)
                torch.save({"epoch": epoch, "model": model.module.state_dict()}, args.save)

    if run is not None:
        run.summary["best_val_rocauc"] = best_val
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
