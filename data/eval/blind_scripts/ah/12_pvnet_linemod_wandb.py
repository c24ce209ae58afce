"""PVNet-style 6-DoF object pose (LINEMOD, single object): segmentation + per-pixel keypoint vectors,
keypoints by least-squares voting, pose by EPnP, evaluated with ADD(-S) 0.1d.

    torchrun --nproc_per_node=4 train_pvnet.py --cls cat --data data/linemod --epochs 240
"""
import argparse
import os
import pickle

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SYMMETRIC = {"eggbox", "glue"}
DIAMETERS = {"ape": 0.1021, "benchvise": 0.2475, "cam": 0.1725, "can": 0.2012, "cat": 0.1545, "driller": 0.2613,
             "duck": 0.1089, "eggbox": 0.1764, "glue": 0.1649, "holepuncher": 0.1482, "iron": 0.3036,
             "lamp": 0.2852, "phone": 0.2081}


class LinemodPVNet(Dataset):
    def __init__(self, root, cls, split, train):
        with open(os.path.join(root, cls, f"{split}_annos.pkl"), "rb") as f:
            self.annos = pickle.load(f)
        meta = np.load(os.path.join(root, cls, "meta.npz"))
        self.kpt_3d = meta["fps_8"].astype(np.float32)  # 8 FPS keypoints
        self.center_3d = meta["center"].astype(np.float32)
        self.K = meta["K"].astype(np.float32)
        self.root, self.cls, self.train = root, cls, train
        self.norm = torchvision.transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])

    def __len__(self):
        return len(self.annos)

    def __getitem__(self, i):
        a = self.annos[i]
        img = cv2.imread(os.path.join(self.root, a["rgb"]))[..., ::-1].astype(np.float32) / 255.0
        mask = (cv2.imread(os.path.join(self.root, a["mask"]), cv2.IMREAD_GRAYSCALE) > 0).astype(np.uint8)
        kpts = np.concatenate([self.kpt_3d, self.center_3d[None]])  # 9 x 3
        R, t = a["pose"][:, :3], a["pose"][:, 3]
        cam = (kpts @ R.T + t) @ self.K.T
        kpt_2d = cam[:, :2] / cam[:, 2:]
        if self.train:
            angle = np.random.uniform(-30, 30)
            M = cv2.getRotationMatrix2D((img.shape[1] / 2, img.shape[0] / 2), angle, 1.0)
            img = cv2.warpAffine(img, M, img.shape[1::-1], flags=cv2.INTER_LINEAR)
            mask = cv2.warpAffine(mask, M, mask.shape[::-1], flags=cv2.INTER_NEAREST)
            kpt_2d = np.concatenate([kpt_2d, np.ones((len(kpt_2d), 1))], 1) @ M.T
            img = np.clip(img * np.random.uniform(0.8, 1.2) + np.random.uniform(-0.1, 0.1), 0, 1)
        H, W = mask.shape
        ys, xs = np.mgrid[:H, :W].astype(np.float32)
        vec = kpt_2d[:, None, None, :] - np.stack([xs, ys], -1)[None]
        vec = vec / np.maximum(np.linalg.norm(vec, axis=-1, keepdims=True), 1e-6)
        vertex = vec.transpose(0, 3, 1, 2).reshape(-1, H, W) * mask[None]
        img_t = self.norm(torch.from_numpy(img.transpose(2, 0, 1).copy()))
        return {"img": img_t, "mask": torch.from_numpy(mask.astype(np.int64)),
                "vertex": torch.from_numpy(vertex.astype(np.float32)),
                "kpt_2d": torch.from_numpy(kpt_2d.astype(np.float32)),
                "pose": torch.from_numpy(a["pose"].astype(np.float32))}


class PVNetRes18(nn.Module):
    def __init__(self, num_kpt=9):
        super().__init__()
        r = torchvision.models.resnet18(weights="IMAGENET1K_V1")
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu)
        self.pool = r.maxpool
        self.l1, self.l2, self.l3 = r.layer1, r.layer2, r.layer3
        self.l4 = r.layer4
        self.conv8 = nn.Sequential(nn.Conv2d(512, 256, 3, 1, 1, bias=False), nn.BatchNorm2d(256), nn.LeakyReLU(0.1))

        def up(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.LeakyReLU(0.1))
        self.up8, self.up4, self.up2 = up(256 + 128, 128), up(128 + 64, 64), up(64 + 64, 32)
        self.head = nn.Conv2d(32 + 3, 2 + 2 * num_kpt, 1)

    def forward(self, x):
        x2 = self.stem(x)
        x4 = self.l1(self.pool(x2))
        x8 = self.l2(x4)
        f = self.conv8(self.l4(self.l3(x8)))
        f = self.up8(torch.cat([F.interpolate(f, size=x8.shape[-2:], mode="bilinear"), x8], 1))
        f = self.up4(torch.cat([F.interpolate(f, size=x4.shape[-2:], mode="bilinear"), x4], 1))
        f = self.up2(torch.cat([F.interpolate(f, size=x2.shape[-2:], mode="bilinear"), x2], 1))
        f = F.interpolate(f, size=x.shape[-2:], mode="bilinear")
        out = self.head(torch.cat([f, x], 1))
        return out[:, :2], out[:, 2:]


