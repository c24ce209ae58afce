"""DSAC*-style scene coordinate regression for visual localization (7-Scenes / Cambridge), RGB-only
reprojection training, PnP-RANSAC evaluation.

    torchrun --nproc_per_node=4 17_scene_coord_regression_7scenes.py --scene /data/7scenes/chess --focal 525 \
        --run chess_rgb
"""
import argparse
import glob
import os

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

OUT_STRIDE = 8


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scene", required=True, help="folder with train/ and test/ (rgb/*.png, poses/*.txt)")
    ap.add_argument("--focal", type=float, required=True)
    ap.add_argument("--run", default="scr")
    ap.add_argument("--out", default="checkpoints")
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--iterations", type=int, default=100000)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--soft_clamp", type=float, default=100.0)
    ap.add_argument("--eval_every", type=int, default=10000)
    ap.add_argument("--workers", type=int, default=6)
    return ap.parse_args()


class Frames(Dataset):
    def __init__(self, folder, height, augment):
        self.rgb = sorted(glob.glob(os.path.join(folder, "rgb", "*.png")))
        self.poses = sorted(glob.glob(os.path.join(folder, "poses", "*.txt")))
        assert len(self.rgb) == len(self.poses), folder
        self.height, self.augment = height, augment

    def __len__(self):
        return len(self.rgb)

    def __getitem__(self, i):
        img = cv2.cvtColor(cv2.imread(self.rgb[i]), cv2.COLOR_BGR2GRAY)
        s = self.height / img.shape[0]
        if self.augment:
            s *= np.random.uniform(2 / 3, 3 / 2)
            img = np.clip(img * np.random.uniform(0.9, 1.1) + np.random.uniform(-25, 25), 0, 255)
        img = cv2.resize(img.astype(np.uint8), None, fx=s, fy=s, interpolation=cv2.INTER_LINEAR)
        h, w = img.shape
        h, w = h // OUT_STRIDE * OUT_STRIDE, w // OUT_STRIDE * OUT_STRIDE
        img = img[:h, :w]
        pose = np.loadtxt(self.poses[i]).astype(np.float32)  # camera-to-world
        t = torch.from_numpy((img.astype(np.float32) / 255.0 - 0.4) / 0.25)[None]
        return t, torch.from_numpy(pose), torch.tensor(s, dtype=torch.float32)


def collate_same_size(batch):
    h = min(b[0].shape[1] for b in batch)
    w = min(b[0].shape[2] for b in batch)
    crops = []
    for b in batch:  # centre crop keeps the principal point in the middle
        y0 = (b[0].shape[1] - h) // 2 // OUT_STRIDE * OUT_STRIDE
        x0 = (b[0].shape[2] - w) // 2 // OUT_STRIDE * OUT_STRIDE
        crops.append(b[0][:, y0:y0 + h, x0:x0 + w])
    imgs = torch.stack(crops)
    return imgs, torch.stack([b[1] for b in batch]), torch.stack([b[2] for b in batch])


class SCRNet(nn.Module):
    def __init__(self, mean):
        super().__init__()
        def c(i, o, s=1):
            return nn.Sequential(nn.Conv2d(i, o, 3, s, 1), nn.ReLU(inplace=True))
        self.enc = nn.Sequential(c(1, 32), c(32, 64, 2), c(64, 128, 2), c(128, 256, 2), c(256, 256), c(256, 512),
                                 c(512, 512))
        self.res = nn.Sequential(nn.Conv2d(512, 512, 1), nn.ReLU(True), nn.Conv2d(512, 512, 1), nn.ReLU(True),
                                 nn.Conv2d(512, 512, 1))
        self.out = nn.Sequential(nn.ReLU(True), nn.Conv2d(512, 512, 1), nn.ReLU(True), nn.Conv2d(512, 3, 1))
        self.register_buffer("mean", torch.as_tensor(mean, dtype=torch.float32).view(1, 3, 1, 1))

    def forward(self, x):
        f = self.enc(x)
        return self.out(f + self.res(f)) + self.mean


def pixel_grid(h, w, device):
    ys, xs = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    return torch.stack([xs, ys], 0).float() * OUT_STRIDE + OUT_STRIDE / 2


def reprojection_loss(sc, pose_c2w, focal, scale, img_hw, soft_clamp):
    b, _, h, w = sc.shape
    w2c = torch.linalg.inv(pose_c2w)
    pts = sc.flatten(2)
    cam = w2c[:, :3, :3] @ pts + w2c[:, :3, 3:]
    f = (focal * scale)[:, None]
    cx, cy = img_hw[1] / 2, img_hw[0] / 2
    z = cam[:, 2]
    u = f * cam[:, 0] / z.clamp(min=0.1) + cx
    v = f * cam[:, 1] / z.clamp(min=0.1) + cy
    px = pixel_grid(h, w, sc.device).flatten(1)
    err = torch.sqrt((u - px[0]) ** 2 + (v - px[1]) ** 2 + 1e-8)
    valid = (z > 0.1) & (z < 1000) & (err < 1000)
    robust = torch.where(err < soft_clamp, err, torch.sqrt(soft_clamp * err))
    # invalid predictions are pushed towards a point 10 m in front of the camera
    target = torch.stack([px[0] - cx, px[1] - cy, f.expand(-1, h * w)], 1) / f[:, :, None] * 10.0
    target_w = pose_c2w[:, :3, :3] @ target + pose_c2w[:, :3, 3:]
    l_inv = (pts - target_w).norm(dim=1)
    loss = torch.where(valid, robust, l_inv).mean()
    return loss, (valid & (err < 10)).float().mean()


@torch.no_grad()
def localize(net, loader, focal, device):
    net.eval()
    r_err, t_err = [], []
    for img, pose, s in loader:
        sc = net(img.to(device))[0].cpu().numpy()
        h, w = sc.shape[1:]
        px = pixel_grid(h, w, "cpu").numpy().reshape(2, -1).T
        K = np.array([[focal * s.item(), 0, img.shape[3] / 2], [0, focal * s.item(), img.shape[2] / 2], [0, 0, 1]])
        ok, rvec, tvec, inl = cv2.solvePnPRansac(sc.reshape(3, -1).T.astype(np.float64), px.astype(np.float64), K,
                                                 None, iterationsCount=256, reprojectionError=10,
                                                 flags=cv2.SOLVEPNP_P3P)
        if not ok:
            r_err.append(180.0)
            t_err.append(1e3)
            continue
        R, _ = cv2.Rodrigues(rvec)
        c2w = np.eye(4)
        c2w[:3, :3], c2w[:3, 3] = R.T, (-R.T @ tvec).ravel()
        gt = pose[0].numpy().astype(np.float64)
        dR = c2w[:3, :3].T @ gt[:3, :3]
        r_err.append(float(np.degrees(np.arccos(np.clip((np.trace(dR) - 1) / 2, -1, 1)))))
        t_err.append(float(np.linalg.norm(c2w[:3, 3] - gt[:3, 3])))
    net.train()
    return r_err, t_err


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    wandb.init(project="scene-coord-regression", name=args.run, config=vars(args))

    train_set = Frames(os.path.join(args.scene, "train"), args.height, augment=True)
    test_set = Frames(os.path.join(args.scene, "test"), args.height, augment=False)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers,
                          collate_fn=collate_same_size, pin_memory=True, drop_last=True)
    test_ids = list(range(rank, len(test_set), world))
    test_dl = DataLoader(torch.utils.data.Subset(test_set, test_ids), batch_size=1, num_workers=2)

    # scene centre from the training camera positions (same on every rank: read from disk, not sampled)
    centre = np.mean([np.loadtxt(p)[:3, 3] for p in train_set.poses], axis=0)
    model = DDP(SCRNet(centre).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50000, gamma=0.5)

    it, epoch = 0, 0
    while it < args.iterations:
        sampler.set_epoch(epoch)
        for img, pose, s in train_dl:
            img, pose, s = img.to(device, non_blocking=True), pose.to(device), s.to(device)
            sc = model(img)
            loss, valid = reprojection_loss(sc, pose, args.focal, s, img.shape[-2:], args.soft_clamp)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            it += 1
            if it % 100 == 0:
                m = torch.stack([loss.detach(), valid.detach()])
                dist.all_reduce(m, op=dist.ReduceOp.AVG)
                wandb.log({"train/loss": m[0].item(), "train/valid_ratio": m[1].item(), "lr": sched.get_last_lr()[0]},
                          step=it)
            if it % args.eval_every == 0 or it == args.iterations:
                r, t = localize(model.module, test_dl, args.focal, device)
                parts = [None] * world
                dist.all_gather_object(parts, (r, t))
                r = np.concatenate([p[0] for p in parts])
                t = np.concatenate([p[1] for p in parts])
                acc = float(np.mean((r < 5) & (t < 0.05)))
                wandb.log({"test/median_rot_deg": float(np.median(r)), "test/median_trans_cm": 100 * float(np.median(t)),
                           "test/acc_5cm5deg": acc}, step=it)
                if rank == 0:
                    os.makedirs(args.out, exist_ok=True)
                    torch.save({"model": model.module.state_dict(), "iteration": it, "centre": centre},
                               os.path.join(args.out, f"{args.run}.pt"))
                dist.barrier()
            if it >= args.iterations:
                break
        epoch += 1

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
