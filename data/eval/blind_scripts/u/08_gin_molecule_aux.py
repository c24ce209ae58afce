"""GIN on ogbg-molpcba with an auxiliary masked-atom-type head.

Run on one node:
    torchrun --nproc_per_node=4 08_gin_molecule_aux.py --epochs 100 --aux-weight 0.1 --aux-start 2000
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from ogb.graphproppred import Evaluator, PygGraphPropPredDataset
from ogb.graphproppred.mol_encoder import AtomEncoder, BondEncoder
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torch_geometric.loader import DataLoader
from torch_geometric.nn import MessagePassing, global_mean_pool

NUM_ATOM_TYPES = 119


class GINConv(MessagePassing):
    def __init__(self, emb_dim):
        super().__init__(aggr='add')
        self.mlp = nn.Sequential(nn.Linear(emb_dim, 2 * emb_dim), nn.BatchNorm1d(2 * emb_dim), nn.ReLU(),
                                 nn.Linear(2 * emb_dim, emb_dim))
        self.eps = nn.Parameter(torch.zeros(1))
        self.bond_encoder = BondEncoder(emb_dim)

    def forward(self, x, edge_index, edge_attr):
        e = self.bond_encoder(edge_attr)
        return self.mlp((1 + self.eps) * x + self.propagate(edge_index, x=x, edge_attr=e))

    def message(self, x_j, edge_attr):
        return F.relu(x_j + edge_attr)


class GINMultiTask(nn.Module):
    def __init__(self, num_tasks, num_layers=5, emb_dim=300, drop=0.5):
        super().__init__()
        self.atom_encoder = AtomEncoder(emb_dim)
        self.mask_emb = nn.Parameter(torch.zeros(emb_dim))
        self.convs = nn.ModuleList([GINConv(emb_dim) for _ in range(num_layers)])
        self.bns = nn.ModuleList([nn.BatchNorm1d(emb_dim) for _ in range(num_layers)])
        self.drop = drop
        self.graph_head = nn.Linear(emb_dim, num_tasks)
        # auxiliary node-level head: predict the atom type of masked atoms
        self.atom_head = nn.Sequential(nn.Linear(emb_dim, emb_dim), nn.ReLU(), nn.Linear(emb_dim, NUM_ATOM_TYPES))

    def forward(self, data, mask=None):
        h = self.atom_encoder(data.x)
        if mask is not None:
            h = torch.where(mask[:, None], self.mask_emb.expand_as(h), h)
        for i, conv in enumerate(self.convs):
            h = self.bns[i](conv(h, data.edge_index, data.edge_attr))
            if i < len(self.convs) - 1:
                h = F.relu(h)
            h = F.dropout(h, self.drop, training=self.training)
        graph_logits = self.graph_head(global_mean_pool(h, data.batch))
        atom_logits = self.atom_head(h)
        return graph_logits, atom_logits


def masked_bce(logits, y):
    valid = ~torch.isnan(y)
    return F.binary_cross_entropy_with_logits(logits[valid], y[valid].float())


@torch.no_grad()
def evaluate(model, loader, evaluator, device, world_size):
    model.eval()
    ys, preds = [], []
    for batch in loader:
        batch = batch.to(device)
        logits, _ = model(batch)
        ys.append(batch.y.float())
        preds.append(logits.float())
    y = torch.cat(ys)
    p = torch.cat(preds)
    # gather everything on every rank; OGB evaluator wants the full split
    gathered = [None] * world_size
    dist.all_gather_object(gathered, (y.cpu(), p.cpu()))
    y_all = torch.cat([g[0] for g in gathered]).numpy()
    p_all = torch.cat([g[1] for g in gathered]).numpy()
    model.train()
    return evaluator.eval({'y_true': y_all, 'y_pred': p_all})[evaluator.eval_metric]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--dataset', default='ogbg-molpcba')
    ap.add_argument('--root', default='/data/ogb')
    ap.add_argument('--epochs', type=int, default=100)
    ap.add_argument('--batch-size', type=int, default=256, help='per process')
    ap.add_argument('--lr', type=float, default=1e-3)
    ap.add_argument('--layers', type=int, default=5)
    ap.add_argument('--emb', type=int, default=300)
    ap.add_argument('--mask-rate', type=float, default=0.15)
    ap.add_argument('--aux-weight', type=float, default=0.1)
    ap.add_argument('--aux-start', type=int, default=2000, help='global step at which the aux loss is switched on')
    ap.add_argument('--out', default='checkpoints/gin_pcba')
    args = ap.parse_args()

    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl')
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f'cuda:{local_rank}')

    # processing the raw OGB files is done once, by rank 0
    if rank == 0:
        PygGraphPropPredDataset(args.dataset, root=args.root)
    dist.barrier()
    dataset = PygGraphPropPredDataset(args.dataset, root=args.root)
    split = dataset.get_idx_split()
    train_set, valid_set = dataset[split['train']], dataset[split['valid']]
    evaluator = Evaluator(args.dataset)

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=4)
    valid_idx = list(range(rank, len(valid_set), world_size))
    valid_loader = DataLoader(valid_set[valid_idx], batch_size=1024, shuffle=False, num_workers=2)

    torch.manual_seed(0)
    model = GINMultiTask(dataset.num_tasks, args.layers, args.emb).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    writer = SummaryWriter(os.path.join(args.out, 'tb')) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    step, best_ap = 0, 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for batch in train_loader:
            batch = batch.to(device)
            mask = torch.rand(batch.num_nodes, device=device) < args.mask_rate
            graph_logits, atom_logits = model(batch, mask)
            loss = masked_bce(graph_logits, batch.y)
            if step >= args.aux_start and mask.any():
                aux = F.cross_entropy(atom_logits[mask], batch.x[mask, 0])
                loss = loss + args.aux_weight * aux
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if writer is not None and step % 100 == 0:
                writer.add_scalar('train/loss', loss.item(), step)

        val_ap = evaluate(model.module, valid_loader, evaluator, device, world_size)
        if rank == 0:
            print(f'epoch {epoch} step {step} valid AP {val_ap:.4f} ({time.time() - t0:.0f}s)')
            writer.add_scalar('valid/ap', val_ap, epoch)
            if val_ap > best_ap:
                best_ap = val_ap
                torch.save({'model': model.module.state_dict(), 'epoch': epoch, 'valid_ap': val_ap},
                           os.path.join(args.out, 'best.pt'))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
