"""ogbn-proteins (112 binary tasks, ROC-AUC) with a sampled GraphSAGE in DGL.

Node features are the mean of the incident edge features. Training and
inference are both spread over all ranks; the predictions are collected
to rank 0 for the OGB evaluator.

    torchrun --nnodes=1 --nproc_per_node=4 08_proteins_dgl_sage.py --epochs 100
"""
import argparse
import os
import time

import dgl
import dgl.function as fn
import dgl.nn.pytorch as dglnn
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from dgl.dataloading import DataLoader, MultiLayerNeighborSampler
from ogb.nodeproppred import DglNodePropPredDataset, Evaluator
from torch.nn.parallel import DistributedDataParallel as DDP


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/ogb")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--dropout", type=float, default=0.25)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch_size", type=int, default=512)
    ap.add_argument("--eval_batch_size", type=int, default=2048)
    ap.add_argument("--fanout", type=int, default=16)
    ap.add_argument("--eval_fanout", type=int, default=64)
    ap.add_argument("--eval_every", type=int, default=5)
    ap.add_argument("--ckpt", default="checkpoints/proteins_sage.pt")
    return ap.parse_args()


class SAGE(nn.Module):
    def __init__(self, in_feats, hidden, n_tasks, n_layers, dropout):
        super().__init__()
        self.input = nn.Linear(in_feats, hidden)
        self.layers = nn.ModuleList(
            [dglnn.SAGEConv(hidden, hidden, "mean") for _ in range(n_layers)]
        )
        self.norms = nn.ModuleList([nn.LayerNorm(hidden) for _ in range(n_layers)])
        self.out = nn.Linear(hidden, n_tasks)
        self.dropout = nn.Dropout(dropout)

    def forward(self, blocks, x):
        h = F.relu(self.input(x))
        for layer, norm, block in zip(self.layers, self.norms, blocks):
            h = layer(block, h)
            h = self.dropout(F.relu(norm(h)))
        return self.out(h)


def load_proteins(root):
    dataset = DglNodePropPredDataset(name="ogbn-proteins", root=root)
    graph, labels = dataset[0]
    graph.update_all(fn.copy_e("feat", "m"), fn.mean("m", "feat"))
    graph.ndata["label"] = labels.float()
    return graph, dataset.get_idx_split()


@torch.no_grad()
def predict(model, g, nids, fanout, n_layers, batch_size, device):
    model.eval()
    sampler = MultiLayerNeighborSampler([fanout] * n_layers)
    loader = DataLoader(g, nids, sampler, device=device, batch_size=batch_size,
                        shuffle=False, drop_last=False, num_workers=0)
    preds = []
    for _, _, blocks in loader:
        preds.append(model(blocks, blocks[0].srcdata["feat"]))
    return torch.cat(preds, dim=0)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        DglNodePropPredDataset(name="ogbn-proteins", root=args.root)
    dist.barrier()
    g, split_idx = load_proteins(args.root)
    g = g.to(device)
    train_idx = split_idx["train"].to(device)
    evaluator = Evaluator(name="ogbn-proteins")

    n_tasks = g.ndata["label"].shape[1]
    model = SAGE(g.ndata["feat"].shape[1], args.hidden, n_tasks, args.layers, args.dropout)
    model = DDP(model.to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    criterion = nn.BCEWithLogitsLoss()

    sampler = MultiLayerNeighborSampler([args.fanout] * args.layers)
    train_loader = DataLoader(g, train_idx, sampler, device=device, batch_size=args.batch_size,
                              shuffle=True, drop_last=True, num_workers=0, use_ddp=True)

    best = {"valid": 0.0, "test": 0.0, "epoch": 0}
    for epoch in range(1, args.epochs + 1):
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros((), device=device)
        for step, (input_nodes, output_nodes, blocks) in enumerate(train_loader):
            logits = model(blocks, blocks[0].srcdata["feat"])
            loss = criterion(logits, blocks[-1].dstdata["label"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach()
        dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
        if rank == 0:
            print(f"epoch {epoch:3d} loss {loss_sum.item() / ((step + 1) * world_size):.4f} "
                  f"time {time.time() - t0:.1f}s", flush=True)

        if epoch % args.eval_every != 0:
            continue

        results = {}
        for split in ("valid", "test"):
            local_idx = split_idx[split].tensor_split(world_size)[rank].to(device)
            y_pred = predict(model.module, g, local_idx, args.eval_fanout, args.layers,
                             args.eval_batch_size, device)
            gathered = [torch.zeros_like(y_pred) for _ in range(world_size)]
            dist.all_gather(gathered, y_pred)
            if rank == 0:
                y_pred_all = torch.cat(gathered, dim=0).cpu()
                y_true = g.ndata["label"][split_idx[split].to(device)].cpu()
                results[split] = evaluator.eval({"y_true": y_true, "y_pred": y_pred_all})["rocauc"]

        if rank == 0:
            print(f"epoch {epoch:3d} valid rocauc {results['valid']:.4f} "
                  f"test rocauc {results['test']:.4f}", flush=True)
            if results["valid"] > best["valid"]:
                best = {"valid": results["valid"], "test": results["test"], "epoch": epoch}
                os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
                torch.save({"model": model.module.state_dict(), **best}, args.ckpt)

    if rank == 0:
        print(f"best valid {best['valid']:.4f} @ epoch {best['epoch']} -> test {best['test']:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
