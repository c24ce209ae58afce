# GraphSAGE on ogbn-products, multi-GPU (one process per GPU, METIS partitions of the training nodes)
# python 07_graphsage_products.py --num_gpus 4 --part_file parts/products_metis4.pt
import os
import time
import argparse

import torch
import torch.nn.functional as F
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch_geometric.loader import NeighborLoader
from torch_geometric.nn import SAGEConv
from ogb.nodeproppred import PygNodePropPredDataset


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument('--root', default='/data/ogb')
    p.add_argument('--num_gpus', type=int, default=4)
    p.add_argument('--part_file', default='parts/products_metis4.pt',
                   help='LongTensor [num_nodes] with the METIS part id of every node')
    p.add_argument('--hidden', type=int, default=256)
    p.add_argument('--num_layers', type=int, default=3)
    p.add_argument('--fanout', type=str, default='15,10,5')
    p.add_argument('--batch_size', type=int, default=1024)
    p.add_argument('--lr', type=float, default=0.003)
    p.add_argument('--dropout', type=float, default=0.5)
    p.add_argument('--epochs', type=int, default=20)
    p.add_argument('--eval_every', type=int, default=5)
    p.add_argument('--port', default='12355')
    return p.parse_args()


class SAGE(torch.nn.Module):
    def __init__(self, in_c, hid, out_c, num_layers, dropout):
        super().__init__()
        self.convs = torch.nn.ModuleList()
        self.convs.append(SAGEConv(in_c, hid))
        for _ in range(num_layers - 2):
            self.convs.append(SAGEConv(hid, hid))
        self.convs.append(SAGEConv(hid, out_c))
        self.dropout = dropout

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = F.relu(x)
                x = F.dropout(x, p=self.dropout, training=self.training)
        return x


def split_for_rank(train_idx, part, rank):
    """keep the training nodes that METIS put in this rank's partition (better locality)."""
    mask = part[train_idx] == rank
    return train_idx[mask]


@torch.no_grad()
def evaluate(model, data, idx, rank, world, device, fanout, bs):
    model.eval()
    shard = idx.tensor_split(world)[rank]
    loader = NeighborLoader(data, input_nodes=shard, num_neighbors=fanout, batch_size=4096, shuffle=False,
                            num_workers=4)
    stats = torch.zeros(2, device=device)
    for batch in loader:
        batch = batch.to(device)
        out = model(batch.x, batch.edge_index)[:batch.batch_size]
        y = batch.y[:batch.batch_size].view(-1)
        stats[0] += (out.argmax(-1) == y).sum()
        stats[1] += y.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def run(rank, world_size, dataset, args):
    os.environ['MASTER_ADDR'] = 'localhost'
    os.environ['MASTER_PORT'] = args.port
    torch.cuda.set_device(rank)
    dist.init_process_group('nccl', rank=rank, world_size=world_size)
    device = torch.device('cuda', rank)

    data = dataset[0]
    data.y = data.y.view(-1)
    split_idx = dataset.get_idx_split()
    part = torch.load(args.part_file, map_location='cpu')
    train_idx = split_for_rank(split_idx['train'], part, rank)
    fanout = [int(f) for f in args.fanout.split(',')]
    train_loader = NeighborLoader(data, input_nodes=train_idx, num_neighbors=fanout, batch_size=args.batch_size,
                                  shuffle=True, num_workers=6, persistent_workers=True)
    if rank == 0:
        print('train nodes on rank 0: %d / %d, batches/epoch %d' % (train_idx.numel(), split_idx['train'].numel(),
                                                                   len(train_loader)), flush=True)

    torch.manual_seed(12345)
    model = SAGE(dataset.num_features, args.hidden, dataset.num_classes, args.num_layers, args.dropout).to(device)
    model = DistributedDataParallel(model, device_ids=[rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    best_val = 0.0
    for epoch in range(1, args.epochs + 1):
        model.train()
        t0 = time.time()
        total_loss = torch.zeros(2, device=device)
        for batch in train_loader:
            batch = batch.to(device)
            optimizer.zero_grad()
            out = model(batch.x, batch.edge_index)[:batch.batch_size]
            loss = F.cross_entropy(out, batch.y[:batch.batch_size])
            loss.backward()
            optimizer.step()
            total_loss += torch.stack([loss.detach() * batch.batch_size,
                                       torch.tensor(float(batch.batch_size), device=device)])
        dist.all_reduce(total_loss)
        if rank == 0:
            print(f'Epoch {epoch:02d} loss {total_loss[0] / total_loss[1]:.4f} time {time.time() - t0:.1f}s',
                  flush=True)

        if epoch % args.eval_every == 0:
            val_acc = evaluate(model.module, data, split_idx['valid'], rank, world_size, device, fanout, 4096)
            test_acc = evaluate(model.module, data, split_idx['test'], rank, world_size, device, fanout, 4096)
            if rank == 0:
                print(f'  val {val_acc:.4f} test {test_acc:.4f}', flush=True)
                if val_acc > best_val:
                    best_val = val_acc
                    torch.save(model.module.state_dict(), 'sage_products_best.pt')
    dist.barrier()
    dist.destroy_process_group()


if __name__ == '__main__':
    args = get_args()
    dataset = PygNodePropPredDataset('ogbn-products', root=args.root)
    world_size = min(args.num_gpus, torch.cuda.device_count())
    print('Let\'s use', world_size, 'GPUs!')
    mp.spawn(run, args=(world_size, dataset, args), nprocs=world_size, join=True)
