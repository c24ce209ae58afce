"""
Single-person pose on MPII: ResNet-50 SimpleBaseline head, 256x256 input,
64x64 Gaussian heatmaps.  After training, the best checkpoint is re-loaded and
evaluated once more with flip test (PCKh@0.5 and PCKh@0.1).

    torchrun --nproc_per_node=4 19_mpii_r50.py --data data/mpii --work-dir work/mpii_r50
"""
import argparse
import json
import os
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

FLIP = [5, 4, 3, 2, 1, 0, 6, 7, 8, 9, 15, 14, 13, 12, 11, 10]
JOINT_NAMES = ["r_ankle", "r_knee", "r_hip", "l_hip", "l_knee", "l_ankle", "pelvis", "thorax",
               "upper_neck", "head_top", "r_wrist", "r_elbow", "r_shoulder", "l_shoulder", "l_elbow", "l_wrist"]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/mpii")
    ap.add_argument("--work-dir", default="work/mpii_r50")
    ap.add_argument("--epochs", type=int, default=140)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-interval", type=int, default=10)
    return ap.parse_args()


class MPII(Dataset):
    def __init__(self, root, split, train):
        with open(os.path.join(root, "annot", f"{split}.json")) as f:
            self.db = json.load(f)   # image, center, scale, joints, joints_vis, headbox
        self.root, self.train = root, train

    def __len__(self):
        return len(self.db)

    def __getitem__(self, i):
        a = self.db[i]
        img = cv2.imread(os.path.join(self.root, "images", a["image"]))[:, :, ::-1]
        joints = np.array(a["joints"], np.float32)
        vis = np.array(a["joints_vis"], np.float32)
        c = np.array(a["center"], np.float32)
        s = a["scale"] * 200 * 1.25
        rot = 0.0
        if self.train:
            s *= np.random.uniform(0.75, 1.25)
            rot = np.random.uniform(-30, 30) if np.random.rand() < 0.6 else 0.0
            if np.random.rand() < 0.5:
                img = img[:, ::-1]
                joints[:, 0] = img.shape[1] - 1 - joints[:, 0]
                c[0] = img.shape[1] - 1 - c[0]
                joints, vis = joints[FLIP], vis[FLIP]
        M = cv2.getRotationMatrix2D((float(c[0]), float(c[1])), rot, 256 / s)
        M[:, 2] += 128 - c
        crop = cv2.warpAffine(np.ascontiguousarray(img), M, (256, 256))
        jt = (np.c_[joints, np.ones(16)] @ M.T).astype(np.float32)
        hm = np.zeros((16, 64, 64), np.float32)
        g = np.arange(64, dtype=np.float32)
        for j in range(16):
            x, y = jt[j] / 4
            if vis[j] > 0 and 0 <= x < 64 and 0 <= y < 64:
                hm[j] = np.exp(-((g[None] - x) ** 2 + (g[:, None] - y) ** 2) / 8.0)
            else:
                vis[j] = 0
        hb = np.array(a["headbox"], np.float32).reshape(2, 2)
        head_size = 0.6 * np.linalg.norm(hb[1] - hb[0]) * 256 / s
        x = torch.from_numpy(crop.transpose(2, 0, 1).copy()).float() / 255
        x = torchvision.transforms.functional.normalize(x, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        return x, torch.from_numpy(hm), torch.from_numpy(vis), torch.from_numpy(jt), \
            torch.tensor(head_size, dtype=torch.float32), i


class PoseResNet50(nn.Module):
    def __init__(self):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        self.backbone = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2, r.layer3, r.layer4)
        layers, ch = [], 2048
        for _ in range(3):
            layers += [nn.ConvTranspose2d(ch, 256, 4, 2, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(inplace=True)]
            ch = 256
        self.deconv = nn.Sequential(*layers)
        self.final = nn.Conv2d(256, 16, 1)

    def forward(self, x):
        return self.final(self.deconv(self.backbone(x)))


@torch.no_grad()
def pckh(net, loader, world_size, n_total, flip=False):
    net.eval()
    rows = []
    for x, _, vis, jt, head, idx in loader:
        x = x.cuda(non_blocking=True)
        hm = net(x)
        if flip:
            hf = net(x.flip(3)).flip(3)[:, FLIP]
            hf[..., 1:] = hf[..., :-1].clone()
            hm = (hm + hf) / 2
        am = hm.flatten(2).argmax(-1)
        pred = torch.stack([am % 64, am // 64], -1).float() * 4
        d = torch.linalg.norm(pred - jt.cuda(), dim=-1) / head.cuda()[:, None]
        rows.append(torch.cat([idx.cuda()[:, None].float(), d, vis.cuda()], 1))
    rows = torch.cat(rows)
    out = [torch.empty_like(rows) for _ in range(world_size)]
    dist.all_gather(out, rows)
    rows = torch.cat(out)
    _, keep = np.unique(rows[:, 0].cpu().numpy(), return_index=True)
    rows = rows[torch.from_numpy(keep).cuda()]
    assert rows.shape[0] == n_total
    d, v = rows[:, 1:17], rows[:, 17:]
    res = {}
    for thr in (0.5, 0.1):
        per_joint = ((d <= thr) & (v > 0)).sum(0).float() / v.sum(0).clamp(min=1)
        res[thr] = (per_joint.mean().item(), per_joint.cpu().numpy())
    return res


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    train_set, val_set = MPII(args.data, "train", True), MPII(args.data, "valid", False)
    train_sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, 64, sampler=DistributedSampler(val_set, shuffle=False), num_workers=8)

    model = DDP(PoseResNet50().cuda(), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [90, 120], 0.1)
    best_path = os.path.join(args.work_dir, "best.pth")
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, hm, vis, *_) in enumerate(train_loader):
            x, hm, vis = x.cuda(non_blocking=True), hm.cuda(non_blocking=True), vis.cuda(non_blocking=True)
            loss = (F.mse_loss(model(x), hm, reduction="none").mean((2, 3)) * vis).mean() * 0.5
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and it % 100 == 0:
                print(f"[{epoch}][{it}/{len(train_loader)}] loss {loss.item():.6f}", flush=True)
        sched.step()

        if (epoch + 1) % args.eval_interval == 0:
            res = pckh(model, val_loader, world, len(val_set))
            if rank == 0:
                print(f"epoch {epoch + 1}: PCKh@0.5 {res[0.5][0] * 100:.2f} PCKh@0.1 {res[0.1][0] * 100:.2f} "
                      f"({time.time() - t0:.0f}s)", flush=True)
                torch.save({"state_dict": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch + 1},
                           os.path.join(args.work_dir, "latest.pth"))
                if res[0.5][0] > best:
                    best = res[0.5][0]
                    torch.save(model.state_dict(), best_path)
            dist.barrier()

    # final evaluation of the best weights with flip test, on all ranks
    final_net = PoseResNet50().cuda()
    final_net.load_state_dict(torch.load(best_path, map_location="cpu"))
    res = pckh(final_net, val_loader, world, len(val_set), flip=True)
    if rank == 0:
        print("Final (flip test):")
        for name, v in zip(JOINT_NAMES, res[0.5][1]):
            print(f"  {name:>12s}: {v * 100:.2f}")
        print(f"  PCKh@0.5 mean {res[0.5][0] * 100:.2f}   PCKh@0.1 mean {res[0.1][0] * 100:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
