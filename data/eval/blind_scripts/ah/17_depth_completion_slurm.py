"""Sparse-to-dense LiDAR depth completion on KITTI Depth Completion (RGB + sparse velodyne -> dense depth).

Slurm (one task per GPU, srun starts every process itself):
    #SBATCH --nodes=4 --ntasks-per-node=8 --gres=gpu:8 --cpus-per-task=12
    srun --kill-on-bad-exit=1 python train_completion.py --data /shared/kitti_depth \
        --work-dir /shared/exp/s2d_r18 --port 29533
"""
import argparse
import glob
import os
import subprocess

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


def init_dist_slurm(port):
    proc_id = int(os.environ["SLURM_PROCID"])
    ntasks = int(os.environ["SLURM_NTASKS"])
    local_id = int(os.environ["SLURM_LOCALID"])
    node_list = os.environ["SLURM_NODELIST"]
    addr = subprocess.getoutput(f"scontrol show hostname {node_list} | head -n1")
    os.environ.setdefault("MASTER_PORT", str(port))
    os.environ.setdefault("MASTER_ADDR", addr)
    os.environ["WORLD_SIZE"] = str(ntasks)
    os.environ["LOCAL_RANK"] = str(local_id)
    os.environ["RANK"] = str(proc_id)
    torch.cuda.set_device(local_id)
    dist.init_process_group(backend="nccl")
    return proc_id, ntasks, local_id


class KittiDC(Dataset):
    def __init__(self, root, split, train, crop=(256, 1216)):
        if split == "train":
            self.sparse = sorted(glob.glob(os.path.join(root, "train", "*_sync", "proj_depth", "velodyne_raw",
                                                        "image_0[23]", "*.png")))
        else:
            self.sparse = sorted(glob.glob(os.path.join(root, "val_selection_cropped", "velodyne_raw", "*.png")))
        self.root, self.split, self.train, self.crop = root, split, train, crop

    def __len__(self):
        return len(self.sparse)

    def paths(self, sp):
        if self.split == "train":
            gt = sp.replace("velodyne_raw", "groundtruth")
            seq = sp.split(os.sep)[-5]
            date = seq[:10]
            cam = sp.split(os.sep)[-2]
            rgb = os.path.join(self.root, "raw", date, seq, cam, "data", os.path.basename(sp))
        else:
            gt = sp.replace("velodyne_raw", "groundtruth_depth")
            rgb = sp.replace("velodyne_raw", "image")
        return rgb, gt

    def __getitem__(self, i):
        rgb_p, gt_p = self.paths(self.sparse[i])
        rgb = np.asarray(Image.open(rgb_p).convert("RGB"), np.float32) / 255.0
        sparse = np.asarray(Image.open(self.sparse[i]), np.float32) / 256.0
        gt = np.asarray(Image.open(gt_p), np.float32) / 256.0
        h, w = sparse.shape
        ch, cw = self.crop
        y = h - ch  # bottom crop, sky has no lidar
        x = np.random.randint(0, w - cw + 1) if self.train else (w - cw) // 2
        rgb, sparse, gt = rgb[y:y + ch, x:x + cw], sparse[y:y + ch, x:x + cw], gt[y:y + ch, x:x + cw]
        if self.train and np.random.rand() < 0.5:
            rgb, sparse, gt = rgb[:, ::-1], sparse[:, ::-1], gt[:, ::-1]
        if self.train:
            rgb = np.clip(rgb * np.random.uniform(0.8, 1.2), 0, 1)
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a))
        return t(rgb).permute(2, 0, 1), t(sparse)[None], t(gt)[None]


