"""Ego planner with open-loop training and a periodic closed-loop (non-reactive) evaluation.

Closed-loop eval: every N epochs the planner drives the ego through held-out scenarios for 15 s
at 10 Hz with a kinematic bicycle model; other agents replay their logged tracks. We report a
simplified nuPlan CLS-NR: no-collision, drivable-area compliance, progress, comfort.

    torchrun --nproc_per_node=8 13_closed_loop_metrics.py --train-cache /nas/nuplan/cache/train \
        --sim-scenarios /nas/nuplan/val14_scenarios --out /nas/exp/cl_planner
"""
import argparse
import glob
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

PLAN_T = 16  # 8 s at 2 Hz
DT_SIM = 0.1
SIM_STEPS = 150
WHEELBASE = 3.089
EGO_LEN, EGO_WID = 4.049 + 1.127, 2.297


class CachedFrames(Dataset):
    def __init__(self, root):
        self.files = sorted(glob.glob(os.path.join(root, "*.npz")))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(self.files[i])
        return {k: torch.from_numpy(d[k]) for k in ("ego", "agents", "agents_mask", "lanes", "lanes_mask", "plan")}


class Planner(nn.Module):
    def __init__(self, d=192):
        super().__init__()
        self.ego = nn.Sequential(nn.Linear(5, d), nn.ReLU(), nn.Linear(d, d))
        self.agents = nn.Sequential(nn.Linear(7, d), nn.ReLU(), nn.Linear(d, d))
        self.lanes = nn.Sequential(nn.Linear(3, d), nn.ReLU(), nn.Linear(d, d))
        layer = nn.TransformerEncoderLayer(d, 6, 4 * d, 0.1, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, 3)
        self.head = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, PLAN_T * 3))

    def forward(self, ego, agents, agents_mask, lanes, lanes_mask):
        e = self.ego(ego)[:, None]
        a = self.agents(agents)
        l = self.lanes(lanes).max(2).values
        pad = ~torch.cat([torch.ones_like(agents_mask[:, :1]), agents_mask, lanes_mask], 1)
        x = self.enc(torch.cat([e, a, l], 1), src_key_padding_mask=pad)
        return self.head(x[:, 0]).view(-1, PLAN_T, 3)


# ---------------------------------------------------------------- closed-loop simulation

def to_local(points, pose):
    c, s = math.cos(-pose[2]), math.sin(-pose[2])
    R = np.array([[c, -s], [s, c]], np.float32)
    return (points - pose[:2]) @ R.T


def boxes_overlap(p0, yaw0, l0, w0, p1, yaw1, l1, w1):
    # separating axis test for two oriented rectangles
    def corners(p, yaw, l, w):
        c, s = math.cos(yaw), math.sin(yaw)
        dx, dy = np.array([c, s]) * l / 2, np.array([-s, c]) * w / 2
        return np.stack([p + dx + dy, p + dx - dy, p - dx - dy, p - dx + dy])
    a, b = corners(p0, yaw0, l0, w0), corners(p1, yaw1, l1, w1)
    for poly in (a, b):
        for i in range(4):
            edge = poly[(i + 1) % 4] - poly[i]
            axis = np.array([-edge[1], edge[0]])
            pa, pb = a @ axis, b @ axis
            if pa.max() < pb.min() or pb.max() < pa.min():
                return False
    return True


def track_plan(state, plan_local):
    """Pure-pursuit on the first planned waypoints; returns (accel, steer)."""
    x, y, yaw, v = state
    target = plan_local[min(2, len(plan_local) - 1), :2]
    ld = max(np.linalg.norm(target), 1e-3)
    steer = math.atan2(2 * WHEELBASE * target[1], ld ** 2)
    v_target = np.linalg.norm(plan_local[1, :2] - plan_local[0, :2]) / 0.5
    accel = np.clip((v_target - v) / 0.5, -4.0, 2.5)
    return accel, np.clip(steer, -0.6, 0.6)


