"""Interaction-network edge classifier for TrackML-style hit graphs.

Graphs are produced by the module-map graph builder (one .pt file per event with
x [N, 3] = (r, phi, z) scaled, edge_index [2, E], y [E] edge truth, pt [E] truth pT
of the particle behind a true edge, 0 for fakes).

torchrun --nproc_per_node=4 02_trackml_in_edgeclf.py --config configs/in_edgeclf.yaml
"""
import argparse
import glob
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.loader import DataLoader
from torch_scatter import scatter_add


def mlp(sizes, act=nn.SiLU, layernorm=True):
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            if layernorm:
                layers.append(nn.LayerNorm(sizes[i + 1]))
            layers.append(act())
    return nn.Sequential(*layers)


class InteractionNetwork(nn.Module):
    def __init__(self, node_in=3, edge_in=4, hidden=128, n_iters=8, grad_ckpt=True):
        super().__init__()
        self.n_iters = n_iters
        self.grad_ckpt = grad_ckpt
        self.node_encoder = mlp([node_in, hidden, hidden])
        self.edge_encoder = mlp([2 * node_in + edge_in, hidden, hidden])
        # shared across iterations (recurrent message passing)
        self.edge_network = mlp([3 * hidden, hidden, hidden, hidden])
        self.node_network = mlp([2 * hidden, hidden, hidden, hidden])
        self.edge_classifier = mlp([3 * hidden, hidden, 1], layernorm=False)
        # auxiliary regression of log(pT) on edges, used as a regulariser
        self.pt_head = mlp([hidden, hidden // 2, 1], layernorm=False)

    @staticmethod
    def edge_features(x, edge_index):
        src, dst = edge_index
        dr = x[dst, 0] - x[src, 0]
        dphi = torch.remainder(x[dst, 1] - x[src, 1] + np.pi, 2 * np.pi) - np.pi
        dz = x[dst, 2] - x[src, 2]
        deta = torch.asinh(x[dst, 2] / x[dst, 0].clamp(min=1e-3)) - \
            torch.asinh(x[src, 2] / x[src, 0].clamp(min=1e-3))
        return torch.stack([dr, dphi, dz, deta], dim=1)

    def _iteration(self, h, e, src, dst):
        e = e + self.edge_network(torch.cat([h[src], h[dst], e], dim=1))
        agg = scatter_add(e, dst, dim=0, dim_size=h.size(0)) + \
            scatter_add(e, src, dim=0, dim_size=h.size(0))
        h = h + self.node_network(torch.cat([h, agg], dim=1))
        return h, e

    def forward(self, x, edge_index, with_pt=False):
        src, dst = edge_index
        h = self.node_encoder(x)
        e = self.edge_encoder(torch.cat([x[src], x[dst], self.edge_features(x, edge_index)], 1))
        for _ in range(self.n_iters):
            if self.grad_ckpt and self.training:
                h, e = checkpoint(self._iteration, h, e, src, dst, use_reentrant=False)
            else:
                h, e = self._iteration(h, e, src, dst)
        logits = self.edge_classifier(torch.cat([h[src], h[dst], e], dim=1)).squeeze(-1)
        if with_pt:
            return logits, self.pt_head(e).squeeze(-1)
        return logits


class EventGraphs(Dataset):
    def __init__(self, files):
        self.files = files

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        return torch.load(self.files[i], weights_only=False)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--resume", default=None)
    return p.parse_args()


def weighted_bce(logits, y, pos_weight):
    return F.binary_cross_entropy_with_logits(
        logits, y.float(), pos_weight=torch.tensor(pos_weight, device=logits.device))


@torch.no_grad()
def validate(model, loader, device, threshold):
    model.eval()
    scores, truth = [], []
    for batch in loader:
        batch = batch.to(device, non_blocking=True)
        logits = model(batch.x, batch.edge_index)
        scores.append(torch.sigmoid(logits).float().cpu().numpy())
        truth.append(batch.y.cpu().numpy().astype(np.int8))
    local = (np.concatenate(scores), np.concatenate(truth))
    # per-rank edge counts differ, so gather as python objects
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    s = np.concatenate([g[0] for g in gathered])
    t = np.concatenate([g[1] for g in gathered])
    pred = s > threshold
    tp = np.sum(pred & (t == 1))
    eff = tp / max(np.sum(t == 1), 1)
    pur = tp / max(np.sum(pred), 1)
    return {"auc": roc_auc_score(t, s), "eff": eff, "pur": pur, "n_edges": len(t)}


def main():
    args = parse()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    random.seed(cfg["seed"])
    np.random.seed(cfg["seed"])
    torch.manual_seed(cfg["seed"])

    files = sorted(glob.glob(os.path.join(cfg["input_dir"], "event*.pt")))
    n_val = cfg["n_val_events"]
    train_files, val_files = files[n_val:], files[:n_val]
    train_ds = EventGraphs(train_files)
    val_ds = EventGraphs(val_files[rank::world_size])

    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg["seed"], drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg["events_per_batch"], sampler=sampler,
                              num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=1, shuffle=False, num_workers=2)

    model = InteractionNetwork(hidden=cfg["hidden"], n_iters=cfg["n_graph_iters"],
                               grad_ckpt=cfg.get("grad_checkpointing", True)).to(device)
    # pt_head only runs on every aux_every-th step
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=cfg["lr_step"], gamma=0.3)

    start_epoch, best_auc = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_auc = ckpt["epoch"] + 1, ckpt["best_auc"]

    out_dir = cfg["output_dir"]
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        print(f"{len(train_files)} train / {len(val_files)} val events on {world_size} GPUs")

    aux_every, aux_w = cfg.get("aux_every", 4), cfg.get("aux_weight", 0.1)
    step = 0
    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device=device)
        for batch in train_loader:
            batch = batch.to(device, non_blocking=True)
            use_aux = step % aux_every == 0
            out = model(batch.x, batch.edge_index, with_pt=use_aux)
            if use_aux:
                logits, pt_pred = out
                true_edges = batch.y.bool()
                loss = weighted_bce(logits, batch.y, cfg["pos_weight"])
                if true_edges.any():
                    loss = loss + aux_w * F.smooth_l1_loss(
                        pt_pred[true_edges], torch.log(batch.pt[true_edges].clamp(min=0.1)))
                else:
                    loss = loss + 0.0 * pt_pred.sum()
            else:
                logits = out
                loss = weighted_bce(logits, batch.y, cfg["pos_weight"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            tot[0] += loss.detach()
            tot[1] += 1
            step += 1
        scheduler.step()
        dist.all_reduce(tot)

        metrics = validate(model.module, val_loader, device, cfg["edge_cut"])
        if rank == 0:
            print(f"[{epoch:03d}] loss={tot[0].item() / tot[1].item():.4f} "
                  f"auc={metrics['auc']:.4f} eff={metrics['eff']:.4f} pur={metrics['pur']:.4f} "
                  f"({metrics['n_edges']} val edges)", flush=True)
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": epoch,
                    "best_auc": max(best_auc, metrics["auc"]), "config": cfg}
            torch.save(ckpt, os.path.join(out_dir, "last.ckpt"))
            if metrics["auc"] > best_auc:
                torch.save(ckpt, os.path.join(out_dir, "best.ckpt"))
        best_auc = max(best_auc, metrics["auc"])
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
