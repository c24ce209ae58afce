"""GSNet-style graspness learning: point-wise graspness + view-wise graspness,
then grasp operation prediction for the sampled graspable points.

Labels (graspness, view scores, angle/depth/width) were generated offline from
the simulated grasp annotations with collision filtering.

    torchrun --nproc_per_node=4 16_graspness_train.py --data /data/graspnet_sparse \
        --wandb-project graspness --run-name gsnet_rs_bs8
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

NUM_VIEW, NUM_ANGLE, NUM_DEPTH = 300, 12, 4
M_POINT = 1024


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--camera", default="realsense")
    p.add_argument("--num-points", type=int, default=15000)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--wandb-project", default="graspness")
    p.add_argument("--run-name", default=None)
    p.add_argument("--ckpt-dir", default="/nfs/ckpts/graspness")
    p.add_argument("--workers", type=int, default=6)
    return p


class GraspnessData(Dataset):
    def __init__(self, root, camera, split, num_points):
        self.files = sorted(os.path.join(root, camera, split, f) for f in os.listdir(os.path.join(root, camera, split)))
        self.num_points = num_points

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(self.files[i])
        n = len(d["xyz"])
        sel = np.random.choice(n, self.num_points, replace=n < self.num_points)
        return {
            "xyz": torch.from_numpy(d["xyz"][sel].astype(np.float32)),
            "objectness": torch.from_numpy(d["objectness"][sel].astype(np.int64)),
            "graspness": torch.from_numpy(d["graspness"][sel].astype(np.float32)),
            "view_score": torch.from_numpy(d["view_score"][sel].astype(np.float32)),       # (P, V)
            "op_score": torch.from_numpy(d["op_score"][sel].astype(np.float32)),           # (P, A*D)
            "op_width": torch.from_numpy(d["op_width"][sel].astype(np.float32)),           # (P, A*D)
        }


class GSNet(nn.Module):
    def __init__(self, c=256):
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv1d(3, 64, 1), nn.GroupNorm(8, 64), nn.ReLU(),
            nn.Conv1d(64, 128, 1), nn.GroupNorm(8, 128), nn.ReLU(),
            nn.Conv1d(128, c, 1), nn.GroupNorm(8, c), nn.ReLU())
        self.global_ctx = nn.Conv1d(c, c, 1)
        self.objectness = nn.Conv1d(2 * c, 2, 1)
        self.graspness = nn.Conv1d(2 * c, 1, 1)
        self.view = nn.Sequential(nn.Conv1d(2 * c, c, 1), nn.ReLU(), nn.Conv1d(c, NUM_VIEW, 1))
        self.op = nn.Sequential(nn.Conv1d(2 * c + 3, c, 1), nn.ReLU(), nn.Conv1d(c, 2 * NUM_ANGLE * NUM_DEPTH, 1))

    def forward(self, xyz, graspness_gt=None):
        f = self.backbone(xyz.transpose(1, 2))
        g = self.global_ctx(f).max(-1, keepdim=True)[0].expand_as(f)
        f = torch.cat([f, g], 1)
        objectness = self.objectness(f)
        graspness = self.graspness(f).squeeze(1)
        # sample graspable seeds: during training use the GT graspness so the op head sees good seeds
        score = graspness_gt if graspness_gt is not None else graspness.detach()
        score = score.masked_fill(objectness.argmax(1) == 0, -1e4)
        seeds = score.topk(M_POINT, dim=1).indices
        fs = torch.gather(f, 2, seeds[:, None].expand(-1, f.shape[1], -1))
        xs = torch.gather(xyz, 1, seeds[..., None].expand(-1, -1, 3)).transpose(1, 2)
        view = self.view(fs)
        op = self.op(torch.cat([fs, xs], 1))
        op_score, op_width = op.chunk(2, 1)
        return {"objectness": objectness, "graspness": graspness, "seeds": seeds,
                "view": view.transpose(1, 2), "op_score": op_score.transpose(1, 2), "op_width": op_width.transpose(1, 2)}


def gsnet_loss(out, b):
    l_obj = F.cross_entropy(out["objectness"], b["objectness"])
    mask = (b["objectness"] > 0).float()
    l_g = (F.smooth_l1_loss(out["graspness"], b["graspness"], reduction="none") * mask).sum() / mask.sum().clamp(min=1)
    take = lambda t: torch.gather(t, 1, out["seeds"][..., None].expand(-1, -1, t.shape[-1]))
    l_v = F.smooth_l1_loss(out["view"], take(b["view_score"]))
    l_s = F.smooth_l1_loss(out["op_score"], take(b["op_score"]))
    l_w = F.smooth_l1_loss(out["op_width"], take(b["op_width"]) * 10)
    total = l_obj + 10 * l_g + 100 * l_v + 15 * l_s + 10 * l_w
    return total, {"obj": l_obj, "graspness": l_g, "view": l_v, "score": l_s, "width": l_w}


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    train_ds = GraspnessData(args.data, args.camera, "train", args.num_points)
    val_ds = GraspnessData(args.data, args.camera, "test_seen", args.num_points)
    val_ds.files = val_ds.files[rank::world]
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, num_workers=args.workers)

    model = DDP(GSNet().to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: 0.95 ** e)
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for b in train_loader:
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            out = model(b["xyz"], graspness_gt=b["graspness"])
            loss, parts = gsnet_loss(out, b)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step % 20 == 0:
                vals = torch.stack([loss.detach()] + [v.detach() for v in parts.values()])
                dist.all_reduce(vals, op=dist.ReduceOp.AVG)
                logs = {"train/loss": vals[0].item(), "lr": sched.get_last_lr()[0]}
                logs.update({f"train/{k}": vals[i + 1].item() for i, k in enumerate(parts)})
                wandb.log(logs, step=step)
        sched.step()

        model.eval()
        v = torch.zeros(2, device=device)
        with torch.no_grad():
            for b in val_loader:
                b = {k: t.to(device) for k, t in b.items()}
                out = model.module(b["xyz"])
                l, _ = gsnet_loss(out, b)
                v += torch.stack([l * b["xyz"].shape[0], torch.tensor(float(b["xyz"].shape[0]), device=device)])
        dist.all_reduce(v)
        val_loss = (v[0] / v[1]).item()
        wandb.log({"val/loss": val_loss, "epoch": epoch}, step=step)
        if rank == 0:
            print(f"epoch {epoch}: val loss {val_loss:.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict()},
                       os.path.join(args.ckpt_dir, f"gsnet_epoch{epoch:02d}.tar"))
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
