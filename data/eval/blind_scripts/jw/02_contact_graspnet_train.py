#!/usr/bin/env python
# Contact-GraspNet style training on ACRONYM-rendered tabletop scenes, with a
# closed-loop grasp success evaluation in PyBullet at the end of every epoch.
#
#   torchrun --standalone --nproc_per_node=4 02_contact_graspnet_train.py --cfg configs/cgn.yaml

import argparse
import glob
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from sim.tabletop import TabletopGraspSim  # repo-local pybullet wrapper


DEFAULTS = dict(
    data_dir="/data/acronym_scenes",
    eval_scene_dir="/data/acronym_scenes/eval",
    num_points=20000,
    batch_size=6,
    epochs=16,
    lr=1e-3,
    lr_decay=0.7,
    decay_every=4,
    workers=8,
    eval_scenes=200,
    grasps_per_scene=5,
    out="checkpoints/cgn",
    seed=1,
)


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    if a.cfg:
        with open(a.cfg) as f:
            cfg.update(yaml.safe_load(f) or {})
    if a.out:
        cfg["out"] = a.out
    return argparse.Namespace(**cfg)


class ContactSceneDataset(Dataset):
    def __init__(self, files, num_points):
        self.files = files
        self.num_points = num_points

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(self.files[i])
        pc = d["pc_cam"].astype(np.float32)
        sel = np.random.choice(len(pc), self.num_points, replace=len(pc) < self.num_points)
        pc = pc[sel]
        contact = d["contact_mask"][sel].astype(np.float32)
        approach = d["approach_dir"][sel].astype(np.float32)
        baseline = d["baseline_dir"][sel].astype(np.float32)
        width = d["grasp_width"][sel].astype(np.float32)
        # zero-center the cloud; offsets are re-added at inference
        pc = pc - pc.mean(0, keepdims=True)
        return torch.from_numpy(pc), torch.from_numpy(contact), torch.from_numpy(approach), \
            torch.from_numpy(baseline), torch.from_numpy(width)


class ContactGraspNet(nn.Module):
    def __init__(self, c=128):
        super().__init__()
        self.enc = nn.Sequential(
            nn.Conv1d(3, 64, 1), nn.GroupNorm(4, 64), nn.ReLU(),
            nn.Conv1d(64, c, 1), nn.GroupNorm(8, c), nn.ReLU(),
            nn.Conv1d(c, 2 * c, 1), nn.GroupNorm(8, 2 * c), nn.ReLU(),
        )
        self.dec = nn.Sequential(
            nn.Conv1d(4 * c, 2 * c, 1), nn.GroupNorm(8, 2 * c), nn.ReLU(),
            nn.Conv1d(2 * c, c, 1), nn.GroupNorm(8, c), nn.ReLU(),
        )
        self.contact = nn.Conv1d(c, 1, 1)
        self.approach = nn.Conv1d(c, 3, 1)
        self.baseline = nn.Conv1d(c, 3, 1)
        self.width = nn.Conv1d(c, 1, 1)

    def forward(self, pc):
        f = self.enc(pc.transpose(1, 2))
        g = f.max(2, keepdim=True)[0].expand_as(f)
        h = self.dec(torch.cat([f, g], 1))
        a = F.normalize(self.approach(h), dim=1)
        b = self.baseline(h)
        # make the baseline orthogonal to the approach direction
        b = F.normalize(b - (a * b).sum(1, keepdim=True) * a, dim=1)
        return self.contact(h).squeeze(1), a.transpose(1, 2), b.transpose(1, 2), self.width(h).squeeze(1)


def cgn_loss(pred, target):
    c_logit, a, b, w = pred
    contact, a_gt, b_gt, w_gt = target
    l_c = F.binary_cross_entropy_with_logits(c_logit, contact, pos_weight=torch.tensor(3.0, device=contact.device))
    m = contact > 0.5
    denom = m.sum().clamp(min=1)
    l_a = ((1 - (a * a_gt).sum(-1)) * m).sum() / denom
    l_b = ((1 - (b * b_gt).sum(-1)) * m).sum() / denom
    l_w = (F.smooth_l1_loss(w, w_gt, reduction="none") * m).sum() / denom
    return l_c + l_a + l_b + 10 * l_w


@torch.no_grad()
def predict_grasps(net, pc, k):
    c_logit, a, b, w = net(pc[None])
    score = torch.sigmoid(c_logit[0])
    top = score.topk(k).indices
    return pc[top].cpu().numpy(), a[0, top].cpu().numpy(), b[0, top].cpu().numpy(), \
        w[0, top].cpu().numpy(), score[top].cpu().numpy()


def sim_evaluate(net, scene_files, cfg, device):
    """Run each scene in the simulator and try the top-k grasps one by one."""
    net.eval()
    sim = TabletopGraspSim(gui=False)
    successes, attempts = 0, 0
    for path in scene_files:
        sim.reset_from_file(path)
        for _ in range(cfg.grasps_per_scene):
            pc = sim.render_point_cloud(num_points=cfg.num_points)
            if pc is None or len(pc) < 500:
                break
            center = pc.mean(0, keepdims=True)
            pc_t = torch.from_numpy((pc - center).astype(np.float32)).to(device)
            pts, app, base, width, _ = predict_grasps(net, pc_t, k=1)
            ok = sim.execute_grasp(pts[0] + center[0], app[0], base[0], float(width[0]))
            successes += int(ok)
            attempts += 1
            if sim.num_objects_on_table() == 0:
                break
    sim.close()
    net.train()
    return successes, attempts


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    train_files = sorted(glob.glob(os.path.join(cfg.data_dir, "train", "*.npz")))
    eval_files = sorted(glob.glob(os.path.join(cfg.eval_scene_dir, "*.json")))[: cfg.eval_scenes]
    my_eval_files = eval_files[rank::world]

    ds = ContactSceneDataset(train_files, cfg.num_points)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed)
    loader = DataLoader(ds, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.workers,
                        pin_memory=True, drop_last=True)

    net = ContactGraspNet().to(device)
    net = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(net.parameters(), lr=cfg.lr * world)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=cfg.decay_every, gamma=cfg.lr_decay)

    writer = SummaryWriter(os.path.join(cfg.out, "tb")) if rank == 0 else None
    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)

    best_sr = -1.0
    step = 0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        tic = time.time()
        loss_sum = torch.zeros((), device=device)
        for pc, contact, approach, baseline, width in loader:
            pc = pc.to(device, non_blocking=True)
            target = [t.to(device, non_blocking=True) for t in (contact, approach, baseline, width)]
            loss = cgn_loss(net(pc), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss_sum += loss.detach()
            step += 1
        sched.step()

        loss_sum /= len(loader)
        dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
        mean_loss = loss_sum.item() / world

        succ, att = sim_evaluate(net.module, my_eval_files, cfg, device)
        success_rate = succ / max(att, 1)

        if rank == 0:
            print(f"[epoch {epoch}] loss={mean_loss:.4f} sim success={success_rate:.3f} "
                  f"({succ}/{att}) time={time.time() - tic:.0f}s", flush=True)
            writer.add_scalar("train/loss", mean_loss, epoch)
            writer.add_scalar("eval/success_rate", success_rate, epoch)
            ckpt = {"epoch": epoch, "model": net.module.state_dict(), "opt": opt.state_dict(),
                    "success_rate": success_rate}
            torch.save(ckpt, os.path.join(cfg.out, "last.pt"))
            if success_rate > best_sr:
                best_sr = success_rate
                torch.save(ckpt, os.path.join(cfg.out, "best.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
