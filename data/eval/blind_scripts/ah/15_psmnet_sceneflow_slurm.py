"""PSMNet (basic 3D-CNN variant) on SceneFlow FlyingThings3D, multi-node.

Cluster launch (scripts/psmnet_sceneflow.sbatch):
    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=4
    #SBATCH --gpus-per-node=4
    #SBATCH --cpus-per-task=10
    export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)
    export MASTER_PORT=29400
    srun python train_psmnet.py --datapath /lustre/datasets/sceneflow --savemodel /lustre/ckpt/psmnet
"""
import argparse
import os
import re
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def read_pfm(path):
    with open(path, "rb") as f:
        header = f.readline().rstrip()
        color = header == b"PF"
        w, h = map(int, re.findall(rb"\d+", f.readline()))
        scale = float(f.readline().rstrip())
        endian = "<" if scale < 0 else ">"
        data = np.fromfile(f, endian + "f").reshape(h, w, 3 if color else 1)
    return np.flipud(data)[..., 0].copy()


def list_things(root, split):
    left, right, disp = [], [], []
    base = os.path.join(root, "frames_finalpass", split)
    for sub in sorted(os.listdir(base)):
        for seq in sorted(os.listdir(os.path.join(base, sub))):
            d = os.path.join(base, sub, seq, "left")
            for fn in sorted(os.listdir(d)):
                left.append(os.path.join(d, fn))
                right.append(os.path.join(base, sub, seq, "right", fn))
                disp.append(os.path.join(root, "disparity", split, sub, seq, "left", fn.replace(".png", ".pfm")))
    return left, right, disp


class SceneFlow(Dataset):
    MEAN = np.array([0.485, 0.456, 0.406], np.float32)
    STD = np.array([0.229, 0.224, 0.225], np.float32)

    def __init__(self, root, split, training, crop=(256, 512)):
        self.left, self.right, self.disp = list_things(root, split)
        self.training, self.crop = training, crop

    def __len__(self):
        return len(self.left)

    def _load(self, p):
        return (np.asarray(Image.open(p).convert("RGB"), np.float32) / 255.0 - self.MEAN) / self.STD

    def __getitem__(self, i):
        L, R, D = self._load(self.left[i]), self._load(self.right[i]), read_pfm(self.disp[i])
        if self.training:
            th, tw = self.crop
            h, w = L.shape[:2]
            y, x = np.random.randint(0, h - th + 1), np.random.randint(0, w - tw + 1)
            L, R, D = L[y:y + th, x:x + tw], R[y:y + th, x:x + tw], D[y:y + th, x:x + tw]
        else:
            # pad to a multiple of 16 on top / right, as in the original evaluation
            h, w = L.shape[:2]
            ph, pw = (16 - h % 16) % 16, (16 - w % 16) % 16
            L = np.pad(L, ((ph, 0), (0, pw), (0, 0)))
            R = np.pad(R, ((ph, 0), (0, pw), (0, 0)))
            D = np.pad(D, ((ph, 0), (0, pw)))
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))
        return t(L), t(R), torch.from_numpy(np.ascontiguousarray(D))


def convbn(cin, cout, k, s, p, d=1):
    return nn.Sequential(nn.Conv2d(cin, cout, k, s, p if d == 1 else d, d, bias=False), nn.BatchNorm2d(cout))


def convbn3d(cin, cout, k, s, p):
    return nn.Sequential(nn.Conv3d(cin, cout, k, s, p, bias=False), nn.BatchNorm3d(cout))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride, down, pad, dil):
        super().__init__()
        self.c1 = nn.Sequential(convbn(cin, cout, 3, stride, pad, dil), nn.ReLU(True))
        self.c2 = convbn(cout, cout, 3, 1, pad, dil)
        self.down = down

    def forward(self, x):
        out = self.c2(self.c1(x))
        return out + (self.down(x) if self.down is not None else x)


