"""LaneGCN-style marginal motion forecasting on Waymo scenes converted to lane graphs.

    torchrun --standalone --nproc_per_node=4 03_lanegcn_forecast.py \
        --train-dir /datasets/womd_lanegraph/train --val-dir /datasets/womd_lanegraph/val
"""
import argparse
import glob
import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger(__name__)


@dataclass
class Config:
    hist_len: int = 11
    fut_len: int = 80
    num_mods: int = 6
    n_actor: int = 128
    n_map: int = 128
    num_scales: int = 4
    max_nodes: int = 1024
    max_actors: int = 48
    cls_coef: float = 1.0
    reg_coef: float = 1.0
    mgn: float = 0.2
    cls_th: float = 2.0
    cls_ignore: float = 0.2


class LaneGraphDataset(Dataset):
    """Each .npz holds one scene: actor tracks plus lane-node features and adjacency lists."""

    def __init__(self, root, cfg: Config):
        self.files = sorted(glob.glob(os.path.join(root, "*.npz")))
        self.cfg = cfg

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(self.files[i])
        cfg = self.cfg
        A = min(int(d["num_actors"]), cfg.max_actors)
        N = min(int(d["num_nodes"]), cfg.max_nodes)
        feats = np.zeros((cfg.max_actors, cfg.hist_len, 3), np.float32)
        feats[:A] = d["actor_feats"][:A, : cfg.hist_len]
        gt = np.zeros((cfg.max_actors, cfg.fut_len, 2), np.float32)
        gt[:A] = d["gt_preds"][:A, : cfg.fut_len]
        has = np.zeros((cfg.max_actors, cfg.fut_len), np.bool_)
        has[:A] = d["has_preds"][:A, : cfg.fut_len]
        ctrs = np.zeros((cfg.max_actors, 2), np.float32)
        ctrs[:A] = d["actor_ctrs"][:A]
        node_feats = np.zeros((cfg.max_nodes, 4), np.float32)
        node_feats[:N] = np.concatenate([d["node_ctrs"][:N], d["node_feats"][:N]], -1)
        adj = np.zeros((cfg.num_scales, cfg.max_nodes, cfg.max_nodes), np.bool_)
        for s in range(cfg.num_scales):
            u, v = d[f"suc_u_{s}"], d[f"suc_v_{s}"]
            keep = (u < N) & (v < N)
            adj[s, u[keep], v[keep]] = True
        return {
            "feats": torch.from_numpy(feats), "gt": torch.from_numpy(gt), "has": torch.from_numpy(has),
            "ctrs": torch.from_numpy(ctrs), "actor_mask": torch.arange(cfg.max_actors) < A,
            "nodes": torch.from_numpy(node_feats), "node_mask": torch.arange(cfg.max_nodes) < N,
            "adj": torch.from_numpy(adj),
        }


class ActorNet(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv1d(3, 32, 3, padding=1), nn.GroupNorm(1, 32), nn.ReLU(),
            nn.Conv1d(32, 64, 3, padding=1, stride=2), nn.GroupNorm(1, 64), nn.ReLU(),
            nn.Conv1d(64, cfg.n_actor, 3, padding=1, stride=2), nn.GroupNorm(1, cfg.n_actor), nn.ReLU(),
        )

    def forward(self, feats):  # [B, A, T, 3]
        B, A, T, C = feats.shape
        x = self.conv(feats.reshape(B * A, T, C).transpose(1, 2))
        return x[..., -1].view(B, A, -1)


