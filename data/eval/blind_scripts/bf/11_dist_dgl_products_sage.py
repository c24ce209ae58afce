"""Distributed GraphSAGE on a partitioned graph (DGL distributed).

The graph is partitioned beforehand with dgl.distributed.partition_graph
(labels in ndata["labels"], features in ndata["features"], masks
train/val/test_mask). Launch with DGL's launcher, e.g.

    python3 ~/workspace/dgl/tools/launch.py \
        --workspace /shared/gnn \
        --num_trainers 4 --num_samplers 0 --num_servers 1 \
        --part_config data/ogbn-products.json \
        --ip_config ip_config.txt \
        "python3 11_dist_dgl_products_sage.py --graph_name ogbn-products \
         --ip_config ip_config.txt --num_epochs 30 --num_gpus 4"
"""
import argparse
import socket
import time

import dgl
import dgl.nn.pytorch as dglnn
import numpy as np
import torch as th
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim


class DistSAGE(nn.Module):
    def __init__(self, in_feats, n_hidden, n_classes, n_layers, activation, dropout):
        super().__init__()
        self.n_layers = n_layers
        self.layers = nn.ModuleList()
        self.layers.append(dglnn.SAGEConv(in_feats, n_hidden, "mean"))
        for _ in range(1, n_layers - 1):
            self.layers.append(dglnn.SAGEConv(n_hidden, n_hidden, "mean"))
        self.layers.append(dglnn.SAGEConv(n_hidden, n_classes, "mean"))
        self.dropout = nn.Dropout(dropout)
        self.activation = activation

    def forward(self, blocks, x):
        h = x
        for i, (layer, block) in enumerate(zip(self.layers, blocks)):
            h = layer(block, h)
            if i != len(self.layers) - 1:
                h = self.activation(h)
                h = self.dropout(h)
        return h


def load_subtensor(g, seeds, input_nodes, device, load_feat=True):
    batch_inputs = g.ndata["features"][input_nodes].to(device) if load_feat else None
    batch_labels = g.ndata["labels"][seeds].to(device)
    return batch_inputs, batch_labels


@th.no_grad()
def evaluate(model, g, nids, args, device):
    """Sampled evaluation over this trainer's share of `nids`; returns (correct, total)."""
    model.eval()
    sampler = dgl.dataloading.NeighborSampler([25] * args.num_layers)
    loader = dgl.dataloading.DistNodeDataLoader(g, nids, sampler,
                                                batch_size=args.batch_size_eval,
                                                shuffle=False, drop_last=False)
    correct = th.zeros(1, dtype=th.long)
    total = th.zeros(1, dtype=th.long)
    for input_nodes, seeds, blocks in loader:
        blocks = [block.to(device) for block in blocks]
        x, y = load_subtensor(g, seeds, input_nodes, device)
        pred = model(blocks, x).argmax(dim=1)
        correct += (pred == y.long()).sum().cpu()
        total += seeds.shape[0]
    model.train()
    return correct, total


