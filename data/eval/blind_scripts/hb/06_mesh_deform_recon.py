"""Sphere-deformation mesh reconstruction from point clouds (Pixel2Mesh-style GCN, point input).

torchrun --nproc_per_node=4 06_mesh_deform_recon.py --config configs/deform_chairs.yaml
"""
import argparse
import logging
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from pytorch3d.loss import (chamfer_distance, mesh_edge_loss, mesh_laplacian_smoothing,
                            mesh_normal_consistency)
from pytorch3d.ops import GraphConv, sample_points_from_meshes
from pytorch3d.structures import Meshes
from pytorch3d.utils import ico_sphere
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("deform")


class PointsWithGT(Dataset):
    """Each item: partial/noisy input scan and dense GT surface samples with normals."""

    def __init__(self, root, split, n_in=2048, n_gt=8192):
        with open(os.path.join(root, f"{split}.txt")) as f:
            self.ids = [l.strip() for l in f if l.strip()]
        self.root, self.n_in, self.n_gt = root, n_in, n_gt

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        d = np.load(os.path.join(self.root, "samples", self.ids[i] + ".npz"))
        scan, gt, nrm = d["scan"], d["surface"], d["normals"]
        a = np.random.choice(len(scan), self.n_in, replace=len(scan) < self.n_in)
        b = np.random.choice(len(gt), self.n_gt, replace=False)
        return (torch.from_numpy(scan[a]).float(), torch.from_numpy(gt[b]).float(),
                torch.from_numpy(nrm[b]).float())


class PointFeat(nn.Module):
    def __init__(self, dim=512):
        super().__init__()
        self.net = nn.Sequential(nn.Conv1d(3, 64, 1), nn.ReLU(), nn.Conv1d(64, 128, 1), nn.ReLU(),
                                 nn.Conv1d(128, 256, 1), nn.ReLU(), nn.Conv1d(256, dim, 1))

    def forward(self, x):
        return self.net(x.transpose(1, 2)).max(-1)[0]


class DeformBlock(nn.Module):
    def __init__(self, feat_dim, hidden=256, n_gconv=4):
        super().__init__()
        self.inp = GraphConv(3 + feat_dim, hidden)
        self.gconvs = nn.ModuleList([GraphConv(hidden, hidden) for _ in range(n_gconv)])
        self.out = GraphConv(hidden, 3)
        nn.init.zeros_(self.out.w0.weight)
        nn.init.zeros_(self.out.w1.weight)

    def forward(self, meshes, feat):
        verts = meshes.verts_packed()
        edges = meshes.edges_packed()
        idx = meshes.verts_packed_to_mesh_idx()
        h = F.relu(self.inp(torch.cat([verts, feat[idx]], 1), edges))
        for g in self.gconvs:
            h = F.relu(g(h, edges)) + h
        return meshes.offset_verts(torch.tanh(self.out(h, edges)) * 0.1)


class MeshDeformNet(nn.Module):
    def __init__(self, feat_dim=512, stages=3, ico_level=4):
        super().__init__()
        self.ico_level = ico_level
        self.encoder = PointFeat(feat_dim)
        self.stages = nn.ModuleList([DeformBlock(feat_dim) for _ in range(stages)])

    def forward(self, scan):
        feat = self.encoder(scan)
        meshes = ico_sphere(self.ico_level, scan.device).extend(scan.shape[0])
        outs = []
        for stage in self.stages:
            meshes = stage(meshes, feat)
            outs.append(meshes)
        return outs


def mesh_losses(meshes, gt, gt_normals, w, n_samples):
    pts, nrm = sample_points_from_meshes(meshes, n_samples, return_normals=True)
    l_cd, l_n = chamfer_distance(pts, gt, x_normals=nrm, y_normals=gt_normals)
    return (w["chamfer"] * l_cd + w["normal"] * l_n + w["edge"] * mesh_edge_loss(meshes)
            + w["lap"] * mesh_laplacian_smoothing(meshes, method="uniform")
            + w["consistency"] * mesh_normal_consistency(meshes)), l_cd


@torch.no_grad()
def evaluate(model, loader, device, n_samples):
    model.eval()
    tot = torch.zeros(2, device=device)
    for scan, gt, _ in loader:
        scan, gt = scan.to(device), gt.to(device)
        final = model(scan)[-1]
        pts = sample_points_from_meshes(final, n_samples)
        cd, _ = chamfer_distance(pts, gt, batch_reduction="sum")
        tot += torch.stack([cd, torch.tensor(float(scan.shape[0]), device=device)])
    model.train()
    return tot


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")

    train_ds = PointsWithGT(cfg["data_root"], "train")
    val_ds = PointsWithGT(cfg["data_root"], "val")
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, cfg["batch_size"], sampler=train_sampler, drop_last=True,
                          num_workers=cfg["workers"], pin_memory=True)
    val_dl = DataLoader(val_ds, cfg["batch_size"], sampler=val_sampler, num_workers=2)

    model = DDP(MeshDeformNet(cfg["feat_dim"], cfg["stages"]).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"], weight_decay=1e-6)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, cfg["milestones"], gamma=0.3)
    w = cfg["loss_weights"]

    os.makedirs(cfg["out_dir"], exist_ok=True)
    best = float("inf")
    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        for it, (scan, gt, gt_n) in enumerate(train_dl):
            scan, gt, gt_n = scan.to(device), gt.to(device), gt_n.to(device)
            outs = model(scan)
            loss = 0.0
            for s, meshes in enumerate(outs):
                l, cd = mesh_losses(meshes, gt, gt_n, w, cfg["n_samples"])
                loss = loss + l * (0.5 if s < len(outs) - 1 else 1.0)

            if not torch.isfinite(loss):
                log.warning("non-finite loss at epoch %d it %d, skipping batch", epoch, it)
                opt.zero_grad(set_to_none=True)
                continue

            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if it % 50 == 0:
                log.info("ep %d it %d loss %.5f cd %.5f", epoch, it, loss.item(), cd.item())
        sched.step()

        tot = evaluate(model, val_dl, device, cfg["n_samples"])
        dist.all_reduce(tot)
        val_cd = (tot[0] / tot[1]).item()
        log.info("epoch %d val chamfer %.6f", epoch, val_cd)
        if rank == 0:
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                     "sched": sched.state_dict(), "epoch": epoch, "val_cd": val_cd}
            torch.save(state, os.path.join(cfg["out_dir"], "last.pth"))
            if val_cd < best:
                best = val_cd
                torch.save(state, os.path.join(cfg["out_dir"], "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