class MapNet(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        n = cfg.n_map
        self.inp = nn.Sequential(nn.Linear(4, n), nn.ReLU(), nn.Linear(n, n))
        self.suc = nn.ModuleList(nn.Linear(n, n, bias=False) for _ in range(cfg.num_scales))
        self.ctr = nn.Linear(n, n, bias=False)
        self.norm = nn.GroupNorm(1, n)
        self.iters = 2

    def forward(self, nodes, adj):  # nodes [B, N, 4], adj [B, S, N, N]
        feat = self.inp(nodes)
        adj = adj.float()
        deg = adj.sum(-1, keepdim=True).clamp(min=1)
        for _ in range(self.iters):
            out = self.ctr(feat)
            for s, lin in enumerate(self.suc):
                out = out + (adj[:, s] @ lin(feat)) / deg[:, s]
            feat = F.relu(self.norm(out.transpose(1, 2)).transpose(1, 2) + feat)
        return feat


class Fusion(nn.Module):
    """Actor-to-lane and lane-to-actor attention restricted by distance."""

    def __init__(self, cfg, radius=30.0):
        super().__init__()
        self.a2m = nn.MultiheadAttention(cfg.n_map, 4, batch_first=True, kdim=cfg.n_actor, vdim=cfg.n_actor)
        self.m2a = nn.MultiheadAttention(cfg.n_actor, 4, batch_first=True, kdim=cfg.n_map, vdim=cfg.n_map)
        self.radius = radius

    def forward(self, actors, actor_ctrs, actor_mask, nodes, node_ctrs, node_mask):
        d = torch.cdist(node_ctrs, actor_ctrs)
        a2m_mask = (d > self.radius) | ~actor_mask[:, None]
        a2m_mask[..., 0] = False  # keep at least one key per query
        nodes = nodes + self.a2m(nodes, actors, actors, attn_mask=a2m_mask.repeat_interleave(4, 0))[0]
        m2a_mask = (d.transpose(1, 2) > self.radius) | ~node_mask[:, None]
        m2a_mask[..., 0] = False
        actors = actors + self.m2a(actors, nodes, nodes, attn_mask=m2a_mask.repeat_interleave(4, 0))[0]
        return actors


class LaneGCN(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.actor_net = ActorNet(cfg)
        self.map_net = MapNet(cfg)
        self.fusion = Fusion(cfg)
        self.pred = nn.Sequential(nn.Linear(cfg.n_actor, cfg.n_actor), nn.ReLU(),
                                  nn.Linear(cfg.n_actor, cfg.num_mods * cfg.fut_len * 2))
        self.cls = nn.Sequential(nn.Linear(cfg.n_actor + 2 * cfg.num_mods, cfg.n_actor), nn.ReLU(),
                                 nn.Linear(cfg.n_actor, cfg.num_mods))

    def forward(self, batch):
        cfg = self.cfg
        actors = self.actor_net(batch["feats"])
        nodes = self.map_net(batch["nodes"], batch["adj"])
        actors = self.fusion(actors, batch["ctrs"], batch["actor_mask"], nodes,
                             batch["nodes"][..., :2], batch["node_mask"])
        B, A = actors.shape[:2]
        reg = self.pred(actors).view(B, A, cfg.num_mods, cfg.fut_len, 2) + batch["ctrs"][:, :, None, None]
        end = (reg[..., -1, :] - batch["ctrs"][:, :, None]).flatten(2)
        cls = self.cls(torch.cat([actors, end], -1))
        return reg, cls


def pred_loss(cfg, reg, cls, gt, has, actor_mask):
    has = has & actor_mask[..., None]
    last = has.float() + 0.1 * torch.arange(cfg.fut_len, device=has.device) / cfg.fut_len
    last_idx = last.argmax(-1)  # last observed future step per actor
    keep = has.any(-1)
    reg, cls, gt, has, last_idx = reg[keep], cls[keep], gt[keep], has[keep], last_idx[keep]
    r = torch.arange(len(last_idx), device=reg.device)
    dist_end = (reg[r, :, last_idx] - gt[r, last_idx][:, None]).norm(dim=-1)  # [N, K]
    min_dist, min_idx = dist_end.min(-1)
    # max-margin classification as in LaneGCN
    mgn = cls[r, min_idx][:, None] - cls
    mask0 = (min_dist < cfg.cls_th)[:, None]
    mask1 = (dist_end - min_dist[:, None]) > cfg.cls_ignore
    sel = mask0 & mask1 & (mgn < cfg.mgn)
    cls_loss = (cfg.mgn - mgn[sel]).sum() / sel.sum().clamp(min=1)
    best = reg[r, min_idx]
    reg_loss = F.smooth_l1_loss(best[has], gt[has], reduction="sum") / has.sum().clamp(min=1)
    return cfg.cls_coef * cls_loss + cfg.reg_coef * reg_loss, dist_end, min_dist


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train-dir", required=True)
    p.add_argument("--val-dir", required=True)
    p.add_argument("--save-dir", default="results/lanegcn_womd")
    p.add_argument("--epochs", type=int, default=36)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lr-epochs", type=int, nargs="+", default=[32])
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--resume", default="")
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR)
    cfg = Config()

    train_set = LaneGraphDataset(args.train_dir, cfg)
    val_set = LaneGraphDataset(args.val_dir, cfg)
    train_sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True)
    val_sampler = DistributedSampler(val_set, num_replicas=world, rank=rank, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    net = LaneGCN(cfg).cuda()
    net = DistributedDataParallel(net, device_ids=[local_rank])
    # LaneGCN's lr 1e-3 was set for 4 GPUs x 32
    lr = args.lr * world / 4
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=args.lr_epochs, gamma=0.1)

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=lambda s, loc: s.cuda(local_rank))
        net.module.load_state_dict(ckpt["state_dict"])
        opt.load_state_dict(ckpt["opt_state"])
        sched.load_state_dict(ckpt["sched_state"])
        start_epoch = ckpt["epoch"] + 1
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        net.train()
        tic = time.time()
        run_loss = torch.zeros(2, device="cuda")
        for i, batch in enumerate(train_loader):
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
            reg, cls = net(batch)
            loss, _, _ = pred_loss(cfg, reg, cls, batch["gt"], batch["has"], batch["actor_mask"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            run_loss += torch.stack([loss.detach(), torch.ones((), device="cuda")])
        sched.step()
        dist.all_reduce(run_loss)
        log.info("epoch %d train loss %.4f lr %.2e time %.1f", epoch,
                 (run_loss[0] / run_loss[1]).item(), sched.get_last_lr()[0], time.time() - tic)

        net.eval()
        stats = torch.zeros(4, device="cuda")  # ade1, fde1, min fde6, count
        with torch.no_grad():
            for batch in val_loader:
                batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
                reg, cls = net.module(batch)
                full = batch["has"].all(-1) & batch["actor_mask"]
                top = cls.argmax(-1)
                r_top = reg.gather(2, top[..., None, None, None].expand(-1, -1, 1, cfg.fut_len, 2)).squeeze(2)
                err1 = (r_top - batch["gt"]).norm(dim=-1)
                fde6 = (reg[..., -1, :] - batch["gt"][:, :, None, -1]).norm(dim=-1).min(-1).values
                stats += torch.stack([err1.mean(-1)[full].sum(), err1[..., -1][full].sum(),
                                      fde6[full].sum(), full.sum().float()])
        dist.all_reduce(stats)
        n = stats[3].clamp(min=1)
        log.info("epoch %d val ade1 %.3f fde1 %.3f minFDE6 %.3f", epoch,
                 (stats[0] / n).item(), (stats[1] / n).item(), (stats[2] / n).item())

        if rank == 0 and (epoch + 1) % 2 == 0:
            torch.save({"epoch": epoch, "state_dict": net.module.state_dict(),
                        "opt_state": opt.state_dict(), "sched_state": sched.state_dict()},
                       os.path.join(args.save_dir, f"{epoch + 1:03d}.ckpt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
