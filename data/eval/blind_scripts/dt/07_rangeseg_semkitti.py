"""Range-image lidar semantic segmentation (SalsaNext-like) on SemanticKITTI.

Spherical projections are precomputed once per scan into a cache directory
(each rank converts its own disjoint slice of the scans, written via tmp file +
rename), then training reads the small .npz files.

    torchrun --nproc_per_node=4 train_rangeseg.py --root /datasets/semantickitti --cache /datasets/semkitti_range64
"""
import argparse
import datetime
import glob
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler

TRAIN_SEQ = ["00", "01", "02", "03", "04", "05", "06", "07", "09", "10"]
VAL_SEQ = ["08"]
H, W = 64, 2048
FOV_UP, FOV_DOWN = 3.0, -25.0
IGNORE = 255


def project_scan(scan, label):
    depth = np.linalg.norm(scan[:, :3], axis=1)
    yaw = -np.arctan2(scan[:, 1], scan[:, 0])
    pitch = np.arcsin(scan[:, 2] / np.maximum(depth, 1e-6))
    fov = math.radians(FOV_UP) - math.radians(FOV_DOWN)
    u = np.clip(np.floor(0.5 * (yaw / np.pi + 1.0) * W), 0, W - 1).astype(np.int32)
    v = np.clip(np.floor((1.0 - (pitch + abs(math.radians(FOV_DOWN))) / fov) * H), 0, H - 1).astype(np.int32)
    order = np.argsort(depth)[::-1]
    img = np.zeros((5, H, W), np.float32)
    lab = np.full((H, W), IGNORE, np.uint8)
    img[0, v[order], u[order]] = depth[order]
    img[1:4, v[order], u[order]] = scan[order, :3].T
    img[4, v[order], u[order]] = scan[order, 3]
    lab[v[order], u[order]] = label[order]
    return img, lab


def build_cache(root, cache_dir, learning_map, rank, world):
    lut = np.full(max(learning_map) + 1, IGNORE, np.uint8)
    for k, v in learning_map.items():
        lut[k] = v - 1 if v > 0 else IGNORE  # 0 = unlabeled -> ignore, classes become 0..18
    scans = []
    for seq in TRAIN_SEQ + VAL_SEQ:
        os.makedirs(os.path.join(cache_dir, seq), exist_ok=True)
        scans += sorted(glob.glob(os.path.join(root, "sequences", seq, "velodyne", "*.bin")))
    for scan_path in scans[rank::world]:
        seq = scan_path.split(os.sep)[-3]
        out = os.path.join(cache_dir, seq, os.path.basename(scan_path).replace(".bin", ".npz"))
        if os.path.exists(out):
            continue
        scan = np.fromfile(scan_path, np.float32).reshape(-1, 4)
        label_path = scan_path.replace("velodyne", "labels").replace(".bin", ".label")
        sem = np.fromfile(label_path, np.uint32) & 0xFFFF
        img, lab = project_scan(scan, lut[sem])
        tmp = out + f".tmp{rank}.npz"
        np.savez_compressed(tmp, img=img, label=lab)
        os.replace(tmp, out)


class RangeDataset(Dataset):
    MEAN = np.array([12.12, 10.88, 0.23, -1.04, 0.21], np.float32)[:, None, None]
    STD = np.array([12.32, 11.47, 6.91, 0.86, 0.16], np.float32)[:, None, None]

    def __init__(self, cache_dir, seqs, training):
        self.files = sorted(f for s in seqs for f in glob.glob(os.path.join(cache_dir, s, "*.npz")))
        self.training = training

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(self.files[i])
        img, lab = d["img"], d["label"].astype(np.int64)
        mask = img[0] > 0
        img = (img - self.MEAN) / self.STD * mask
        if self.training:
            if np.random.rand() < 0.5:
                img, lab = img[:, :, ::-1], lab[:, ::-1]
                img[2] = -img[2]  # y flips with the column order
            shift = np.random.randint(W)
            img, lab = np.roll(img, shift, axis=2), np.roll(lab, shift, axis=1)
        x = np.concatenate([img, mask[None].astype(np.float32)])
        return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(lab))


class ShardSampler(Sampler):
    """Contiguous, non-padded split for evaluation: every scan is scored exactly once."""

    def __init__(self, n, rank, world):
        per = int(math.ceil(n / world))
        self.idx = list(range(rank * per, min(n, (rank + 1) * per)))

    def __iter__(self):
        return iter(self.idx)

    def __len__(self):
        return len(self.idx)


def conv_block(cin, cout, dilation=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=dilation, dilation=dilation, bias=False),
                         nn.BatchNorm2d(cout), nn.LeakyReLU(0.1, inplace=True))


