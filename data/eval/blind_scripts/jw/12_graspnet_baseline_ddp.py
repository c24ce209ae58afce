"""GraspNet baseline training with distributed inference + graspnetAPI AP evaluation.

Every rank predicts grasps for its share of the test views; the predictions are
collected on rank 0, dumped in the graspnetAPI format and scored (AP over
friction coefficients 0.2 .. 1.2, computed with force-closure checks).

    torchrun --nproc_per_node=4 12_graspnet_baseline_ddp.py --dataset_root /data/graspnet \
        --camera realsense --log_dir logs/baseline_rs
"""
import argparse
import os
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from graspnetAPI import GraspGroup, GraspNetEval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

GRASP_DIM = 17  # graspnetAPI row: score, width, height, depth, R(9), t(3), object_id


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset_root", required=True)
    p.add_argument("--camera", default="realsense")
    p.add_argument("--log_dir", default="logs/baseline")
    p.add_argument("--num_point", type=int, default=20000)
    p.add_argument("--batch_size", type=int, default=2)
    p.add_argument("--max_epoch", type=int, default=18)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--eval_every", type=int, default=3)
    p.add_argument("--topk", type=int, default=1024)
    p.add_argument("--num_workers", type=int, default=4)
    return p.parse_args()


class GraspNetViews(Dataset):
    def __init__(self, root, camera, split, num_point):
        sids = list(range(100)) if split == "train" else list(range(100, 130))
        self.items = [(s, a) for s in sids for a in range(256)]
        self.root, self.camera, self.num_point = root, camera, num_point

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        sid, ann = self.items[i]
        d = np.load(os.path.join(self.root, "preprocessed", self.camera, f"scene_{sid:04d}_{ann:04d}.npz"))
        pts = d["cloud"]
        sel = np.random.choice(len(pts), self.num_point, replace=len(pts) < self.num_point)
        out = {"cloud": torch.from_numpy(pts[sel].astype(np.float32)),
               "scene": torch.tensor(sid), "ann": torch.tensor(ann)}
        if "objectness" in d:
            out["objectness"] = torch.from_numpy(d["objectness"][sel].astype(np.int64))
            out["score"] = torch.from_numpy(d["grasp_score"][sel].astype(np.float32))
            out["view_rot"] = torch.from_numpy(d["view_rot"][sel].astype(np.float32))
            out["depth"] = torch.from_numpy(d["grasp_depth"][sel].astype(np.float32))
            out["width"] = torch.from_numpy(d["grasp_width"][sel].astype(np.float32))
        return out


class Baseline(nn.Module):
    def __init__(self, c=256):
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv1d(3, 64, 1), nn.GroupNorm(8, 64), nn.ReLU(),
            nn.Conv1d(64, 128, 1), nn.GroupNorm(8, 128), nn.ReLU(),
            nn.Conv1d(128, c, 1), nn.GroupNorm(8, c), nn.ReLU())
        self.ctx = nn.Sequential(nn.Conv1d(2 * c, c, 1), nn.GroupNorm(8, c), nn.ReLU())
        self.objectness = nn.Conv1d(c, 2, 1)
        self.score = nn.Conv1d(c, 1, 1)
        self.rot = nn.Conv1d(c, 6, 1)
        self.depth_width = nn.Conv1d(c, 2, 1)

    def forward(self, cloud):
        f = self.backbone(cloud.transpose(1, 2))
        f = self.ctx(torch.cat([f, f.max(-1, keepdim=True)[0].expand_as(f)], 1))
        return {"objectness": self.objectness(f), "score": self.score(f).squeeze(1),
                "rot": self.rot(f).transpose(1, 2), "dw": self.depth_width(f).transpose(1, 2)}


def rot6d(r):
    x = F.normalize(r[..., :3], dim=-1)
    y = F.normalize(r[..., 3:] - (x * r[..., 3:]).sum(-1, keepdim=True) * x, dim=-1)
    return torch.stack([x, y, torch.cross(x, y, dim=-1)], -1)


