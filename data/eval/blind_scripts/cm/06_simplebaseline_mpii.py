"""
SimpleBaseline (ResNet-101 + 3 deconvs) on MPII, PCKh@0.5.

Annotation files are the json versions from the HRNet repo
(data/mpii/annot/{train,valid}.json).

    torchrun --standalone --nproc_per_node=4 06_simplebaseline_mpii.py --root data/mpii --out output/mpii_res101
"""
import argparse
import json
import logging
import os
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

MPII_FLIP = [(0, 5), (1, 4), (2, 3), (10, 15), (11, 14), (12, 13)]
log = logging.getLogger(__name__)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="data/mpii")
    parser.add_argument("--out", default="output/mpii_res101")
    parser.add_argument("--epochs", type=int, default=140)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--sigma", type=float, default=2.0)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--print-freq", type=int, default=100)
    return parser.parse_args()


def crop_transform(center, scale, out_size, rot=0.0):
    s = scale * 200.0
    M = cv2.getRotationMatrix2D((float(center[0]), float(center[1])), rot, out_size / s)
    M[0, 2] += out_size / 2.0 - center[0]
    M[1, 2] += out_size / 2.0 - center[1]
    return M


class MPIIDataset(Dataset):
    def __init__(self, root, split, train, in_size=256, hm_size=64, sigma=2.0):
        with open(os.path.join(root, "annot", f"{split}.json")) as f:
            self.db = json.load(f)
        self.img_dir = os.path.join(root, "images")
        self.train, self.in_size, self.hm_size, self.sigma = train, in_size, hm_size, sigma

    def __len__(self):
        return len(self.db)

    def gaussian_targets(self, joints, vis):
        k = len(joints)
        target = np.zeros((k, self.hm_size, self.hm_size), np.float32)
        weight = vis.reshape(k, 1).astype(np.float32)
        grid = np.arange(self.hm_size, dtype=np.float32)
        stride = self.in_size / self.hm_size
        for j in range(k):
            if weight[j] == 0:
                continue
            mx, my = joints[j] / stride
            if mx < 0 or my < 0 or mx >= self.hm_size or my >= self.hm_size:
                weight[j] = 0
                continue
            target[j] = np.exp(-((grid[None] - mx) ** 2 + (grid[:, None] - my) ** 2) / (2 * self.sigma ** 2))
        return target, weight

    def __getitem__(self, idx):
        rec = self.db[idx]
        img = cv2.imread(os.path.join(self.img_dir, rec["image"]), cv2.IMREAD_COLOR)[:, :, ::-1]
        joints = np.array(rec["joints"], np.float32)
        vis = np.array(rec["joints_vis"], np.float32)
        c = np.array(rec["center"], np.float32)
        c[1] += 15 * rec["scale"]
        s = rec["scale"] * 1.25
        r = 0.0
        if self.train:
            s *= np.clip(np.random.randn() * 0.25 + 1, 0.75, 1.25)
            if np.random.rand() < 0.6:
                r = float(np.clip(np.random.randn() * 30, -60, 60))
            if np.random.rand() < 0.5:
                img = img[:, ::-1]
                w = img.shape[1]
                joints[:, 0] = w - 1 - joints[:, 0]
                c[0] = w - 1 - c[0]
                for a, b in MPII_FLIP:
                    joints[[a, b]] = joints[[b, a]]
                    vis[[a, b]] = vis[[b, a]]
        M = crop_transform(c, s, self.in_size, r)
        crop = cv2.warpAffine(np.ascontiguousarray(img), M, (self.in_size, self.in_size), flags=cv2.INTER_LINEAR)
        joints_t = np.hstack([joints, np.ones((len(joints), 1), np.float32)]) @ M.T
        target, weight = self.gaussian_targets(joints_t, vis)
        x = torch.from_numpy(crop.copy()).permute(2, 0, 1).float() / 255.0
        x = torchvision.transforms.functional.normalize(x, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        head_size = np.linalg.norm(joints_t[9] - joints_t[8]) if vis[8] > 0 and vis[9] > 0 else 0.0
        return x, torch.from_numpy(target), torch.from_numpy(weight), torch.from_numpy(joints_t), \
            torch.tensor(head_size, dtype=torch.float32), idx


class PoseNet(nn.Module):
    def __init__(self, num_joints=16):
        super().__init__()
        backbone = torchvision.models.resnet101(weights="IMAGENET1K_V2")
        self.backbone = nn.Sequential(*list(backbone.children())[:-2])
        deconv, ch = [], 2048
        for _ in range(3):
            deconv += [nn.ConvTranspose2d(ch, 256, 4, stride=2, padding=1, output_padding=0, bias=False),
                       nn.BatchNorm2d(256), nn.ReLU(inplace=True)]
            ch = 256
        self.deconv = nn.Sequential(*deconv)
        self.head = nn.Conv2d(256, num_joints, 1)
        nn.init.normal_(self.head.weight, std=0.001)
        nn.init.zeros_(self.head.bias)

    def forward(self, x):
        return self.head(self.deconv(self.backbone(x)))


class JointsMSELoss(nn.Module):
    def forward(self, pred, target, weight):
        return 0.5 * (((pred - target) ** 2).mean(dim=(2, 3)) * weight.squeeze(-1) ** 2).mean()


@torch.no_grad()
def evaluate_pckh(model, loader, world_size, thr=0.5):
    model.eval()
    hits_all, vis_all, idx_all = [], [], []
    for x, _, weight, joints, head, idx in loader:
        hm = model(x.cuda(non_blocking=True))
        n, k, h, w = hm.shape
        flat = hm.view(n, k, -1).argmax(-1)
        pred = torch.stack([flat % w, flat // w], -1).float() * (256 / w)
        dist_px = torch.linalg.norm(pred - joints.cuda()[..., :2], dim=-1)
        head = head.cuda()[:, None]
        valid = (weight.cuda().squeeze(-1) > 0) & (head > 0)
        hits_all.append((dist_px <= thr * head) & valid)
        vis_all.append(valid)
        idx_all.append(idx.cuda())
    hits, vis, idx = torch.cat(hits_all).float(), torch.cat(vis_all).float(), torch.cat(idx_all)
    g_hits = [torch.empty_like(hits) for _ in range(world_size)]
    g_vis = [torch.empty_like(vis) for _ in range(world_size)]
    g_idx = [torch.empty_like(idx) for _ in range(world_size)]
    dist.all_gather(g_hits, hits)
    dist.all_gather(g_vis, vis)
    dist.all_gather(g_idx, idx)
    idx = torch.cat(g_idx)
    _, first = np.unique(idx.cpu().numpy(), return_index=True)  # padded duplicates counted once
    first = torch.from_numpy(first).cuda()
    hits, vis = torch.cat(g_hits)[first], torch.cat(g_vis)[first]
    per_joint = hits.sum(0) / vis.sum(0).clamp(min=1)
    return per_joint.mean().item(), per_joint.cpu().numpy()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="[%(asctime)s] %(message)s")

    train_ds = MPIIDataset(args.root, "train", train=True, sigma=args.sigma)
    val_ds = MPIIDataset(args.root, "valid", train=False, sigma=args.sigma)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=64, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=args.workers, pin_memory=True)

    model = DDP(PoseNet().cuda(), device_ids=[local_rank])
    criterion = JointsMSELoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[90, 120], gamma=0.1)
    os.makedirs(args.out, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        end = time.time()
        for i, (x, target, weight, *_rest) in enumerate(train_loader):
            x = x.cuda(non_blocking=True)
            target = target.cuda(non_blocking=True)
            weight = weight.cuda(non_blocking=True)
            loss = criterion(model(x), target, weight)
            if not torch.isfinite(loss):
                log.warning("non-finite loss at epoch %d iter %d, skipping batch", epoch, i)
                optimizer.zero_grad(set_to_none=True)
                continue
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if i % args.print_freq == 0:
                log.info("Epoch[%d][%d/%d] loss %.7f  %.3fs/it", epoch, i, len(train_loader), loss.item(),
                         (time.time() - end) / (i + 1))
        scheduler.step()

        pckh, per_joint = evaluate_pckh(model, val_loader, world_size)
        log.info("Epoch %d PCKh@0.5 = %.2f", epoch, pckh * 100)
        if rank == 0:
            torch.save({"epoch": epoch + 1, "state_dict": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "perf": pckh},
                       os.path.join(args.out, "checkpoint.pth"))
            if pckh > best:
                best = pckh
                torch.save(model.module.state_dict(), os.path.join(args.out, "model_best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