class S2DResNet(nn.Module):
    def __init__(self):
        super().__init__()
        r = torchvision.models.resnet18(weights="IMAGENET1K_V1")
        self.conv_rgb = nn.Sequential(nn.Conv2d(3, 48, 3, 1, 1, bias=False), nn.BatchNorm2d(48), nn.ReLU(True))
        self.conv_d = nn.Sequential(nn.Conv2d(1, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(True))
        self.conv1 = nn.Sequential(nn.Conv2d(64, 64, 3, 2, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(True))
        self.l1, self.l2, self.l3, self.l4 = r.layer1, r.layer2, r.layer3, r.layer4

        def up(cin, cout):
            return nn.Sequential(nn.ConvTranspose2d(cin, cout, 3, 2, 1, 1, bias=False), nn.BatchNorm2d(cout),
                                 nn.ReLU(True))
        self.d4, self.d3, self.d2 = up(512, 256), up(512, 128), up(256, 64)
        self.d1, self.d0 = up(128, 64), nn.Conv2d(128, 1, 3, 1, 1)

    def forward(self, rgb, sparse):
        x0 = torch.cat([self.conv_rgb(rgb), self.conv_d(sparse)], 1)
        x1 = self.l1(self.conv1(x0))
        x2 = self.l2(x1)
        x3 = self.l3(x2)
        x4 = self.l4(x3)
        y = self.d4(x4)
        y = self.d3(torch.cat([y, x3], 1))
        y = self.d2(torch.cat([y, x2], 1))
        y = self.d1(torch.cat([y, x1], 1))
        return F.relu(self.d0(torch.cat([y, x0], 1)))


class EMA:
    def __init__(self, model, decay=0.999):
        self.decay = decay
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model):
        for k, v in model.state_dict().items():
            if v.dtype.is_floating_point:
                self.shadow[k].mul_(self.decay).add_(v.detach(), alpha=1 - self.decay)
            else:
                self.shadow[k].copy_(v)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(4, device=device, dtype=torch.float64)  # sq err, abs err, inv sq err, n
    for rgb, sparse, gt in loader:
        rgb, sparse, gt = rgb.to(device), sparse.to(device), gt.to(device)
        pred = model(rgb, sparse).clamp(min=0.9)
        m = gt > 0
        e = pred[m] - gt[m]
        s[0] += (e ** 2).sum()
        s[1] += e.abs().sum()
        s[2] += ((1.0 / pred[m] - 1.0 / gt[m]) * 1000).pow(2).sum()
        s[3] += m.sum()
    dist.all_reduce(s)
    model.train()
    return {"RMSE_mm": (s[0] / s[3]).sqrt().item() * 1000, "MAE_mm": (s[1] / s[3]).item() * 1000,
            "iRMSE": (s[2] / s[3]).sqrt().item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--port", type=int, default=29533)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=4, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3, help="for 32 GPUs x 4")
    ap.add_argument("--amp", action="store_true")
    args = ap.parse_args()

    rank, world, local = init_dist_slurm(args.port)
    device = torch.device("cuda", local)
    torch.manual_seed(0)

    train_ds, val_ds = KittiDC(args.data, "train", True), KittiDC(args.data, "val", False)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)), 1, num_workers=4)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(S2DResNet()).to(device)
    model = DDP(net, device_ids=[local], output_device=local)
    ema = EMA(net)
    lr = args.lr * world * args.batch_size / 128
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs * len(train_dl))
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    ckpt = os.path.join(args.work_dir, "latest.pth")
    start = 0
    if os.path.isfile(ckpt):
        st = torch.load(ckpt, map_location="cpu")
        net.load_state_dict(st["model"])
        ema.shadow = {k: v.to(device) for k, v in st["ema"].items()}
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        scaler.load_state_dict(st["scaler"])
        start = st["epoch"] + 1
        if rank == 0:
            print(f"resumed from {ckpt} (epoch {st['epoch']})", flush=True)

    eval_net = S2DResNet().to(device)
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, (rgb, sparse, gt) in enumerate(train_dl):
            rgb, sparse, gt = (t.to(device, non_blocking=True) for t in (rgb, sparse, gt))
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                pred = model(rgb, sparse)
            m = gt > 0
            loss = F.mse_loss(pred.float()[m], gt[m])
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            ema.update(net)
            if rank == 0 and it % 100 == 0:
                print(f"[{epoch}][{it}/{len(train_dl)}] mse {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}",
                      flush=True)

        eval_net.load_state_dict({k.replace("module.", ""): v for k, v in ema.shadow.items()})
        metrics = evaluate(eval_net, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} EMA val: " + ", ".join(f"{k} {v:.2f}" for k, v in metrics.items()), flush=True)
            os.makedirs(args.work_dir, exist_ok=True)
            torch.save({"model": net.state_dict(), "ema": ema.shadow, "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch},
                       ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
