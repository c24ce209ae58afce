"""LaneGCN-lite multi-agent motion forecasting.

torchrun --nproc_per_node=8 03_lanegcn_multiagent.py --config configs/lanegcn_lite.yaml
"""
import argparse
import os
import pickle
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEFAULTS = dict(
    data_root="/mnt/datasets/av2_lanegcn", work_dir="work_dirs/lanegcn_lite",
    epochs=36, batch_size=16, lr=1e-3, lr_ref_batch=128, weight_decay=0.0,
    n_actor=128, n_map=128, num_mods=6, num_preds=30, actor2map_dist=7.0,
    map2actor_dist=6.0, actor2actor_dist=100.0, workers=8, log_every=100,
)


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    cfg["resume"] = args.resume
    return cfg


class LaneGCNData(Dataset):
    def __init__(self, root, split):
        self.files = sorted(Path(root, split).glob("*.pkl"))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        with open(self.files[i], "rb") as f:
            d = pickle.load(f)
        return {
            "feats": torch.from_numpy(d["feats"]).float(),        # (A, 20, 3) dx, dy, valid
            "ctrs": torch.from_numpy(d["ctrs"]).float(),          # (A, 2) last observed position
            "gt": torch.from_numpy(d["gt_preds"]).float(),        # (A, 30, 2)
            "has_gt": torch.from_numpy(d["has_preds"]).bool(),    # (A, 30)
            "lane_ctrs": torch.from_numpy(d["graph"]["ctrs"]).float(),
            "lane_feats": torch.from_numpy(d["graph"]["feats"]).float(),
            "pre": torch.from_numpy(d["graph"]["pre"]).long(),    # (2, E) u <- v
            "suc": torch.from_numpy(d["graph"]["suc"]).long(),
        }


def collate_graph(samples):
    out = {k: [] for k in ["feats", "ctrs", "gt", "has_gt", "lane_ctrs", "lane_feats", "pre", "suc",
                           "actor_batch", "lane_batch"]}
    a_off = l_off = 0
    for b, s in enumerate(samples):
        A, M = s["ctrs"].shape[0], s["lane_ctrs"].shape[0]
        for k in ["feats", "ctrs", "gt", "has_gt", "lane_ctrs", "lane_feats"]:
            out[k].append(s[k])
        out["pre"].append(s["pre"] + l_off)
        out["suc"].append(s["suc"] + l_off)
        out["actor_batch"].append(torch.full((A,), b, dtype=torch.long))
        out["lane_batch"].append(torch.full((M,), b, dtype=torch.long))
        a_off += A
        l_off += M
    cat_dims = {"pre": 1, "suc": 1}
    return {k: torch.cat(v, dim=cat_dims.get(k, 0)) for k, v in out.items()}


class ActorNet(nn.Module):
    def __init__(self, n_out):
        super().__init__()
        chans = [3, 32, 64, n_out]
        layers = []
        for cin, cout in zip(chans[:-1], chans[1:]):
            layers += [nn.Conv1d(cin, cout, 3, padding=1), nn.GroupNorm(1, cout), nn.ReLU(inplace=True)]
        self.net = nn.Sequential(*layers)

    def forward(self, feats):
        return self.net(feats.transpose(1, 2))[:, :, -1]


class MapNet(nn.Module):
    def __init__(self, n_map, num_iters=4):
        super().__init__()
        self.inp = nn.Sequential(nn.Linear(4, n_map), nn.ReLU(inplace=True), nn.Linear(n_map, n_map))
        self.fuse = nn.ModuleList()
        for _ in range(num_iters):
            self.fuse.append(nn.ModuleDict({
                "ctr": nn.Linear(n_map, n_map, bias=False), "pre": nn.Linear(n_map, n_map, bias=False),
                "suc": nn.Linear(n_map, n_map, bias=False), "norm": nn.GroupNorm(1, n_map),
                "out": nn.Linear(n_map, n_map)}))

    def forward(self, lane_ctrs, lane_feats, pre, suc):
        feat = F.relu(self.inp(torch.cat([lane_ctrs, lane_feats], -1)))
        for blk in self.fuse:
            res = feat
            tmp = blk["ctr"](feat)
            tmp = tmp.index_add(0, pre[0], blk["pre"](feat[pre[1]]))
            tmp = tmp.index_add(0, suc[0], blk["suc"](feat[suc[1]]))
            feat = F.relu(blk["out"](F.relu(blk["norm"](tmp))) + res)
        return feat


class Att(nn.Module):
    """Distance-gated message passing from context nodes to agent/lane nodes."""

    def __init__(self, n_agt, n_ctx):
        super().__init__()
        self.dist = nn.Sequential(nn.Linear(2, n_ctx), nn.ReLU(inplace=True), nn.Linear(n_ctx, n_ctx))
        self.query = nn.Linear(n_agt, n_ctx)
        self.ctx = nn.Sequential(nn.Linear(3 * n_ctx, n_agt), nn.GroupNorm(1, n_agt), nn.ReLU(inplace=True))
        self.out = nn.Linear(n_agt, n_agt)
        self.norm = nn.GroupNorm(1, n_agt)

    def forward(self, agts, agt_ctrs, agt_batch, ctx, ctx_ctrs, ctx_batch, th):
        d = torch.cdist(agt_ctrs, ctx_ctrs)
        mask = (d <= th) & (agt_batch[:, None] == ctx_batch[None, :])
        hi, wi = mask.nonzero(as_tuple=True)
        msg = torch.cat([self.dist(agt_ctrs[hi] - ctx_ctrs[wi]), self.query(agts[hi]), ctx[wi]], -1)
        agg = torch.zeros_like(agts).index_add(0, hi, self.ctx(msg))
        return F.relu(self.norm(self.out(agg)) + agts)