@torch.no_grad()
def simulate(planner, scenario_file, device):
    sc = np.load(scenario_file)
    ego = sc["ego_init"].astype(np.float32).copy()  # x, y, yaw, v
    agent_tracks = sc["agent_tracks"]  # [A, SIM_STEPS, 5] x, y, yaw, length, width (logged)
    drivable = sc["drivable_polygon_grid"]  # occupancy grid [H, W] (1 = drivable)
    grid_origin, grid_res = sc["grid_origin"], float(sc["grid_resolution"])
    lanes_world = sc["lanes"]  # [L, 20, 3]
    route_len = float(sc["expert_progress"])

    collided, off_road, progress = False, 0, 0.0
    accels, jerks, prev_acc = [], [], 0.0
    for t in range(SIM_STEPS):
        if t % 5 == 0:  # replan at 2 Hz
            ag = agent_tracks[:, t]
            ag_local = np.concatenate([to_local(ag[:, :2], ego[:3]), (ag[:, 2:3] - ego[2]), ag[:, 3:5],
                                       np.zeros((len(ag), 2), np.float32)], -1).astype(np.float32)
            ln = lanes_world.copy()
            ln[..., :2] = to_local(ln[..., :2], ego[:3])
            ln[..., 2] -= ego[2]
            inp = [torch.from_numpy(np.array([0, 0, 0, ego[3], 0], np.float32))[None],
                   torch.from_numpy(ag_local)[None], torch.ones(1, len(ag), dtype=torch.bool),
                   torch.from_numpy(ln.astype(np.float32))[None], torch.ones(1, len(ln), dtype=torch.bool)]
            plan = planner(*[x.to(device) for x in inp])[0].cpu().numpy()
        acc, steer = track_plan(ego, plan)
        ego[0] += ego[3] * math.cos(ego[2]) * DT_SIM
        ego[1] += ego[3] * math.sin(ego[2]) * DT_SIM
        ego[2] += ego[3] / WHEELBASE * math.tan(steer) * DT_SIM
        ego[3] = max(0.0, ego[3] + acc * DT_SIM)
        progress += ego[3] * DT_SIM
        jerks.append((acc - prev_acc) / DT_SIM)
        accels.append(acc)
        prev_acc = acc

        gi = ((ego[:2] - grid_origin) / grid_res).astype(int)
        if not (0 <= gi[1] < drivable.shape[0] and 0 <= gi[0] < drivable.shape[1]) or drivable[gi[1], gi[0]] == 0:
            off_road += 1
        for a in agent_tracks[:, t]:
            if np.linalg.norm(a[:2] - ego[:2]) < 8.0 and boxes_overlap(ego[:2], ego[2], EGO_LEN, EGO_WID,
                                                                       a[:2], a[2], a[3], a[4]):
                collided = True

    no_collision = 0.0 if collided else 1.0
    drivable_ok = 1.0 if off_road == 0 else 0.0
    prog = min(1.0, progress / max(route_len, 1.0))
    comfortable = float(np.abs(accels).max() < 4.0 and np.abs(jerks).max() < 8.4)
    score = no_collision * drivable_ok * (5 * prog + 2 * comfortable) / 7
    return np.array([score, no_collision, drivable_ok, prog, comfortable], np.float64)


def closed_loop_eval(planner, files, rank, world, device):
    planner.eval()
    mine = files[rank::world]
    results = np.stack([simulate(planner, f, device) for f in mine]) if mine else np.zeros((0, 5))
    planner.train()
    mean = results.mean(0) if len(results) else np.zeros(5)
    return dict(zip(["CLS_NR", "no_collision", "drivable", "progress", "comfort"], mean.tolist()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-cache", required=True)
    ap.add_argument("--sim-scenarios", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--sim-every", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    ds = CachedFrames(args.train_cache)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True)
    sim_files = sorted(glob.glob(os.path.join(args.sim_scenarios, "*.npz")))

    model = DDP(Planner().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world * args.batch_size / 512, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))

    best_cls = -1.0
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for b in loader:
            b = {k: v.to(device, non_blocking=True).float() if v.is_floating_point() else v.to(device)
                 for k, v in b.items()}
            plan = model(b["ego"], b["agents"], b["agents_mask"], b["lanes"], b["lanes_mask"])
            loss = F.smooth_l1_loss(plan, b["plan"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)
        if rank == 0:
            print(f"epoch {epoch} open-loop loss {(run[0] / run[1]).item():.4f} ({time.time() - t0:.0f}s)",
                  flush=True)

        if (epoch + 1) % args.sim_every == 0 or epoch == args.epochs - 1:
            metrics = closed_loop_eval(model.module, sim_files, rank, world, device)
            if rank == 0:
                print(f"epoch {epoch} closed-loop " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()),
                      flush=True)
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "metrics": metrics},
                           os.path.join(args.out, f"planner_ep{epoch}.pt"))
                if metrics["CLS_NR"] > best_cls:
                    best_cls = metrics["CLS_NR"]
                    torch.save({"model": model.module.state_dict(), "epoch": epoch, "metrics": metrics},
                               os.path.join(args.out, "best.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
