"""
FCGF-style fully convolutional geometric features on 3DMatch pairs
(MinkowskiEngine ResUNet, hardest-contrastive loss), multi-GPU.

    torchrun --nproc_per_node=4 train_fcgf.py --threed_match_dir data/threedmatch --voxel_size 0.025
"""
import argparse
import glob
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from scipy.spatial import cKDTree
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import MinkowskiEngine as ME


def get_config():
    p = argparse.ArgumentParser()
    p.add_argument("--threed_match_dir", default="data/threedmatch")
    p.add_argument("--voxel_size", type=float, default=0.025)
    p.add_argument("--positive_pair_search_voxel_size_multiplier", type=float, default=1.5)
    p.add_argument("--num_pos_per_batch", type=int, default=1024)
    p.add_argument("--num_hn_samples_per_batch", type=int, default=256)
    p.add_argument("--pos_thresh", type=float, default=0.1)
    p.add_argument("--neg_thresh", type=float, default=1.4)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--max_epoch", type=int, default=100)
    p.add_argument("--lr", type=float, default=0.1, help="for 16 pairs per step")
    p.add_argument("--out_dir", default="outputs/fcgf")
    return p.parse_args()


def random_rotation(max_angle=np.pi):
    axis = np.random.randn(3)
    axis /= np.linalg.norm(axis)
    angle = np.random.uniform(-max_angle, max_angle)
    K = np.array([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]])
    return (np.eye(3) + np.sin(angle) * K + (1 - np.cos(angle)) * K @ K).astype(np.float32)


class ThreeDMatchPairs(Dataset):
    def __init__(self, root, split, voxel_size, search_mult, rotate=True):
        self.files = []
        for txt in sorted(glob.glob(os.path.join(root, f"{split}_*.txt"))):
            for line in open(txt):
                a, b = line.split()[:2]
                self.files.append((os.path.join(root, a), os.path.join(root, b)))
        self.voxel_size, self.search_r, self.rotate = voxel_size, voxel_size * search_mult, rotate

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        xyz0 = np.load(self.files[i][0])["pcd"].astype(np.float32)
        xyz1 = np.load(self.files[i][1])["pcd"].astype(np.float32)   # already aligned to xyz0
        R = random_rotation() if self.rotate else np.eye(3, dtype=np.float32)
        xyz1 = xyz1 @ R.T
        _, sel0 = ME.utils.sparse_quantize(xyz0 / self.voxel_size, return_index=True)
        _, sel1 = ME.utils.sparse_quantize(xyz1 / self.voxel_size, return_index=True)
        xyz0, xyz1 = xyz0[sel0], xyz1[sel1]
        # matches in the aligned frame
        tree = cKDTree(xyz1 @ R)
        nn_dist, nn_idx = tree.query(xyz0, k=1, distance_upper_bound=self.search_r)
        ok = np.isfinite(nn_dist)
        matches = np.stack([np.where(ok)[0], nn_idx[ok]], 1)
        c0 = np.floor(xyz0 / self.voxel_size).astype(np.int32)
        c1 = np.floor(xyz1 / self.voxel_size).astype(np.int32)
        return c0, c1, np.ones((len(c0), 1), np.float32), np.ones((len(c1), 1), np.float32), matches


def collate_pairs(batch):
    c0, c1, f0, f1, matches = zip(*batch)
    off0, off1, all_m = 0, 0, []
    for a, b, m in zip(c0, c1, matches):
        all_m.append(torch.from_numpy(m) + torch.tensor([off0, off1]))
        off0, off1 = off0 + len(a), off1 + len(b)
    bc0, bf0 = ME.utils.sparse_collate(list(c0), list(f0))
    bc1, bf1 = ME.utils.sparse_collate(list(c1), list(f1))
    return bc0, bf0, bc1, bf1, torch.cat(all_m).long()


def conv(cin, cout, k=3, s=1, transpose=False):
    cls = ME.MinkowskiConvolutionTranspose if transpose else ME.MinkowskiConvolution
    return nn.Sequential(cls(cin, cout, kernel_size=k, stride=s, dimension=3), ME.MinkowskiBatchNorm(cout),
                         ME.MinkowskiReLU())