class FeatureExtraction(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Sequential(convbn(3, 32, 3, 2, 1), nn.ReLU(True), convbn(32, 32, 3, 1, 1), nn.ReLU(True),
                                   convbn(32, 32, 3, 1, 1), nn.ReLU(True))
        self.l1 = self._make(32, 32, 3, 1, 1, 1)
        self.l2 = self._make(32, 64, 16, 2, 1, 1)
        self.l3 = self._make(64, 128, 3, 1, 1, 1)
        self.l4 = self._make(128, 128, 3, 1, 1, 2)
        self.branches = nn.ModuleList([nn.Sequential(nn.AvgPool2d(s, s), convbn(128, 32, 1, 1, 0), nn.ReLU(True))
                                       for s in (64, 32, 16, 8)])
        self.last = nn.Sequential(convbn(320, 128, 3, 1, 1), nn.ReLU(True), nn.Conv2d(128, 32, 1, bias=False))

    @staticmethod
    def _make(cin, cout, n, stride, pad, dil):
        down = convbn(cin, cout, 1, stride, 0) if stride != 1 or cin != cout else None
        layers = [BasicBlock(cin, cout, stride, down, pad, dil)]
        layers += [BasicBlock(cout, cout, 1, None, pad, dil) for _ in range(n - 1)]
        return nn.Sequential(*layers)

    def forward(self, x):
        raw = self.l2(self.l1(self.first(x)))
        out = self.l4(self.l3(raw))
        br = [F.interpolate(b(out), size=out.shape[-2:], mode="bilinear", align_corners=False) for b in self.branches]
        return self.last(torch.cat([raw, out] + br[::-1], 1))


class PSMNetBasic(nn.Module):
    def __init__(self, maxdisp=192):
        super().__init__()
        self.maxdisp = maxdisp
        self.feature = FeatureExtraction()
        self.dres0 = nn.Sequential(convbn3d(64, 32, 3, 1, 1), nn.ReLU(True), convbn3d(32, 32, 3, 1, 1), nn.ReLU(True))
        self.dres = nn.ModuleList([nn.Sequential(convbn3d(32, 32, 3, 1, 1), nn.ReLU(True), convbn3d(32, 32, 3, 1, 1))
                                   for _ in range(4)])
        self.classify = nn.Sequential(convbn3d(32, 32, 3, 1, 1), nn.ReLU(True), nn.Conv3d(32, 1, 3, 1, 1, bias=False))

    def forward(self, left, right):
        fl, fr = self.feature(left), self.feature(right)
        B, C, H, W = fl.shape
        D = self.maxdisp // 4
        cost = fl.new_zeros(B, 2 * C, D, H, W)
        for d in range(D):
            if d > 0:
                cost[:, :C, d, :, d:] = fl[:, :, :, d:]
                cost[:, C:, d, :, d:] = fr[:, :, :, :-d]
            else:
                cost[:, :C, d], cost[:, C:, d] = fl, fr
        c = self.dres0(cost)
        for blk in self.dres:
            c = c + blk(c)
        c = self.classify(c)
        c = F.interpolate(c, (self.maxdisp, left.shape[2], left.shape[3]), mode="trilinear", align_corners=False)
        prob = F.softmax(c.squeeze(1), dim=1)
        disp = torch.arange(self.maxdisp, device=prob.device, dtype=prob.dtype).view(1, -1, 1, 1)
        return (prob * disp).sum(1)


@torch.no_grad()
def test_epe(model, loader, device, maxdisp):
    model.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)  # abs err sum, valid px, >3px
    for L, R, D in loader:
        L, R, D = L.to(device), R.to(device), D.to(device)
        pred = model(L, R)
        mask = (D < maxdisp) & (D > 0)
        err = (pred[mask] - D[mask]).abs()
        acc[0] += err.sum()
        acc[1] += mask.sum()
        acc[2] += (err > 3).sum()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item(), (acc[2] / acc[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--datapath", required=True)
    ap.add_argument("--savemodel", default="./ckpt")
    ap.add_argument("--maxdisp", type=int, default=192)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--batch_size", type=int, default=3, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--loadmodel", default=None)
    args = ap.parse_args()

    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1)

    train_ds = SceneFlow(args.datapath, "TRAIN", True)
    test_ds = SceneFlow(args.datapath, "TEST", False)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    test_dl = DataLoader(torch.utils.data.Subset(test_ds, range(rank, len(test_ds), world_size)), 1,
                         num_workers=4, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(PSMNetBasic(args.maxdisp)).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))

    start_epoch = 1
    if args.loadmodel:
        sd = torch.load(args.loadmodel, map_location="cpu")
        model.module.load_state_dict(sd["state_dict"])
        if "optimizer" in sd:
            optimizer.load_state_dict(sd["optimizer"])
            start_epoch = sd["epoch"] + 1

    for epoch in range(start_epoch, args.epochs + 1):
        sampler.set_epoch(epoch)
        model.train()
        t0, tot = time.time(), 0.0
        for it, (L, R, D) in enumerate(train_dl):
            L, R, D = L.to(device, non_blocking=True), R.to(device, non_blocking=True), D.to(device, non_blocking=True)
            mask = (D < args.maxdisp) & (D > 0)
            pred = model(L, R)
            loss = F.smooth_l1_loss(pred[mask], D[mask])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            tot += loss.item()
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} iter {it}/{len(train_dl)} loss {loss.item():.3f} "
                      f"({time.time() - t0:.1f}s)", flush=True)
        if rank == 0:
            print(f"epoch {epoch} mean train loss {tot / len(train_dl):.3f}", flush=True)
            os.makedirs(args.savemodel, exist_ok=True)
            torch.save({"epoch": epoch, "state_dict": model.module.state_dict(), "optimizer": optimizer.state_dict()},
                       os.path.join(args.savemodel, f"checkpoint_{epoch}.tar"))
        dist.barrier()

    epe, d3 = test_epe(model.module, test_dl, device, args.maxdisp)
    if rank == 0:
        print(f"SceneFlow test EPE {epe:.3f}  >3px {d3 * 100:.2f}%", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
