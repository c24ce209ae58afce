"""Item-item link prediction on the co-view graph (GraphSAGE, MRR / Hits@10).

Config comes from a YAML file, overridable from the CLI:

    torchrun --nproc_per_node=4 sage_coview.py --config configs/coview_sage.yaml --epochs 15
"""
import argparse
import copy
import logging
import os
import time
from dataclasses import dataclass, asdict, fields

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.loader import LinkNeighborLoader, NeighborLoader
from torch_geometric.nn import SAGEConv
from torch_geometric.transforms import RandomLinkSplit, ToUndirected

log = logging.getLogger("coview")


@dataclass
class Config:
    graph_path: str = "/mnt/graphs/coview/latest/coview.pt"
    out_dir: str = "/mnt/experiments/coview_sage"
    hidden: int = 128
    num_layers: int = 2
    fanout: tuple = (20, 10)
    batch_size: int = 2048
    epochs: int = 10
    lr: float = 0.002
    num_val: float = 0.02
    num_test: float = 0.05
    eval_negatives: int = 100
    eval_max_edges: int = 200_000
    num_workers: int = 8
    seed: int = 42


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    for f in fields(Config):
        if f.type in (int, float, str):
            ap.add_argument(f"--{f.name.replace('_', '-')}", type=f.type, default=None)
    ns = ap.parse_args()
    cfg = Config()
    if ns.config:
        with open(ns.config) as fh:
            for k, v in (yaml.safe_load(fh) or {}).items():
                setattr(cfg, k, tuple(v) if isinstance(v, list) else v)
    for f in fields(Config):
        v = getattr(ns, f.name, None)
        if v is not None:
            setattr(cfg, f.name, v)
    return cfg


class SAGE(nn.Module):
    def __init__(self, in_dim, hidden, num_layers):
        super().__init__()
        self.convs = nn.ModuleList(
            [SAGEConv(in_dim if i == 0 else hidden, hidden) for i in range(num_layers)]
        )

    def forward(self, x, edge_index, edge_label_index):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = F.relu(x)
                x = F.dropout(x, p=0.2, training=self.training)
        return (x[edge_label_index[0]] * x[edge_label_index[1]]).sum(-1)

    @torch.no_grad()
    def inference(self, x_all, loader, device):
        """Layer-wise full-neighbourhood inference for every node."""
        for i, conv in enumerate(self.convs):
            out = []
            for batch in loader:
                x = x_all[batch.n_id].to(device)
                h = conv(x, batch.edge_index.to(device))
                if i < len(self.convs) - 1:
                    h = F.relu(h)
                out.append(h[: batch.batch_size].cpu())
            x_all = torch.cat(out, dim=0)
        return x_all


@torch.no_grad()
def evaluate(model, split_data, cfg, rank, world_size, device):
    net = model.module
    net.eval()
    sub = copy.copy(split_data)
    del sub.edge_label, sub.edge_label_index
    loader = NeighborLoader(sub, num_neighbors=[-1], batch_size=8192, shuffle=False,
                            num_workers=cfg.num_workers)
    emb = net.inference(split_data.x, loader, device).to(device)

    pos = split_data.edge_label_index[:, split_data.edge_label == 1]
    pos = pos[:, : cfg.eval_max_edges]
    pos = pos[:, rank::world_size].to(device)

    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    mrr_sum = torch.zeros((), device=device)
    hits_sum = torch.zeros((), device=device)
    for chunk in pos.split(4096, dim=1):
        src, dst = chunk
        neg = torch.randint(0, emb.size(0), (src.numel(), cfg.eval_negatives), device=device, generator=gen)
        pos_s = (emb[src] * emb[dst]).sum(-1, keepdim=True)
        neg_s = (emb[src].unsqueeze(1) * emb[neg]).sum(-1)
        rank_of_pos = 1 + (neg_s >= pos_s).sum(-1)
        mrr_sum += (1.0 / rank_of_pos.float()).sum()
        hits_sum += (rank_of_pos <= 10).float().sum()

    totals = torch.stack([mrr_sum, hits_sum, torch.tensor(float(pos.size(1)), device=device)])
    dist.all_reduce(totals)
    net.train()
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s r{rank}] %(message)s")
    log.info("config: %s", asdict(cfg))

    torch.manual_seed(cfg.seed + rank)

    data = torch.load(cfg.graph_path)
    data = ToUndirected()(data)
    transform = RandomLinkSplit(num_val=cfg.num_val, num_test=cfg.num_test, is_undirected=True,
                                add_negative_train_samples=False)
    train_data, val_data, test_data = transform(data)
    log.info("nodes=%d train_edges=%d val_pos=%d", data.num_nodes,
             train_data.edge_label_index.size(1), int(val_data.edge_label.sum()))

    n_sup = train_data.edge_label_index.size(1)
    per_rank = n_sup // world_size
    shard = torch.arange(rank * per_rank, (rank + 1) * per_rank)
    train_loader = LinkNeighborLoader(
        train_data,
        num_neighbors=list(cfg.fanout),
        edge_label_index=train_data.edge_label_index[:, shard],
        edge_label=train_data.edge_label[shard],
        neg_sampling_ratio=1.0,
        batch_size=cfg.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=cfg.num_workers,
        persistent_workers=True,
    )

    model = SAGE(data.num_features, cfg.hidden, cfg.num_layers).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr * world_size ** 0.5)

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)

    best_mrr = 0.0
    for epoch in range(cfg.epochs):
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for step, batch in enumerate(train_loader):
            batch = batch.to(device)
            logits = model(batch.x, batch.edge_index, batch.edge_label_index)
            loss = F.binary_cross_entropy_with_logits(logits, batch.edge_label)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            running[0] += loss.detach()
            running[1] += 1
            if step % 200 == 0:
                log.info("epoch %d step %d loss %.4f", epoch, step, loss.item())
        dist.all_reduce(running)

        mrr, hits10 = evaluate(model, val_data, cfg, rank, world_size, device)
        log.info("epoch %d train_loss %.4f val_mrr %.4f val_hits@10 %.4f (%.0fs)", epoch,
                 (running[0] / running[1]).item(), mrr, hits10, time.time() - t0)
        if rank == 0 and mrr > best_mrr:
            best_mrr = mrr
            torch.save({"model": model.module.state_dict(), "cfg": asdict(cfg), "epoch": epoch},
                       os.path.join(cfg.out_dir, "best.pt"))

    dist.barrier()
    ckpt = torch.load(os.path.join(cfg.out_dir, "best.pt"), map_location=device)
    model.module.load_state_dict(ckpt["model"])
    mrr, hits10 = evaluate(model, test_data, cfg, rank, world_size, device)
    log.info("test (epoch %d): mrr %.4f hits@10 %.4f", ckpt["epoch"], mrr, hits10)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