class ResUNetBN2C(nn.Module):
    def __init__(self, in_ch=1, out_ch=32):
        super().__init__()
        self.e1, self.e2 = conv(in_ch, 32, 7), conv(32, 64, 3, 2)
        self.e3, self.e4 = conv(64, 128, 3, 2), conv(128, 256, 3, 2)
        self.d4 = conv(256, 128, 3, 2, transpose=True)
        self.d3 = conv(256, 64, 3, 2, transpose=True)
        self.d2 = conv(128, 64, 3, 2, transpose=True)
        self.final = ME.MinkowskiConvolution(96, out_ch, kernel_size=1, dimension=3)

    def forward(self, x):
        s1 = self.e1(x)
        s2 = self.e2(s1)
        s4 = self.e3(s2)
        s8 = self.e4(s4)
        o = ME.cat(self.d4(s8), s4)
        o = ME.cat(self.d3(o), s2)
        o = ME.cat(self.d2(o), s1)
        o = self.final(o)
        return ME.SparseTensor(F.normalize(o.F, dim=1), coordinate_map_key=o.coordinate_map_key,
                               coordinate_manager=o.coordinate_manager)


def hardest_contrastive(F0, F1, pos, cfg):
    if len(pos) > cfg.num_pos_per_batch:
        pos = pos[torch.randperm(len(pos), device=pos.device)[: cfg.num_pos_per_batch]]
    hn0 = torch.randperm(len(F0), device=F0.device)[: cfg.num_hn_samples_per_batch]
    hn1 = torch.randperm(len(F1), device=F1.device)[: cfg.num_hn_samples_per_batch]
    p0, p1 = F0[pos[:, 0]], F1[pos[:, 1]]
    d0 = torch.cdist(p0, F1[hn1])
    d1 = torch.cdist(p1, F0[hn0])
    pos_loss = F.relu((p0 - p1).norm(dim=1) - cfg.pos_thresh).pow(2)
    neg_loss0 = F.relu(cfg.neg_thresh - d0.min(1)[0]).pow(2)
    neg_loss1 = F.relu(cfg.neg_thresh - d1.min(1)[0]).pow(2)
    return pos_loss.mean() + 0.5 * (neg_loss0.mean() + neg_loss1.mean())


@torch.no_grad()
def feature_match_recall(net, loader, device, tau=0.1):
    """Fraction of ground-truth matches whose mutual nearest feature is correct (proxy for FMR)."""
    net.eval()
    hit, tot = torch.zeros((), device=device), torch.zeros((), device=device)
    for c0, f0, c1, f1, m in loader:
        F0 = net(ME.SparseTensor(f0.to(device), coordinates=c0.to(device))).F
        F1 = net(ME.SparseTensor(f1.to(device), coordinates=c1.to(device))).F
        m = m.to(device)
        nn1 = torch.cdist(F0[m[:, 0]], F1).argmin(1)
        hit += ((nn1 == m[:, 1]).float().mean() > tau).float()
        tot += 1
    dist.all_reduce(hit)
    dist.all_reduce(tot)
    net.train()
    return (hit / tot).item()


def main():
    cfg = get_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN, format="%(asctime)s %(message)s")
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)

    train_set = ThreeDMatchPairs(cfg.threed_match_dir, "train", cfg.voxel_size,
                                 cfg.positive_pair_search_voxel_size_multiplier)
    val_set = ThreeDMatchPairs(cfg.threed_match_dir, "val", cfg.voxel_size,
                               cfg.positive_pair_search_voxel_size_multiplier, rotate=False)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler, num_workers=8,
                        collate_fn=collate_pairs, drop_last=True, pin_memory=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)), batch_size=1,
                            num_workers=4, collate_fn=collate_pairs)

    model = ResUNetBN2C(1, 32).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr * cfg.batch_size * world / 16, momentum=0.8,
                                weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.99)

    best_fmr = 0.0
    for epoch in range(cfg.max_epoch):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for it, (c0, f0, c1, f1, matches) in enumerate(loader):
            s0 = ME.SparseTensor(f0.to(device), coordinates=c0.to(device))
            s1 = ME.SparseTensor(f1.to(device), coordinates=c1.to(device))
            F0 = model(s0).F
            F1 = model(s1).F
            loss = hardest_contrastive(F0, F1, matches.to(device), cfg)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if it % 40 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l)
                logging.info(f"epoch {epoch} iter {it}/{len(loader)} loss {l.item() / world:.4f} "
                             f"{(time.time() - tic) / (it + 1):.2f}s/it")
        scheduler.step()

        fmr = feature_match_recall(model.module, val_loader, device)
        logging.info(f"epoch {epoch} val FMR {fmr:.4f}")
        if rank == 0:
            state = {"epoch": epoch, "state_dict": model.module.state_dict(),
                     "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "config": vars(cfg)}
            torch.save(state, os.path.join(cfg.out_dir, "checkpoint.pth"))
            if fmr > best_fmr:
                best_fmr = fmr
                torch.save(state, os.path.join(cfg.out_dir, "best_val_checkpoint.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