def losses(out, b):
    l_obj = F.cross_entropy(out["objectness"], b["objectness"])
    m = (b["objectness"] > 0).float()
    n = m.sum().clamp(min=1)
    l_s = (F.smooth_l1_loss(out["score"], b["score"], reduction="none") * m).sum() / n
    R = rot6d(out["rot"]).flatten(-2)
    l_r = ((R - b["view_rot"]).abs().sum(-1) * m).sum() / n
    l_d = (F.smooth_l1_loss(out["dw"][..., 0], b["depth"], reduction="none") * m).sum() / n
    l_w = (F.smooth_l1_loss(out["dw"][..., 1], b["width"], reduction="none") * m).sum() / n
    return l_obj + 10 * l_s + l_r + l_d + 10 * l_w


@torch.no_grad()
def decode(out, cloud, topk):
    """Turn per-point predictions of one view into graspnetAPI rows (N, 17)."""
    obj = out["objectness"].argmax(0) > 0
    score = out["score"].clone()
    score[~obj] = -1
    k = min(topk, int(obj.sum().item()))
    idx = score.topk(k).indices if k > 0 else score.new_zeros(0, dtype=torch.long)
    R = rot6d(out["rot"][idx]).flatten(-2)
    dw = out["dw"][idx]
    rows = torch.cat([score[idx, None], dw[:, 1:2], torch.full_like(dw[:, :1], 0.02), dw[:, :1],
                      R, cloud[idx], torch.full_like(dw[:, :1], -1)], 1)
    return rows


def run_test(model, loader, device, world, rank, log_dir, camera, root, topk, epoch):
    model.eval()
    preds = []
    for b in loader:
        cloud = b["cloud"].to(device)
        out = model.module(cloud)
        for i in range(cloud.shape[0]):
            rows = decode({k: v[i] for k, v in out.items()}, cloud[i], topk)
            gg = GraspGroup(rows.cpu().numpy()).nms(0.03, 30.0 / 180 * np.pi)
            g = torch.from_numpy(gg.grasp_group_array).float().to(device)
            tag = torch.tensor([[float(b["scene"][i]), float(b["ann"][i])]], device=device).expand(len(g), 2)
            preds.append(torch.cat([g, tag], 1))
    local = torch.cat(preds, 0)
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    model.train()
    if rank != 0:
        return None
    allp = torch.cat(gathered, 0).cpu().numpy()
    dump = os.path.join(log_dir, f"dump_epoch{epoch:02d}")
    for sid in np.unique(allp[:, GRASP_DIM]).astype(int):
        for ann in np.unique(allp[allp[:, GRASP_DIM] == sid, GRASP_DIM + 1]).astype(int):
            m = (allp[:, GRASP_DIM] == sid) & (allp[:, GRASP_DIM + 1] == ann)
            d = os.path.join(dump, f"scene_{sid:04d}", camera)
            os.makedirs(d, exist_ok=True)
            GraspGroup(allp[m, :GRASP_DIM]).save_npy(os.path.join(d, f"{ann:04d}.npy"))
    ge = GraspNetEval(root=root, camera=camera, split="test_seen")
    res, ap = ge.eval_seen(dump, proc=16)
    return ap


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # the AP evaluation on rank 0 takes a while; keep the others waiting at the barrier
    dist.init_process_group("nccl", timeout=timedelta(hours=3))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(args.log_dir, exist_ok=True)

    train_set = GraspNetViews(args.dataset_root, args.camera, "train", args.num_point)
    test_set = GraspNetViews(args.dataset_root, args.camera, "test", args.num_point)
    test_set.items = test_set.items[rank::world]
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.num_workers,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, args.batch_size, shuffle=False, num_workers=args.num_workers)

    model = DDP(Baseline().to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate * world)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: 0.95 ** e)

    for epoch in range(args.max_epoch):
        sampler.set_epoch(epoch)
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for b in train_loader:
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            loss = losses(model(b["cloud"]), b)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} loss {(acc[0] / acc[1]).item():.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"epoch": epoch, "model_state_dict": model.module.state_dict(),
                        "optimizer_state_dict": optimizer.state_dict()},
                       os.path.join(args.log_dir, "checkpoint.tar"))

        if (epoch + 1) % args.eval_every == 0:
            ap = run_test(model, test_loader, device, world, rank, args.log_dir, args.camera,
                          args.dataset_root, args.topk, epoch)
            if rank == 0:
                print(f"epoch {epoch} test_seen AP {ap:.2f}", flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