def run(args, device, data):
    train_nid, val_nid, test_nid, in_feats, n_classes, g = data
    sampler = dgl.dataloading.NeighborSampler([int(f) for f in args.fan_out.split(",")])
    dataloader = dgl.dataloading.DistNodeDataLoader(g, train_nid, sampler,
                                                    batch_size=args.batch_size,
                                                    shuffle=True, drop_last=False)

    model = DistSAGE(in_feats, args.num_hidden, n_classes, args.num_layers, F.relu, args.dropout)
    model = model.to(device)
    if args.num_gpus == 0:
        model = th.nn.parallel.DistributedDataParallel(model)
    else:
        model = th.nn.parallel.DistributedDataParallel(model, device_ids=[device],
                                                       output_device=device)
    loss_fcn = nn.CrossEntropyLoss().to(device)
    optimizer = optim.Adam(model.parameters(), lr=args.lr)

    for epoch in range(args.num_epochs):
        tic = time.time()
        num_seeds, num_inputs, step_losses = 0, 0, []
        # trainers can end up with a different number of batches; join() lets
        # the ones that finish early shadow the all-reduces of the others
        with model.join():
            for step, (input_nodes, seeds, blocks) in enumerate(dataloader):
                batch_inputs, batch_labels = load_subtensor(g, seeds, input_nodes, device)
                batch_labels = batch_labels.long()
                num_seeds += len(blocks[-1].dstdata[dgl.NID])
                num_inputs += len(blocks[0].srcdata[dgl.NID])
                blocks = [block.to(device) for block in blocks]
                batch_pred = model(blocks, batch_inputs)
                loss = loss_fcn(batch_pred, batch_labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step_losses.append(loss.item())
                if step % args.log_every == 0:
                    print(f"Part {g.rank()} | Epoch {epoch:05d} | Step {step:05d} | "
                          f"Loss {np.mean(step_losses[-args.log_every:]):.4f}")
        print(f"Part {g.rank()}, Epoch {epoch} took {time.time() - tic:.2f}s, "
              f"#seeds {num_seeds}, #inputs {num_inputs}")

        if (epoch + 1) % args.eval_every == 0:
            stats = []
            for nids in (val_nid, test_nid):
                correct, total = evaluate(model.module, g, nids, args, device)
                th.distributed.all_reduce(correct)
                th.distributed.all_reduce(total)
                stats.append(correct.item() / max(total.item(), 1))
            if g.rank() == 0:
                print(f"Epoch {epoch}: val acc {stats[0]:.4f}, test acc {stats[1]:.4f}")
                th.save(model.module.state_dict(), f"{args.save_prefix}_epoch{epoch}.pt")


def main(args):
    print(socket.gethostname(), "initializing DGL dist")
    dgl.distributed.initialize(args.ip_config, net_type=args.net_type)
    if not args.standalone:
        th.distributed.init_process_group(backend=args.backend)
    g = dgl.distributed.DistGraph(args.graph_name, part_config=args.part_config)
    print("rank:", g.rank())

    pb = g.get_partition_book()
    train_nid = dgl.distributed.node_split(g.ndata["train_mask"], pb, force_even=True)
    val_nid = dgl.distributed.node_split(g.ndata["val_mask"], pb, force_even=True)
    test_nid = dgl.distributed.node_split(g.ndata["test_mask"], pb, force_even=True)
    local_nid = pb.partid2nids(pb.partid).detach().numpy()
    print(f"part {g.rank()}, train: {len(train_nid)} (local: "
          f"{len(np.intersect1d(train_nid.numpy(), local_nid))}), val: {len(val_nid)}, "
          f"test: {len(test_nid)}")

    if args.num_gpus == 0:
        device = th.device("cpu")
    else:
        dev_id = g.rank() % args.num_gpus
        device = th.device("cuda:" + str(dev_id))
        th.cuda.set_device(device)

    n_classes = args.n_classes
    if n_classes == 0:
        train_labels = g.ndata["labels"][train_nid]
        n_classes = len(th.unique(train_labels[th.logical_not(th.isnan(train_labels))]))
    print(f"Number of classes: {n_classes}")

    in_feats = g.ndata["features"].shape[1]
    data = train_nid, val_nid, test_nid, in_feats, n_classes, g
    run(args, device, data)
    if not args.standalone:
        th.distributed.destroy_process_group()
    print("parent ends")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Distributed GraphSAGE")
    parser.add_argument("--graph_name", type=str, help="graph name")
    parser.add_argument("--ip_config", type=str, help="the file for IP configuration")
    parser.add_argument("--part_config", type=str, help="the path to the partition config file")
    parser.add_argument("--n_classes", type=int, default=0, help="the number of classes")
    parser.add_argument("--backend", type=str, default="gloo", help="pytorch distributed backend")
    parser.add_argument("--num_gpus", type=int, default=0,
                        help="the number of GPU device. Use 0 for CPU training")
    parser.add_argument("--num_epochs", type=int, default=20)
    parser.add_argument("--num_hidden", type=int, default=16)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--fan_out", type=str, default="10,25")
    parser.add_argument("--batch_size", type=int, default=1000)
    parser.add_argument("--batch_size_eval", type=int, default=100000)
    parser.add_argument("--log_every", type=int, default=20)
    parser.add_argument("--eval_every", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.003)
    parser.add_argument("--dropout", type=float, default=0.5)
    parser.add_argument("--save_prefix", type=str, default="/shared/gnn/ckpt/dist_sage")
    parser.add_argument("--standalone", action="store_true", help="run in the standalone mode")
    parser.add_argument("--net_type", type=str, default="socket",
                        help="backend net type, 'socket' or 'tensorpipe'")
    args = parser.parse_args()
    print(args)
    main(args)