class RangeNet(nn.Module):
    def __init__(self, in_ch=6, num_classes=19):
        super().__init__()
        ch = [32, 64, 128, 256]
        self.stem = conv_block(in_ch, ch[0])
        self.enc = nn.ModuleList()
        cin = ch[0]
        for c in ch:
            self.enc.append(nn.Sequential(conv_block(cin, c), conv_block(c, c, 2), nn.Dropout2d(0.1)))
            cin = c
        self.dec = nn.ModuleList()
        for c_skip, c_out in zip(ch[-2::-1], ch[-2::-1]):
            self.dec.append(nn.Sequential(conv_block(cin + c_skip, c_out), conv_block(c_out, c_out)))
            cin = c_out
        self.cls = nn.Conv2d(cin, num_classes, 1)

    def forward(self, x):
        x = self.stem(x)
        skips = []
        for i, blk in enumerate(self.enc):
            x = blk(x)
            if i < len(self.enc) - 1:
                skips.append(x)
                x = F.avg_pool2d(x, (1, 2) if i == 0 else 2)
        for blk, s in zip(self.dec, reversed(skips)):
            x = F.interpolate(x, size=s.shape[-2:], mode="bilinear", align_corners=False)
            x = blk(torch.cat([x, s], 1))
        return self.cls(x)


@torch.no_grad()
def evaluate(model, loader, num_classes, device):
    model.eval()
    conf = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        pred = model(x).argmax(1)
        valid = y != IGNORE
        conf += torch.bincount(y[valid] * num_classes + pred[valid], minlength=num_classes ** 2).view(num_classes, -1)
    dist.all_reduce(conf)  # sum the per-rank confusion matrices
    iou = conf.diag().float() / (conf.sum(0) + conf.sum(1) - conf.diag()).float().clamp(min=1)
    model.train()
    return iou


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--cache", required=True)
    p.add_argument("--config", default="semantic-kitti.yaml")
    p.add_argument("--epochs", type=int, default=150)
    p.add_argument("--bs", type=int, default=4, help="per GPU, per micro-step")
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--out", default="ckpt/rangeseg")
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # long timeout: the first run converts ~23k scans before the first barrier
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    with open(args.config) as f:
        sk_cfg = yaml.safe_load(f)
    class_names = [sk_cfg["labels"][k] for k, v in sorted(sk_cfg["learning_map_inv"].items()) if k > 0]
    num_classes = len(class_names)
    build_cache(args.root, args.cache, sk_cfg["learning_map"], rank, world)
    dist.barrier()

    train_ds = RangeDataset(args.cache, TRAIN_SEQ, training=True)
    val_ds = RangeDataset(args.cache, VAL_SEQ, training=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=8, pin_memory=True,
                          drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=8, sampler=ShardSampler(len(val_ds), rank, world), num_workers=8,
                        pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(RangeNet(num_classes=num_classes)).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    cls_freq = np.zeros(num_classes)
    for k, v in sk_cfg["learning_map"].items():
        if v > 0 and k in sk_cfg["content"]:
            cls_freq[v - 1] += sk_cfg["content"][k]
    weight = torch.tensor(1.0 / np.sqrt(cls_freq + 1e-3), dtype=torch.float32, device=device)
    criterion = nn.CrossEntropyLoss(weight=weight / weight.mean(), ignore_index=IGNORE)

    optim = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
    steps_per_epoch = len(train_dl) // args.accum
    sched = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=args.lr, total_steps=args.epochs * steps_per_epoch)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project="lidar-seg", name=os.path.basename(args.out), config=vars(args))

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        optim.zero_grad(set_to_none=True)
        for it, (x, y) in enumerate(train_dl):
            if it >= steps_per_epoch * args.accum:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            sync_now = (it + 1) % args.accum == 0
            if sync_now:
                loss = criterion(model(x), y) / args.accum
                loss.backward()
                optim.step()
                sched.step()
                optim.zero_grad(set_to_none=True)
            else:
                with model.no_sync():
                    loss = criterion(model(x), y) / args.accum
                    loss.backward()
            if rank == 0 and it % 100 == 0:
                wandb.log({"train/loss": loss.item() * args.accum, "lr": sched.get_last_lr()[0]},
                          step=epoch * len(train_dl) + it)

        iou = evaluate(model, val_dl, num_classes, device)
        miou = iou.mean().item()
        if rank == 0:
            wandb.log({"val/mIoU": miou, **{f"val/iou_{n}": v.item() for n, v in zip(class_names, iou)}},
                      step=(epoch + 1) * len(train_dl))
            state = {"model": model.module.state_dict(), "epoch": epoch, "miou": miou}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if miou > best:
                best = miou
                torch.save(state, os.path.join(args.out, "best.pt"))
            print(f"epoch {epoch}: mIoU {miou:.4f} (best {best:.4f})", flush=True)

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
