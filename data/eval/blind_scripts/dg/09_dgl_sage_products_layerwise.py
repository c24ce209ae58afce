"""Multi-GPU GraphSAGE on ogbn-products with DGL, mixed CPU-GPU (UVA) sampling.

Evaluation is exact layer-wise inference over all nodes, split across GPUs:
every rank computes the rows for its share of the nodes and writes them into
a shared host tensor.

    python 09_dgl_sage_products_layerwise.py --gpu 0,1,2,3
"""
import argparse
import os
import time

import dgl
import dgl.nn as dglnn
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import tqdm
from dgl.data import AsNodePredDataset
from dgl.dataloading import DataLoader, MultiLayerFullNeighborSampler, NeighborSampler
from dgl.multiprocessing import shared_tensor
from ogb.nodeproppred import DglNodePropPredDataset
from torch.nn.parallel import DistributedDataParallel


class SAGE(nn.Module):
    def __init__(self, in_size, hid_size, out_size, num_layers=3):
        super().__init__()
        self.layers = nn.ModuleList()
        self.layers.append(dglnn.SAGEConv(in_size, hid_size, "mean"))
        for _ in range(num_layers - 2):
            self.layers.append(dglnn.SAGEConv(hid_size, hid_size, "mean"))
        self.layers.append(dglnn.SAGEConv(hid_size, out_size, "mean"))
        self.dropout = nn.Dropout(0.5)
        self.hid_size = hid_size
        self.out_size = out_size

    def forward(self, blocks, x):
        h = x
        for l, (layer, block) in enumerate(zip(self.layers, blocks)):
            h = layer(block, h)
            if l != len(self.layers) - 1:
                h = F.relu(h)
                h = self.dropout(h)
        return h

    def inference(self, g, device, batch_size):
        """Every rank must call this: the node loader is split with use_ddp."""
        g.ndata["h"] = g.ndata["feat"]
        sampler = MultiLayerFullNeighborSampler(1, prefetch_node_feats=["h"])
        for l, layer in enumerate(self.layers):
            loader = DataLoader(
                g, torch.arange(g.num_nodes(), device=device), sampler,
                device=device, batch_size=batch_size, shuffle=False,
                drop_last=False, num_workers=0, use_ddp=True, use_uva=True,
            )
            out_dim = self.hid_size if l != len(self.layers) - 1 else self.out_size
            y = shared_tensor((g.num_nodes(), out_dim))
            it = tqdm.tqdm(loader, desc=f"layer {l}") if dist.get_rank() == 0 else loader
            for _, output_nodes, blocks in it:
                h = layer(blocks[0], blocks[0].srcdata["h"])
                if l != len(self.layers) - 1:
                    h = F.relu(h)
                y[output_nodes] = h.to(y.device, non_blocking=True)
            torch.cuda.synchronize(device)
            dist.barrier()  # all ranks finished writing their rows of y
            g.ndata["h"] = y
        g.ndata.pop("h")
        return y


def run(proc_id, nprocs, devices, g, data, args):
    device = torch.device("cuda", devices[proc_id])
    torch.cuda.set_device(device)
    dist.init_process_group(
        backend="nccl",
        init_method=f"tcp://127.0.0.1:{args.port}",
        world_size=nprocs,
        rank=proc_id,
    )
    num_classes, train_idx, val_idx, test_idx = data
    train_idx = train_idx.to(device)

    model = SAGE(g.ndata["feat"].shape[1], args.hidden, num_classes).to(device)
    model = DistributedDataParallel(model, device_ids=[device], output_device=device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=5e-4)

    sampler = NeighborSampler([10, 10, 10], prefetch_node_feats=["feat"],
                              prefetch_labels=["label"])
    train_loader = DataLoader(
        g, train_idx, sampler, device=device, batch_size=args.batch_size,
        shuffle=True, drop_last=False, num_workers=0, use_ddp=True, use_uva=True,
    )

    best_val = 0.0
    labels = g.ndata["label"]
    for epoch in range(args.epochs):
        t0 = time.time()
        model.train()
        loss_sum = torch.zeros(2, device=device)
        for _, _, blocks in train_loader:
            x = blocks[0].srcdata["feat"]
            y = blocks[-1].dstdata["label"]
            loss = F.cross_entropy(model(blocks, x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss_sum[0] += loss.detach()
            loss_sum[1] += 1
        dist.all_reduce(loss_sum)

        if (epoch + 1) % args.eval_every == 0:
            model.eval()
            with torch.no_grad():
                pred = model.module.inference(g, device, 4096)
            if proc_id == 0:
                pred = pred.argmax(1)
                val_acc = (pred[val_idx] == labels[val_idx]).float().mean().item()
                test_acc = (pred[test_idx] == labels[test_idx]).float().mean().item()
                print(f"epoch {epoch:03d} loss {(loss_sum[0] / loss_sum[1]).item():.4f} "
                      f"val {val_acc:.4f} test {test_acc:.4f} "
                      f"{time.time() - t0:.1f}s", flush=True)
                if val_acc > best_val:
                    best_val = val_acc
                    torch.save(model.module.state_dict(), args.save)
            dist.barrier()
        elif proc_id == 0:
            print(f"epoch {epoch:03d} loss {(loss_sum[0] / loss_sum[1]).item():.4f} "
                  f"{time.time() - t0:.1f}s", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu", default="0,1,2,3")
    parser.add_argument("--dataset_dir", default="dataset")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--eval_every", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--port", type=int, default=29511)
    parser.add_argument("--save", default="sage_products_best.pt")
    args = parser.parse_args()

    devices = [int(d) for d in args.gpu.split(",")]
    nprocs = len(devices)
    assert torch.cuda.device_count() >= max(devices) + 1, "not enough visible GPUs"

    dataset = AsNodePredDataset(DglNodePropPredDataset("ogbn-products", root=args.dataset_dir))
    g = dataset[0]
    g.create_formats_()  # build CSC/CSR once in the parent, shared with the workers
    os.environ["OMP_NUM_THREADS"] = str(max(1, mp.cpu_count() // 2 // nprocs))
    data = (dataset.num_classes, dataset.train_idx, dataset.val_idx, dataset.test_idx)

    mp.spawn(run, args=(nprocs, devices, g, data, args), nprocs=nprocs)