def vote_keypoints(seg, vertex):
    """Least-squares intersection of the predicted unit vectors inside the predicted mask."""
    B, K2, H, W = vertex.shape
    fg = seg.argmax(1) == 1
    ys, xs = torch.meshgrid(torch.arange(H, device=seg.device), torch.arange(W, device=seg.device), indexing="ij")
    pix = torch.stack([xs, ys], -1).float()
    out = torch.zeros(B, K2 // 2, 2, device=seg.device)
    for b in range(B):
        if fg[b].sum() < 10:
            continue
        p = pix[fg[b]]
        v = vertex[b].view(K2 // 2, 2, H, W).permute(0, 2, 3, 1)[:, fg[b]]
        v = F.normalize(v, dim=-1)
        n = torch.stack([-v[..., 1], v[..., 0]], -1)  # normals
        A = torch.einsum("kpi,kpj->kij", n, n)
        rhs = torch.einsum("kpi,kpj,pj->ki", n, n, p)
        out[b] = torch.linalg.solve(A + 1e-6 * torch.eye(2, device=seg.device), rhs)
    return out


def add_metric(pose_pred, pose_gt, model_pts, symmetric):
    pred = model_pts @ pose_pred[:, :3].T + pose_pred[:, 3]
    gt = model_pts @ pose_gt[:, :3].T + pose_gt[:, 3]
    if symmetric:
        d = np.linalg.norm(pred[:, None] - gt[None], axis=-1).min(1)
        return d.mean()
    return np.linalg.norm(pred - gt, axis=-1).mean()


@torch.no_grad()
def evaluate(model, loader, ds, model_pts, cls, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # correct poses, total, 2D proj err sum
    for batch in loader:
        seg, vertex = model(batch["img"].to(device))
        kpts = vote_keypoints(seg, vertex).cpu().numpy()
        for b in range(len(kpts)):
            ok, rvec, tvec = cv2.solvePnP(ds.kpt_3d, kpts[b, :8].astype(np.float64), ds.K.astype(np.float64),
                                          None, flags=cv2.SOLVEPNP_EPNP)
            pose = np.concatenate([cv2.Rodrigues(rvec)[0], tvec], 1) if ok else np.eye(3, 4)
            err = add_metric(pose, batch["pose"][b].numpy(), model_pts, cls in SYMMETRIC)
            stats[0] += float(err < 0.1 * DIAMETERS[cls])
            stats[1] += 1
            stats[2] += float(np.linalg.norm(kpts[b] - batch["kpt_2d"][b].numpy(), axis=-1).mean())
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1]).item(), (stats[2] / stats[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cls", default="cat")
    ap.add_argument("--data", default="data/linemod")
    ap.add_argument("--epochs", type=int, default=240)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval_every", type=int, default=10)
    ap.add_argument("--out", default="data/model/pvnet")
    ap.add_argument("--wandb_project", default="pvnet-linemod")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    wandb.init(project=args.wandb_project, name=f"pvnet_{args.cls}", config=vars(args))

    train_ds = LinemodPVNet(args.data, args.cls, "train", True)
    test_ds = LinemodPVNet(args.data, args.cls, "test", False)
    model_pts = np.load(os.path.join(args.data, args.cls, "model_points.npy")).astype(np.float32)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    test_dl = DataLoader(torch.utils.data.Subset(test_ds, range(rank, len(test_ds), world)), args.batch_size,
                         num_workers=4)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(PVNetRes18()).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[20, 40, 60, 80, 100, 120, 160, 180, 200, 220],
                                                 gamma=0.5)

    os.makedirs(os.path.join(args.out, args.cls), exist_ok=True)
    ckpt_path = os.path.join(args.out, args.cls, "latest.pth")
    start = 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["net"])
        opt.load_state_dict(ck["optim"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, batch in enumerate(train_dl):
            img = batch["img"].to(device, non_blocking=True)
            mask = batch["mask"].to(device, non_blocking=True)
            vertex = batch["vertex"].to(device, non_blocking=True)
            seg_pred, vertex_pred = model(img)
            seg_loss = F.cross_entropy(seg_pred, mask)
            w = mask[:, None].float()
            vote_loss = F.smooth_l1_loss(vertex_pred * w, vertex * w, reduction="sum")
            vote_loss = vote_loss / w.sum().clamp(min=1) / vertex.shape[1]
            loss = seg_loss + vote_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 40.0)
            opt.step()
            if it % 20 == 0:
                wandb.log({"train/loss": loss.item(), "train/seg": seg_loss.item(), "train/vote": vote_loss.item(),
                           "lr": opt.param_groups[0]["lr"], "epoch": epoch})
        sched.step()

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            add_acc, proj = evaluate(model.module, test_dl, test_ds, model_pts, args.cls, device)
            if rank == 0:
                print(f"epoch {epoch}: ADD(-S) {add_acc:.4f} kpt err {proj:.2f}px", flush=True)
                wandb.log({"val/add": add_acc, "val/kpt_px": proj, "epoch": epoch})
        if rank == 0:
            torch.save({"net": model.module.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, ckpt_path)
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
