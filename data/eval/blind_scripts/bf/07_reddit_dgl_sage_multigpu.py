"""Multi-GPU GraphSAGE on Reddit with DGL (UVA sampling, one process per GPU).

    python 07_reddit_dgl_sage_multigpu.py --gpu 0,1,2,3 --mode mixed
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
import torchmetrics.functional as MF
from dgl.data import AsNodePredDataset, RedditDataset
from dgl.dataloading import DataLoader, NeighborSampler
from torch.nn.parallel import DistributedDataParallel


class SAGE(nn.Module):
    def __init__(self, in_size, hid_size, out_size, num_layers=3, dropout=0.5):
        super().__init__()
        self.layers = nn.ModuleList()
        self.layers.append(dglnn.SAGEConv(in_size, hid_size, "mean"))
        for _ in range(num_layers - 2):
            self.layers.append(dglnn.SAGEConv(hid_size, hid_size, "mean"))
        self.layers.append(dglnn.SAGEConv(hid_size, out_size, "mean"))
        self.dropout = nn.Dropout(dropout)

    def forward(self, blocks, x):
        h = x
        for l, (layer, block) in enumerate(zip(self.layers, blocks)):
            h = layer(block, h)
            if l != len(self.layers) - 1:
                h = F.relu(h)
                h = self.dropout(h)
        return h


@torch.no_grad()
def evaluate(model, g, nids, device, num_classes, use_uva, batch_size=4096):
    model.eval()
    sampler = NeighborSampler([15, 10, 5], prefetch_node_feats=["feat"], prefetch_labels=["label"])
    loader = DataLoader(g, nids, sampler, device=device, batch_size=batch_size,
                        shuffle=False, drop_last=False, num_workers=0, use_uva=use_uva)
    ys, y_hats = [], []
    for input_nodes, output_nodes, blocks in loader:
        x = blocks[0].srcdata["feat"]
        ys.append(blocks[-1].dstdata["label"])
        y_hats.append(model(blocks, x))
    return MF.accuracy(torch.cat(y_hats), torch.cat(ys), task="multiclass",
                       num_classes=num_classes).item()


def run(proc_id, nprocs, devices, g, data, args):
    device = devices[proc_id]
    torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl", init_method=f"tcp://127.0.0.1:{args.port}",
                            world_size=nprocs, rank=proc_id)
    num_classes, train_idx, val_idx, test_idx = data
    train_idx = train_idx.to(device)
    # evaluation is spread over the GPUs as well
    local_val = val_idx.tensor_split(nprocs)[proc_id].to(device)
    local_test = test_idx.tensor_split(nprocs)[proc_id].to(device)

    use_uva = args.mode == "mixed"
    g = g.to(device if args.mode == "puregpu" else "cpu")

    in_size = g.ndata["feat"].shape[1]
    model = SAGE(in_size, args.hidden, num_classes).to(device)
    model = DistributedDataParallel(model, device_ids=[device], output_device=device)

    sampler = NeighborSampler([int(f) for f in args.fan_out.split(",")],
                              prefetch_node_feats=["feat"], prefetch_labels=["label"])
    train_dataloader = DataLoader(g, train_idx, sampler, device=device,
                                  batch_size=args.batch_size, shuffle=True, drop_last=False,
                                  num_workers=0, use_ddp=True, use_uva=use_uva)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=5e-4)

    best_val, best_epoch = 0.0, -1
    for epoch in range(args.epochs):
        t0 = time.time()
        model.train()
        total_loss = torch.zeros((), device=device)
        for it, (input_nodes, output_nodes, blocks) in enumerate(train_dataloader):
            x = blocks[0].srcdata["feat"]
            y = blocks[-1].dstdata["label"]
            y_hat = model(blocks, x)
            loss = F.cross_entropy(y_hat, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total_loss += loss.detach()

        dist.reduce(total_loss, dst=0)
        val_acc = evaluate(model.module, g, local_val, device, num_classes, use_uva)
        if proc_id == 0:
            print(f"Epoch {epoch:05d} | Loss {total_loss.item() / ((it + 1) * nprocs):.4f} | "
                  f"Val Acc {val_acc:.4f} | Time {time.time() - t0:.2f}s", flush=True)
            if val_acc > best_val:
                best_val, best_epoch = val_acc, epoch
                os.makedirs(args.save_dir, exist_ok=True)
                torch.save(model.module.state_dict(),
                           os.path.join(args.save_dir, "sage_reddit_best.pt"))

    dist.barrier()
    if proc_id == 0:
        state = torch.load(os.path.join(args.save_dir, "sage_reddit_best.pt"), map_location=device)
        model.module.load_state_dict(state)
    # every rank picks up the best weights from rank 0 before testing
    for p in model.module.parameters():
        dist.broadcast(p.data, src=0)
    test_acc = evaluate(model.module, g, local_test, device, num_classes, use_uva)
    if proc_id == 0:
        print(f"Best epoch {best_epoch} | Val Acc {best_val:.4f} | Test Acc {test_acc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu", type=str, default="0",
                        help="comma separated list of GPU device IDs, e.g. 0,1,2,3")
    parser.add_argument("--mode", default="mixed", choices=["mixed", "puregpu"])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch_size", type=int, default=1024)
    parser.add_argument("--fan_out", type=str, default="10,10,10")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--port", type=int, default=12345)
    parser.add_argument("--save_dir", default="checkpoints")
    args = parser.parse_args()
    devices = list(map(int, args.gpu.split(",")))
    nprocs = len(devices)

    print(f"Training in {args.mode} mode using {nprocs} GPU(s)")
    dataset = AsNodePredDataset(RedditDataset())
    g = dataset[0]
    # build the sparse formats once so the children do not each build them
    g.create_formats_()
    data = (dataset.num_classes, dataset.train_idx, dataset.val_idx, dataset.test_idx)
    mp.spawn(run, args=(nprocs, devices, g, data, args), nprocs=nprocs)
