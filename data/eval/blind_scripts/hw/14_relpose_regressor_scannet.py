"""Relative camera pose regression (map-free relocalisation baseline) on ScanNet pairs.

Siamese ResNet-34 (frozen BN) -> 4D correlation at 1/16 -> pose head (6D rotation + metric translation).
Validation reports pose AUC@5/10/20 deg from an error histogram that is summed over ranks.

    torchrun --nproc_per_node=8 14_relpose_regressor_scannet.py --data /data/scannet_pairs --out runs/relpose_r34
"""
import argparse
import json
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

BINS = np.linspace(0.0, 180.0, 3601)  # 0.05 deg resolution for the AUC integral


class PairList(Dataset):
    """pairs.jsonl: {"im0": ..., "im1": ..., "K0": 3x3, "K1": 3x3, "T_0to1": 4x4}"""

    def __init__(self, root, split, size=(384, 512)):
        with open(os.path.join(root, f"{split}_pairs.jsonl")) as f:
            self.items = [json.loads(l) for l in f]
        self.root, self.size = root, size
        self.tf = torchvision.transforms.Compose([
            torchvision.transforms.Resize(size),
            torchvision.transforms.ToTensor(),
            torchvision.transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        im0 = self.tf(Image.open(os.path.join(self.root, it["im0"])).convert("RGB"))
        im1 = self.tf(Image.open(os.path.join(self.root, it["im1"])).convert("RGB"))
        T = torch.tensor(it["T_0to1"], dtype=torch.float32)
        return im0, im1, T[:3, :3], T[:3, 3]


def rot6d_to_matrix(x):
    a1, a2 = x[..., :3], x[..., 3:]
    b1 = F.normalize(a1, dim=-1)
    b2 = F.normalize(a2 - (b1 * a2).sum(-1, keepdim=True) * b1, dim=-1)
    return torch.stack([b1, b2, torch.cross(b1, b2, dim=-1)], -2)


class RelPoseNet(nn.Module):
    def __init__(self):
        super().__init__()
        r = torchvision.models.resnet34(norm_layer=torchvision.ops.FrozenBatchNorm2d)
        self.backbone = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2, r.layer3)
        self.reduce = nn.Conv2d(256, 128, 1)
        self.corr_enc = nn.Sequential(
            nn.Conv2d(24 * 32 + 128, 512, 3, padding=1), nn.GroupNorm(32, 512), nn.ReLU(True),
            nn.Conv2d(512, 256, 3, stride=2, padding=1), nn.GroupNorm(32, 256), nn.ReLU(True),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Sequential(nn.Linear(256, 256), nn.ReLU(True), nn.Linear(256, 9))

    def forward(self, im0, im1):
        b = im0.size(0)
        f = F.normalize(self.reduce(self.backbone(torch.cat([im0, im1]))), dim=1)
        f0, f1 = f[:b], f[b:]
        h, w = f0.shape[-2:]
        corr = torch.einsum("bchw,bcxy->bxyhw", f0, f1).reshape(b, -1, h, w)  # image-1 cells as channels
        out = self.head(self.corr_enc(torch.cat([corr, f0], 1)))
        return rot6d_to_matrix(out[:, :6]), out[:, 6:]


def pose_loss(R, t, R_gt, t_gt):
    cos = ((R.transpose(1, 2) @ R_gt).diagonal(dim1=1, dim2=2).sum(-1) - 1) / 2
    l_rot = torch.acos(cos.clamp(-1 + 1e-6, 1 - 1e-6)).mean()
    l_t = (t - t_gt).norm(dim=-1).mean()
    return l_rot + l_t, l_rot, l_t


def angular_errors(R, t, R_gt, t_gt):
    cos = ((R.transpose(1, 2) @ R_gt).diagonal(dim1=1, dim2=2).sum(-1) - 1) / 2
    e_R = torch.rad2deg(torch.acos(cos.clamp(-1, 1)))
    cos_t = F.cosine_similarity(t, t_gt, dim=-1)
    e_t = torch.rad2deg(torch.acos(cos_t.clamp(-1, 1)))
    return torch.maximum(e_R, e_t), (t - t_gt).norm(dim=-1)


def auc_from_hist(hist, thresholds=(5, 10, 20)):
    hist = hist.astype(np.float64)
    total = hist.sum()
    centers = BINS[1:]
    recall = np.cumsum(hist) / max(total, 1)
    out = []
    for th in thresholds:
        m = centers <= th
        e = np.r_[0.0, centers[m]]
        r = np.r_[0.0, recall[m]]
        out.append(np.trapz(r, e) / th)
    return out


@torch.no_grad()
def validate(net, loader, device):
    net.eval()
    errs, trans = [], []
    for im0, im1, R_gt, t_gt in loader:
        R, t = net(im0.to(device), im1.to(device))
        e, et = angular_errors(R, t, R_gt.to(device), t_gt.to(device))
        errs.append(e.cpu().numpy())
        trans.append(et.cpu().numpy())
    net.train()
    errs, trans = np.concatenate(errs), np.concatenate(trans)
    hist = torch.from_numpy(np.histogram(errs, bins=BINS)[0])
    extra = torch.tensor([float((trans < 0.25).sum()), float(len(trans))], dtype=torch.float64)
    dist.all_reduce(hist)
    dist.all_reduce(extra)
    return hist.numpy(), extra.numpy()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/relpose")
    ap.add_argument("--backbone_ckpt", default="weights/resnet34-b627a593.pth")
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds, val_ds = PairList(args.data, "train"), PairList(args.data, "val")
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, 32, sampler=val_sampler, num_workers=4)

    net = RelPoseNet()
    if args.backbone_ckpt:
        sd = torch.load(args.backbone_ckpt, map_location="cpu")
        names = ["conv1", "bn1", None, None, "layer1", "layer2", "layer3"]
        for i, n in enumerate(names):
            if n is not None:
                net.backbone[i].load_state_dict({k[len(n) + 1:]: v for k, v in sd.items() if k.startswith(n + ".")},
                                                strict=False)
    model = DDP(net.to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.3)

    best = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        agg = torch.zeros(4, device=device)
        for im0, im1, R_gt, t_gt in train_dl:
            im0, im1 = im0.to(device, non_blocking=True), im1.to(device, non_blocking=True)
            R_gt, t_gt = R_gt.to(device), t_gt.to(device)
            R, t = model(im0, im1)
            loss, lr_, lt_ = pose_loss(R, t, R_gt, t_gt)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            agg += torch.stack([loss.detach(), lr_.detach(), lt_.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(agg)

        hist, extra = validate(model.module, val_dl, device)
        a5, a10, a20 = auc_from_hist(hist)
        if rank == 0:
            print(f"epoch {epoch}: loss {agg[0] / agg[3]:.4f} (rot {agg[1] / agg[3]:.4f} t {agg[2] / agg[3]:.4f}) "
                  f"| AUC@5/10/20 {a5:.3f}/{a10:.3f}/{a20:.3f} | t<25cm {extra[0] / extra[1]:.3f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            state = {"model": model.module.state_dict(), "epoch": epoch, "auc": (a5, a10, a20)}
            torch.save(state, os.path.join(args.out, "last.pth"))
            if a10 > best:
                best = a10
                torch.save(state, os.path.join(args.out, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
