"""GIN with a virtual node on ogbg-molpcba (128 tasks, average precision).

Data parallel over all local GPUs:

    torchrun --standalone --nproc_per_node=8 12_molpcba_gin_virtualnode.py \
        --batch_size 64 --epochs 100
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from ogb.graphproppred import Evaluator, PygGraphPropPredDataset
from ogb.graphproppred.mol_encoder import AtomEncoder, BondEncoder
from torch_geometric.loader import DataLoader
from torch_geometric.nn import MessagePassing, global_add_pool, global_mean_pool


class GINConv(MessagePassing):
    def __init__(self, emb_dim):
        super().__init__(aggr="add")
        self.mlp = nn.Sequential(nn.Linear(emb_dim, 2 * emb_dim), nn.BatchNorm1d(2 * emb_dim),
                                 nn.ReLU(), nn.Linear(2 * emb_dim, emb_dim))
        self.eps = nn.Parameter(torch.Tensor([0]))
        self.bond_encoder = BondEncoder(emb_dim=emb_dim)

    def forward(self, x, edge_index, edge_attr):
        edge_embedding = self.bond_encoder(edge_attr)
        return self.mlp((1 + self.eps) * x + self.propagate(edge_index, x=x, edge_attr=edge_embedding))

    def message(self, x_j, edge_attr):
        return F.relu(x_j + edge_attr)


class GINVirtual(nn.Module):
    def __init__(self, num_tasks, num_layer=5, emb_dim=300, drop_ratio=0.5, residual=True):
        super().__init__()
        self.num_layer = num_layer
        self.drop_ratio = drop_ratio
        self.residual = residual
        self.atom_encoder = AtomEncoder(emb_dim)
        # virtual node embedding, initialised to zero
        self.virtualnode_embedding = nn.Embedding(1, emb_dim)
        nn.init.constant_(self.virtualnode_embedding.weight.data, 0)

        self.convs = nn.ModuleList()
        self.batch_norms = nn.ModuleList()
        for _ in range(num_layer):
            self.convs.append(GINConv(emb_dim))
            self.batch_norms.append(nn.BatchNorm1d(emb_dim))

        self.mlp_virtualnode_list = nn.ModuleList()
        for _ in range(num_layer):
            self.mlp_virtualnode_list.append(nn.Sequential(
                nn.Linear(emb_dim, 2 * emb_dim), nn.BatchNorm1d(2 * emb_dim), nn.ReLU(),
                nn.Linear(2 * emb_dim, emb_dim), nn.BatchNorm1d(emb_dim), nn.ReLU()))

        self.graph_pred_linear = nn.Linear(emb_dim, num_tasks)

    def forward(self, batched_data):
        x, edge_index, edge_attr, batch = (batched_data.x, batched_data.edge_index,
                                           batched_data.edge_attr, batched_data.batch)
        vn = self.virtualnode_embedding(
            torch.zeros(int(batch[-1].item()) + 1, dtype=edge_index.dtype, device=edge_index.device))

        h_list = [self.atom_encoder(x)]
        for layer in range(self.num_layer):
            h_list[layer] = h_list[layer] + vn[batch]
            h = self.batch_norms[layer](self.convs[layer](h_list[layer], edge_index, edge_attr))
            if layer == self.num_layer - 1:
                h = F.dropout(h, self.drop_ratio, training=self.training)
            else:
                h = F.dropout(F.relu(h), self.drop_ratio, training=self.training)
            if self.residual:
                h = h + h_list[layer]
            h_list.append(h)

            # update the virtual node for the next layer
            if layer < self.num_layer - 1:
                vn_temp = global_add_pool(h_list[layer], batch) + vn
                vn_new = F.dropout(self.mlp_virtualnode_list[layer](vn_temp),
                                   self.drop_ratio, training=self.training)
                vn = vn + vn_new if self.residual else vn_new

        return self.graph_pred_linear(global_mean_pool(h_list[-1], batch))


@torch.no_grad()
def evaluate(model, loader, evaluator, device):
    model.eval()
    y_true, y_pred = [], []
    for batch in loader:
        batch = batch.to(device)
        pred = model(batch)
        y_true.append(batch.y.view(pred.shape).detach().cpu())
        y_pred.append(pred.detach().cpu())
    return evaluator.eval({"y_true": torch.cat(y_true).numpy(),
                           "y_pred": torch.cat(y_pred).numpy()})["ap"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="/data/ogb")
    parser.add_argument("--num_layer", type=int, default=5)
    parser.add_argument("--emb_dim", type=int, default=300)
    parser.add_argument("--drop_ratio", type=float, default=0.5)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--num_workers", type=int, default=4)
    parser.add_argument("--out_dir", default="runs/molpcba_vn")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        PygGraphPropPredDataset(name="ogbg-molpcba", root=args.root)
    dist.barrier()
    dataset = PygGraphPropPredDataset(name="ogbg-molpcba", root=args.root)
    split_idx = dataset.get_idx_split()
    evaluator = Evaluator("ogbg-molpcba")

    train_dataset = dataset[split_idx["train"]]
    sampler = DistributedSampler(train_dataset, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    valid_loader = DataLoader(dataset[split_idx["valid"]], batch_size=512, num_workers=args.num_workers)
    test_loader = DataLoader(dataset[split_idx["test"]], batch_size=512, num_workers=args.num_workers)

    model = GINVirtual(dataset.num_tasks, args.num_layer, args.emb_dim, args.drop_ratio)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    criterion = nn.BCEWithLogitsLoss()

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
    best_valid = 0.0
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for batch in train_loader:
            batch = batch.to(device, non_blocking=True)
            pred = model(batch)
            is_labeled = batch.y == batch.y
            loss = criterion(pred.float()[is_labeled], batch.y.float()[is_labeled])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_acc)

        if rank == 0:
            valid_ap = evaluate(model.module, valid_loader, evaluator, device)
            test_ap = evaluate(model.module, test_loader, evaluator, device)
            print(f"epoch {epoch:03d} | loss {(loss_acc[0] / loss_acc[1]).item():.4f} | "
                  f"valid AP {valid_ap:.4f} | test AP {test_ap:.4f} | {time.time() - t0:.0f}s",
                  flush=True)
            if valid_ap > best_valid:
                best_valid = valid_ap
                torch.save({"epoch": epoch, "model": model.module.state_dict(),
                            "valid_ap": valid_ap, "test_ap": test_ap},
                           os.path.join(args.out_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