class LaneGCNLite(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        na, nm = cfg["n_actor"], cfg["n_map"]
        self.cfg = cfg
        self.actor_net = ActorNet(na)
        self.map_net = MapNet(nm)
        self.a2m = Att(nm, na)
        self.m2a = Att(na, nm)
        self.a2a = Att(na, na)
        self.reg = nn.ModuleList([nn.Sequential(nn.Linear(na, na), nn.GroupNorm(1, na), nn.ReLU(inplace=True),
                                                nn.Linear(na, 2 * cfg["num_preds"])) for _ in range(cfg["num_mods"])])
        self.cls = nn.Sequential(nn.Linear(na + 2, na), nn.ReLU(inplace=True), nn.Linear(na, 1))

    def forward(self, b):
        actors = self.actor_net(b["feats"])
        lanes = self.map_net(b["lane_ctrs"], b["lane_feats"], b["pre"], b["suc"])
        lanes = self.a2m(lanes, b["lane_ctrs"], b["lane_batch"], actors, b["ctrs"], b["actor_batch"],
                         self.cfg["actor2map_dist"])
        actors = self.m2a(actors, b["ctrs"], b["actor_batch"], lanes, b["lane_ctrs"], b["lane_batch"],
                          self.cfg["map2actor_dist"])
        actors = self.a2a(actors, b["ctrs"], b["actor_batch"], actors, b["ctrs"], b["actor_batch"],
                          self.cfg["actor2actor_dist"])
        reg = torch.stack([r(actors).view(-1, self.cfg["num_preds"], 2) for r in self.reg], 1)
        reg = reg + b["ctrs"][:, None, None, :]
        dest = reg[:, :, -1] - b["ctrs"][:, None]
        cls = self.cls(torch.cat([actors[:, None].expand(-1, reg.shape[1], -1), dest], -1)).squeeze(-1)
        return reg, cls


def lanegcn_loss(reg, cls, gt, has_gt):
    valid = has_gt[:, -1]
    reg, cls, gt, has_gt = reg[valid], cls[valid], gt[valid], has_gt[valid]
    fde = torch.norm(reg[:, :, -1] - gt[:, None, -1], dim=-1)
    best = fde.argmin(1)
    cls_loss = F.cross_entropy(cls, best)
    sel = reg[torch.arange(reg.shape[0], device=reg.device), best]
    reg_loss = F.smooth_l1_loss(sel[has_gt], gt[has_gt])
    return cls_loss + reg_loss


def to_dev(b, device):
    return {k: v.to(device, non_blocking=True) for k, v in b.items()}


@torch.no_grad()
def validate(net, loader, device, world_size):
    net.eval()
    ades, fdes = [], []
    for b in loader:
        b = to_dev(b, device)
        reg, _ = net(b)
        valid = b["has_gt"].all(-1)
        err = torch.norm(reg[valid] - b["gt"][valid][:, None], dim=-1)  # (n, K, T)
        ades.append(err.mean(-1).min(-1).values)
        fdes.append(err[..., -1].min(-1).values)
    ade_local = torch.cat(ades)
    fde_local = torch.cat(fdes)
    ade_list = [torch.zeros_like(ade_local) for _ in range(world_size)]
    fde_list = [torch.zeros_like(fde_local) for _ in range(world_size)]
    dist.all_gather(ade_list, ade_local)
    dist.all_gather(fde_list, fde_local)
    ade_all, fde_all = torch.cat(ade_list), torch.cat(fde_list)
    net.train()
    return ade_all.mean().item(), fde_all.mean().item(), (fde_all > 2.0).float().mean().item()


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set = LaneGCNData(cfg["data_root"], "train")
    val_set = LaneGCNData(cfg["data_root"], "val")
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_idx = list(range(rank, len(val_set), world_size))
    train_loader = DataLoader(train_set, cfg["batch_size"], sampler=train_sampler, collate_fn=collate_graph,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, val_idx), cfg["batch_size"], shuffle=False,
                            collate_fn=collate_graph, num_workers=cfg["workers"], pin_memory=True)

    net = LaneGCNLite(cfg).to(device)
    model = DDP(net, device_ids=[local_rank])
    lr = cfg["lr"] * cfg["batch_size"] * world_size / cfg["lr_ref_batch"]
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=cfg["weight_decay"])
    milestones = [int(cfg["epochs"] * 0.8) * len(train_loader)]
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=milestones, gamma=0.1)

    start_epoch = 0
    if cfg["resume"]:
        ck = torch.load(cfg["resume"], map_location="cpu")
        net.load_state_dict(ck["net"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch = ck["epoch"] + 1
    if rank == 0:
        os.makedirs(cfg["work_dir"], exist_ok=True)

    for epoch in range(start_epoch, cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for i, b in enumerate(train_loader):
            b = to_dev(b, device)
            reg, cls = model(b)
            loss = lanegcn_loss(reg, cls, b["gt"], b["has_gt"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if (i + 1) % cfg["log_every"] == 0:
                l = loss.detach()
                dist.all_reduce(l)
                if rank == 0:
                    print(f"epoch {epoch} [{i + 1}/{len(train_loader)}] loss {l.item() / world_size:.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / (i + 1):.3f}s/it", flush=True)

        ade, fde, mr = validate(net, val_loader, device, world_size)
        if rank == 0:
            print(f"== epoch {epoch}: minADE6 {ade:.3f} minFDE6 {fde:.3f} MR {mr:.3f}", flush=True)
            torch.save({"net": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(cfg["work_dir"], f"epoch_{epoch}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
