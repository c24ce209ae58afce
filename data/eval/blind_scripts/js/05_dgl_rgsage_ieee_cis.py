"""R-GraphSAGE on the IEEE-CIS style heterogeneous graph (DGL, multi-GPU).

Nodes: txn, card, addr, email_domain, device_info. The graph is built offline by
make_graph.py (dgl.save_graphs) with a temporal split stored as node masks on 'txn'.

torchrun --nproc_per_node=4 05_dgl_rgsage_ieee_cis.py --graph /data/ieee_cis/hetero.bin
"""
import argparse
import logging
import os
import time

import dgl
import dgl.nn as dglnn
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel

logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", level=logging.INFO)
logger = logging.getLogger("rgsage")


class RGraphSAGE(nn.Module):
    def __init__(self, in_dims, hidden, rel_names, n_layers=2, dropout=0.3):
        super().__init__()
        self.proj = nn.ModuleDict({nt: nn.Linear(d, hidden) for nt, d in in_dims.items()})
        self.layers = nn.ModuleList(
            dglnn.HeteroGraphConv({r: dglnn.SAGEConv(hidden, hidden, "mean") for r in rel_names}, aggregate="sum")
            for _ in range(n_layers)
        )
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(n_layers))
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(hidden, 1)

    def forward(self, blocks, x):
        h = {nt: self.proj[nt](v) for nt, v in x.items()}
        for block, layer, norm in zip(blocks, self.layers, self.norms):
            h = layer(block, h)
            h = {nt: self.drop(F.relu(norm(v))) for nt, v in h.items()}
        return self.head(h["txn"]).squeeze(-1)


def load_graph(path):
    (g,), _ = dgl.load_graphs(path)
    return g


def run_epoch(model, loader, opt, loss_fn, device):
    model.train()
    total, n = 0.0, 0
    for input_nodes, output_nodes, blocks in loader:
        x = blocks[0].srcdata["feat"]
        y = blocks[-1].dstdata["label"]["txn"].float()
        logits = model(blocks, x)
        loss = loss_fn(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total += loss.item() * y.numel()
        n += y.numel()
    return total / max(n, 1)


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    ps, ys = [], []
    for input_nodes, output_nodes, blocks in loader:
        logits = model(blocks, blocks[0].srcdata["feat"])
        ps.append(torch.sigmoid(logits).cpu().numpy())
        ys.append(blocks[-1].dstdata["label"]["txn"].cpu().numpy())
    ps, ys = np.concatenate(ps), np.concatenate(ys)
    return average_precision_score(ys, ps), roc_auc_score(ys, ps)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--graph", default="/data/ieee_cis/hetero.bin")
    parser.add_argument("--out", default="./ckpt_rgsage")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--fanouts", default="15,10")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--pos-weight", type=float, default=10.0)
    args = parser.parse_args()

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    if rank != 0:
        logger.setLevel(logging.WARNING)

    g = load_graph(args.graph)
    train_nids = torch.nonzero(g.nodes["txn"].data["train_mask"]).squeeze(1)
    val_nids = torch.nonzero(g.nodes["txn"].data["val_mask"]).squeeze(1)
    logger.info("graph loaded: %d txn nodes, %d train, %d val, ntypes=%s",
                g.num_nodes("txn"), len(train_nids), len(val_nids), g.ntypes)

    fanouts = [int(f) for f in args.fanouts.split(",")]
    sampler = dgl.dataloading.NeighborSampler(fanouts, prefetch_node_feats=["feat"], prefetch_labels=["label"])
    train_loader = dgl.dataloading.DataLoader(
        g, {"txn": train_nids}, sampler, device=device, use_ddp=True, ddp_seed=0,
        batch_size=args.batch_size, shuffle=True, drop_last=False, num_workers=0, use_uva=False,
    )
    val_loader = dgl.dataloading.DataLoader(
        g, {"txn": val_nids}, sampler, device=device, use_ddp=True,
        batch_size=4096, shuffle=False, drop_last=False, num_workers=0,
    )

    in_dims = {nt: g.nodes[nt].data["feat"].shape[1] for nt in g.ntypes}
    model = RGraphSAGE(in_dims, args.hidden, g.etypes, args.layers).to(device)
    # relations with no sampled edges (and non-txn outputs of the last layer) are skipped by HeteroGraphConv
    model = DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank,
                                    find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.BCEWithLogitsLoss(pos_weight=torch.tensor(args.pos_weight, device=device))

    os.makedirs(args.out, exist_ok=True)
    best_ap = 0.0
    for epoch in range(args.epochs):
        train_loader.set_epoch(epoch)
        t0 = time.time()
        train_loss = run_epoch(model, train_loader, opt, loss_fn, device)
        val_ap, val_auc = evaluate(model, val_loader)
        if rank == 0:
            logger.info("epoch %d | loss %.4f | val PR-AUC %.4f ROC-AUC %.4f | %.1fs",
                        epoch, train_loss, val_ap, val_auc, time.time() - t0)
            if val_ap > best_ap:
                best_ap = val_ap
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
                logger.info("new best PR-AUC %.4f saved", best_ap)
        dist.barrier()

    if rank == 0:
        logger.info("done, best val PR-AUC %.4f", best_ap)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
