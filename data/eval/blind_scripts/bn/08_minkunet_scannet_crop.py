"""MinkUNet34C semantic segmentation on ScanNet (MinkowskiEngine 0.5), random-crop training.

torchrun --nproc_per_node=8 train_minkunet.py --scannet_path data/scannet_processed --voxel_size 0.02
"""
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import MinkowskiEngine as ME
from examples.minkunet import MinkUNet34C   # MinkowskiEngine/examples

VALID_CLASS_IDS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 14, 16, 24, 28, 33, 34, 36, 39)
IGNORE = 255


def build_label_map():
    m = np.full(256, IGNORE, dtype=np.int64)
    for i, c in enumerate(VALID_CLASS_IDS):
        m[c] = i
    return m


class ScanNetVoxels(Dataset):
    def __init__(self, root, split, voxel_size, crop_size=None):
        with open(os.path.join(root, f"{split}.txt")) as f:
            self.files = [os.path.join(root, l.strip()) for l in f if l.strip()]
        self.voxel_size, self.crop_size = voxel_size, crop_size
        self.label_map = build_label_map()

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(self.files[i])
        xyz, rgb, lab = d["xyz"].astype(np.float32), d["rgb"].astype(np.float32), d["label"].astype(np.int64)
        if self.crop_size is not None:
            theta = np.random.uniform(0, 2 * np.pi)
            c, s = np.cos(theta), np.sin(theta)
            xyz = xyz @ np.array([[c, -s, 0], [s, c, 0], [0, 0, 1]], dtype=np.float32).T
            xyz *= np.random.uniform(0.9, 1.1)
            rgb = np.clip(rgb + np.random.normal(0, 5.0, 3), 0, 255)
            # random crop in the xy plane
            lo = xyz[np.random.randint(len(xyz)), :2] - self.crop_size / 2
            m = np.all((xyz[:, :2] >= lo) & (xyz[:, :2] < lo + self.crop_size), axis=1)
            xyz, rgb, lab = xyz[m], rgb[m], lab[m]
        coords, feats, labels = ME.utils.sparse_quantize(xyz, rgb / 255.0 - 0.5, labels=self.label_map[lab],
                                                         quantization_size=self.voxel_size,
                                                         ignore_label=IGNORE)
        return coords, feats, labels


def collate_sparse(batch):
    coords, feats, labels = zip(*batch)
    bcoords, bfeats, blabels = ME.utils.sparse_collate(coords, feats, labels)
    return bcoords, bfeats.float(), blabels.long()


def fast_hist(pred, label, n):
    k = label != IGNORE
    return torch.bincount(n * label[k] + pred[k], minlength=n ** 2).reshape(n, n)


@torch.no_grad()
def validate(net, loader, device, n_cls):
    net.eval()
    hist = torch.zeros(n_cls, n_cls, dtype=torch.long, device=device)
    for coords, feats, labels in loader:
        x = ME.SparseTensor(feats.to(device), coordinates=coords.to(device))
        pred = net(x).F.argmax(1)
        hist += fast_hist(pred, labels.to(device), n_cls)
    dist.all_reduce(hist)
    ious = hist.diag().float() / (hist.sum(0) + hist.sum(1) - hist.diag()).float().clamp(min=1)
    return ious


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--scannet_path", default="data/scannet_processed")
    parser.add_argument("--voxel_size", type=float, default=0.02)
    parser.add_argument("--crop_size", type=float, default=3.0)
    parser.add_argument("--min_points", type=int, default=2000)
    parser.add_argument("--batch_size", type=int, default=16, help="total over all GPUs")
    parser.add_argument("--max_iter", type=int, default=60000)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--val_freq", type=int, default=2000)
    parser.add_argument("--out_dir", default="outputs/minkunet34c")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank{rank}] %(message)s")
    log = logging.getLogger("minkunet")
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)

    n_cls = len(VALID_CLASS_IDS)
    train_set = ScanNetVoxels(args.scannet_path, "train", args.voxel_size, args.crop_size)
    val_set = ScanNetVoxels(args.scannet_path, "val", args.voxel_size, None)
    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size // world, sampler=sampler, num_workers=6,
                              collate_fn=collate_sparse, drop_last=True, pin_memory=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)),
                            batch_size=1, num_workers=4, collate_fn=collate_sparse)

    net = MinkUNet34C(3, n_cls, D=3)
    net = ME.MinkowskiSyncBatchNorm.convert_sync_batchnorm(net).to(device)
    net = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
    scheduler = torch.optim.lr_scheduler.PolynomialLR(optimizer, total_iters=args.max_iter, power=0.9)
    criterion = nn.CrossEntropyLoss(ignore_index=IGNORE)

    it, epoch, best = 0, 0, 0.0
    t0 = time.time()
    while it < args.max_iter:
        sampler.set_epoch(epoch)
        net.train()
        for coords, feats, labels in train_loader:
            if feats.shape[0] < args.min_points:
                # a few crops land on almost empty floor; they only add noise
                continue
            x = ME.SparseTensor(feats.to(device), coordinates=coords.to(device))
            out = net(x)
            loss = criterion(out.F, labels.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            it += 1

            if it % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l)
                log.info(f"iter {it}/{args.max_iter} loss {l.item() / world:.4f} "
                         f"lr {scheduler.get_last_lr()[0]:.4f} {(time.time() - t0) / 50:.2f}s/it")
                t0 = time.time()

            if it % args.val_freq == 0:
                ious = validate(net.module, val_loader, device, n_cls)
                miou = ious.mean().item()
                log.info(f"iter {it} val mIoU {miou:.4f} | " + " ".join(f"{v:.2f}" for v in ious.tolist()))
                if rank == 0:
                    ckpt = {"iteration": it, "state_dict": net.module.state_dict(),
                            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
                    torch.save(ckpt, os.path.join(args.out_dir, "checkpoint.pth"))
                    if miou > best:
                        best = miou
                        torch.save(ckpt, os.path.join(args.out_dir, "best.pth"))
                dist.barrier()
                net.train()
            if it >= args.max_iter:
                break
        epoch += 1

    log.info(f"done, best mIoU {best:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
