"""GraphSAGE on Reddit, one process per GPU started with torch.multiprocessing.

The dataset is loaded once in the parent and handed to the workers, which
share the tensors through shared memory.

    python 02_reddit_sage_spawn.py --epochs 30 --gpus 4
"""
import argparse
import copy
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.tensorboard import SummaryWriter
from torch_geometric.datasets import Reddit
from torch_geometric.loader import NeighborLoader
from torch_geometric.nn import SAGEConv


class SAGE(torch.nn.Module):
    def __init__(self, in_channels, hidden_channels, out_channels, num_layers=2, dropout=0.5):
        super().__init__()
        self.num_layers = num_layers
        self.dropout = dropout
        self.convs = torch.nn.ModuleList()
        self.convs.append(SAGEConv(in_channels, hidden_channels))
        for _ in range(num_layers - 2):
            self.convs.append(SAGEConv(hidden_channels, hidden_channels))
        self.convs.append(SAGEConv(hidden_channels, out_channels))

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = x.relu_()
                x = F.dropout(x, p=self.dropout, training=self.training)
        return x

    @torch.no_grad()
    def inference(self, x_all, subgraph_loader, device):
        # Layer-wise inference over all nodes with full neighbourhoods.
        for i, conv in enumerate(self.convs):
            xs = []
            for batch in subgraph_loader:
                x = x_all[batch.n_id.to(x_all.device)].to(device)
                x = conv(x, batch.edge_index.to(device))
                if i < len(self.convs) - 1:
                    x = x.relu_()
                xs.append(x[: batch.batch_size].cpu())
            x_all = torch.cat(xs, dim=0)
        return x_all


def run(rank, world_size, dataset, args):
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)

    data = dataset[0]
    train_idx = data.train_mask.nonzero(as_tuple=False).view(-1)
    train_idx = train_idx.split(train_idx.size(0) // world_size)[rank]

    train_loader = NeighborLoader(
        data,
        input_nodes=train_idx,
        num_neighbors=[25, 10],
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.num_workers,
        persistent_workers=True,
    )

    if rank == 0:
        subgraph_loader = NeighborLoader(
            copy.copy(data),
            input_nodes=None,
            num_neighbors=[-1],
            batch_size=4096,
            shuffle=False,
            num_workers=args.num_workers,
        )
        # x and y are not needed inside the layer-wise loader
        del subgraph_loader.data.x, subgraph_loader.data.y
        subgraph_loader.data.num_nodes = data.num_nodes
        writer = SummaryWriter(log_dir=args.log_dir)
    else:
        subgraph_loader, writer = None, None

    torch.manual_seed(12345)
    model = SAGE(dataset.num_features, args.hidden, dataset.num_classes,
                 dropout=args.dropout).to(device)
    model = DistributedDataParallel(model, device_ids=[rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    start_epoch = 1
    ckpt_path = os.path.join(args.ckpt_dir, "last.pt")
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch = ckpt["epoch"] + 1
        if rank == 0:
            print(f"resumed from {ckpt_path} at epoch {ckpt['epoch']}")

    for epoch in range(start_epoch, args.epochs + 1):
        model.train()
        t0 = time.time()
        total_loss, steps = 0.0, 0
        for batch in train_loader:
            batch = batch.to(device)
            optimizer.zero_grad()
            out = model(batch.x, batch.edge_index)[: batch.batch_size]
            loss = F.cross_entropy(out, batch.y[: batch.batch_size])
            loss.backward()
            optimizer.step()
            total_loss += float(loss)
            steps += 1

        loss_t = torch.tensor([total_loss, steps], device=device, dtype=torch.float64)
        dist.all_reduce(loss_t)
        epoch_loss = (loss_t[0] / loss_t[1]).item()

        if rank == 0:
            print(f"Epoch {epoch:02d} | loss {epoch_loss:.4f} | {time.time() - t0:.1f}s")
            writer.add_scalar("train/loss", epoch_loss, epoch)

        if rank == 0 and epoch % args.eval_every == 0:
            model.eval()
            out = model.module.inference(data.x, subgraph_loader, device)
            pred = out.argmax(dim=-1)
            accs = []
            for mask in (data.train_mask, data.val_mask, data.test_mask):
                accs.append(int((pred[mask] == data.y[mask]).sum()) / int(mask.sum()))
            print(f"Epoch {epoch:02d} | train {accs[0]:.4f} | val {accs[1]:.4f} | test {accs[2]:.4f}")
            for name, acc in zip(("train", "val", "test"), accs):
                writer.add_scalar(f"acc/{name}", acc, epoch)

            os.makedirs(args.ckpt_dir, exist_ok=True)
            torch.save({"epoch": epoch,
                        "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict()}, ckpt_path)

        # keep the other ranks here while rank 0 evaluates and writes
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="data/Reddit")
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch_size", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--dropout", type=float, default=0.5)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--num_workers", type=int, default=4)
    parser.add_argument("--eval_every", type=int, default=5)
    parser.add_argument("--port", type=int, default=12355)
    parser.add_argument("--ckpt_dir", default="checkpoints/reddit_sage")
    parser.add_argument("--log_dir", default="runs/reddit_sage")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    dataset = Reddit(args.root)
    world_size = min(args.gpus, torch.cuda.device_count())
    print(f"Let's use {world_size} GPUs!")
    mp.spawn(run, args=(world_size, dataset, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
