"""GIN baseline for OGB molecule property prediction, data-parallel over GPUs.

Follows the structure of the OGB mol examples (AtomEncoder / BondEncoder,
GINE-style message passing, mean pooling), wrapped in DDP.

    torchrun --standalone --nproc_per_node=4 03_moltox21_gin_ddp.py --dataset ogbg-moltox21
"""
import argparse
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from ogb.graphproppred import Evaluator, PygGraphPropPredDataset
from ogb.graphproppred.mol_encoder import AtomEncoder, BondEncoder
from torch_geometric.loader import DataLoader
from torch_geometric.nn import MessagePassing, global_mean_pool
from tqdm import tqdm


class GINConv(MessagePassing):
    def __init__(self, emb_dim):
        super().__init__(aggr="add")
        self.mlp = nn.Sequential(
            nn.Linear(emb_dim, 2 * emb_dim), nn.BatchNorm1d(2 * emb_dim), nn.ReLU(),
            nn.Linear(2 * emb_dim, emb_dim),
        )
        self.eps = nn.Parameter(torch.zeros(1))
        self.bond_encoder = BondEncoder(emb_dim=emb_dim)

    def forward(self, x, edge_index, edge_attr):
        edge_embedding = self.bond_encoder(edge_attr)
        out = self.propagate(edge_index, x=x, edge_attr=edge_embedding)
        return self.mlp((1 + self.eps) * x + out)

    def message(self, x_j, edge_attr):
        return F.relu(x_j + edge_attr)


class GIN(nn.Module):
    def __init__(self, num_tasks, num_layer=5, emb_dim=300, drop_ratio=0.5):
        super().__init__()
        self.num_layer = num_layer
        self.drop_ratio = drop_ratio
        self.atom_encoder = AtomEncoder(emb_dim)
        self.convs = nn.ModuleList([GINConv(emb_dim) for _ in range(num_layer)])
        self.norms = nn.ModuleList([nn.BatchNorm1d(emb_dim) for _ in range(num_layer)])
        self.head = nn.Linear(emb_dim, num_tasks)

    def forward(self, data):
        h = self.atom_encoder(data.x)
        for layer in range(self.num_layer):
            h = self.norms[layer](self.convs[layer](h, data.edge_index, data.edge_attr))
            if layer < self.num_layer - 1:
                h = F.relu(h)
            h = F.dropout(h, self.drop_ratio, training=self.training)
        return self.head(global_mean_pool(h, data.batch))


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def train_one_epoch(model, loader, optimizer, device, show_progress):
    model.train()
    criterion = nn.BCEWithLogitsLoss()
    loss_sum, n = 0.0, 0
    for batch in tqdm(loader, desc="train", disable=not show_progress):
        batch = batch.to(device)
        if batch.x.shape[0] == 1 or batch.batch[-1] == 0:
            continue
        pred = model(batch)
        optimizer.zero_grad()
        # tox21 has missing labels (nan); only score the labelled targets
        is_labeled = batch.y == batch.y
        loss = criterion(pred.float()[is_labeled], batch.y.float()[is_labeled])
        loss.backward()
        optimizer.step()
        loss_sum += loss.item()
        n += 1
    return loss_sum / max(n, 1)


@torch.no_grad()
def evaluate(model, loader, evaluator, device):
    model.eval()
    y_true, y_pred = [], []
    for batch in loader:
        batch = batch.to(device)
        pred = model(batch)
        y_true.append(batch.y.view(pred.shape).cpu())
        y_pred.append(pred.cpu())
    y_true = torch.cat(y_true).numpy()
    y_pred = torch.cat(y_pred).numpy()
    return evaluator.eval({"y_true": y_true, "y_pred": y_pred})[evaluator.eval_metric]


def main():
    parser = argparse.ArgumentParser(description="OGB mol GIN (DDP)")
    parser.add_argument("--dataset", default="ogbg-moltox21")
    parser.add_argument("--root", default="dataset")
    parser.add_argument("--num_layer", type=int, default=5)
    parser.add_argument("--emb_dim", type=int, default=300)
    parser.add_argument("--drop_ratio", type=float, default=0.5)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--num_workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--save", default="checkpoints/gin_tox21.pt")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    seed_everything(args.seed)

    # download / process once, the other ranks read the processed files
    if rank == 0:
        PygGraphPropPredDataset(name=args.dataset, root=args.root)
    dist.barrier()
    dataset = PygGraphPropPredDataset(name=args.dataset, root=args.root)
    split_idx = dataset.get_idx_split()
    evaluator = Evaluator(args.dataset)

    train_set = dataset[split_idx["train"]]
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True)
    valid_loader = DataLoader(dataset[split_idx["valid"]], batch_size=256, shuffle=False,
                              num_workers=args.num_workers)
    test_loader = DataLoader(dataset[split_idx["test"]], batch_size=256, shuffle=False,
                             num_workers=args.num_workers)

    model = GIN(dataset.num_tasks, args.num_layer, args.emb_dim, args.drop_ratio)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    best_valid, best_test, best_epoch = -1.0, -1.0, 0
    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        loss = train_one_epoch(model, train_loader, optimizer, device, show_progress=rank == 0)

        if rank == 0:
            valid_score = evaluate(model.module, valid_loader, evaluator, device)
            test_score = evaluate(model.module, test_loader, evaluator, device)
            print(f"epoch {epoch:3d} loss {loss:.4f} valid {valid_score:.4f} test {test_score:.4f}",
                  flush=True)
            if valid_score > best_valid:
                best_valid, best_test, best_epoch = valid_score, test_score, epoch
                os.makedirs(os.path.dirname(args.save), exist_ok=True)
                torch.save({"epoch": epoch, "model_state_dict": model.module.state_dict(),
                            "valid": valid_score, "test": test_score}, args.save)
        dist.barrier()

    if rank == 0:
        print(f"best epoch {best_epoch}: valid {best_valid:.4f} test {best_test:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
