"""AANet-style stereo training on SceneFlow (finalpass), DDP.

The SceneFlow tree has ~35k stereo pairs spread over thousands of folders on the
NFS share; walking it takes minutes, so the file list is cached next to the data.

    torchrun --nproc_per_node=8 12_aanet_sceneflow_index.py --data_dir /nfs/datasets/SceneFlow
"""
import argparse
import os
import pickle
import re
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from nets.aanet import AANet

IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def read_pfm(path):
    with open(path, "rb") as f:
        header = f.readline().rstrip()
        color = header == b"PF"
        w, h = map(int, re.findall(rb"\d+", f.readline()))
        scale = float(f.readline().rstrip())
        endian = "<" if scale < 0 else ">"
        data = np.fromfile(f, endian + "f")
    shape = (h, w, 3) if color else (h, w)
    return np.flipud(np.reshape(data, shape)).copy()


def scan_sceneflow(root, split):
    pairs = []
    sub = "TRAIN" if split == "train" else "TEST"
    things = os.path.join(root, "FlyingThings3D", "frames_finalpass", sub)
    for dirpath, _, files in os.walk(things):
        if not dirpath.endswith(os.sep + "left"):
            continue
        for fn in sorted(files):
            if fn.endswith(".png"):
                left = os.path.join(dirpath, fn)
                right = left.replace(os.sep + "left" + os.sep, os.sep + "right" + os.sep)
                disp = left.replace("frames_finalpass", "disparity").replace(".png", ".pfm")
                pairs.append((left, right, disp))
    if split == "train":
        for scene in ("Monkaa", "Driving"):
            base = os.path.join(root, scene, "frames_finalpass")
            for dirpath, _, files in os.walk(base):
                if not dirpath.endswith(os.sep + "left"):
                    continue
                for fn in sorted(files):
                    left = os.path.join(dirpath, fn)
                    right = left.replace(os.sep + "left" + os.sep, os.sep + "right" + os.sep)
                    disp = left.replace("frames_finalpass", "disparity").replace(".png", ".pfm")
                    pairs.append((left, right, disp))
    return pairs


def load_index(root, split):
    cache = os.path.join(root, f".index_{split}.pkl")
    if os.path.isfile(cache):
        with open(cache, "rb") as f:
            return pickle.load(f)
    pairs = scan_sceneflow(root, split)
    with open(cache, "wb") as f:
        pickle.dump(pairs, f)
    return pairs


class SceneFlowStereo(Dataset):
    def __init__(self, root, split, crop=(288, 576)):
        self.pairs = load_index(root, split)
        self.split = split
        self.crop = crop

    def __len__(self):
        return len(self.pairs)

    @staticmethod
    def _norm(img):
        img = img.astype(np.float32) / 255.0
        return ((img - IMAGENET_MEAN) / IMAGENET_STD).transpose(2, 0, 1)

    def __getitem__(self, i):
        lp, rp, dp = self.pairs[i]
        left = cv2.cvtColor(cv2.imread(lp), cv2.COLOR_BGR2RGB)
        right = cv2.cvtColor(cv2.imread(rp), cv2.COLOR_BGR2RGB)
        disp = read_pfm(dp).astype(np.float32)
        if self.split == "train":
            ch, cw = self.crop
            h, w = disp.shape
            y = np.random.randint(0, h - ch + 1)
            x = np.random.randint(0, w - cw + 1)
            left, right = left[y:y + ch, x:x + cw], right[y:y + ch, x:x + cw]
            disp = disp[y:y + ch, x:x + cw]
        else:
            # 540x960 -> pad to 576x960 (divisible by 48 for the aggregation pyramid)
            left = np.pad(left, ((36, 0), (0, 0), (0, 0)), mode="edge")
            right = np.pad(right, ((36, 0), (0, 0), (0, 0)), mode="edge")
            disp = np.pad(disp, ((36, 0), (0, 0)), mode="constant")
        return (torch.from_numpy(self._norm(left)), torch.from_numpy(self._norm(right)),
                torch.from_numpy(np.ascontiguousarray(disp)))


def multiscale_loss(preds, gt, max_disp, weights=(1 / 3, 2 / 3, 1.0, 1.0, 1.0)):
    # preds: list of (B, h_i, w_i), coarse to fine; upsample to gt size
    mask = (gt > 0) & (gt < max_disp)
    total = 0.0
    for w, p in zip(weights, preds):
        if p.shape[-2:] != gt.shape[-2:]:
            scale = gt.shape[-1] / p.shape[-1]
            p = F.interpolate(p.unsqueeze(1), size=gt.shape[-2:], mode="bilinear", align_corners=False).squeeze(1) * scale
        total = total + w * F.smooth_l1_loss(p[mask], gt[mask], reduction="mean")
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--checkpoint_dir", default="checkpoints/aanet_sceneflow")
    ap.add_argument("--max_disp", type=int, default=192)
    ap.add_argument("--batch_size", type=int, default=4, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=64)
    ap.add_argument("--milestones", type=int, nargs="+", default=[20, 30, 40, 50, 60])
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(326)
    np.random.seed(326 + rank)

    train_set = SceneFlowStereo(args.data_dir, "train")
    test_set = SceneFlowStereo(args.data_dir, "test")
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)

    model = AANet(args.max_disp, num_downsample=2, feature_type="aanet",
                  feature_pyramid_network=True, num_scales=3, num_fusions=6,
                  deformable_groups=2, mdconv_dilation=2, refinement_type="stereodrnet",
                  no_intermediate_supervision=False)
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, args.milestones, gamma=0.5)
    if rank == 0:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        print(f"train pairs {len(train_set)}, test pairs {len(test_set)}, world {world}", flush=True)

    best_epe = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (left, right, gt) in enumerate(train_loader):
            left, right, gt = left.to(device), right.to(device), gt.to(device)
            preds = model(left, right)
            loss = multiscale_loss(preds, gt, args.max_disp)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} [{i}/{len(train_loader)}] loss {loss.item():.3f}", flush=True)
        scheduler.step()

        if rank == 0:
            model.eval()
            err_sum, n = 0.0, 0
            with torch.no_grad():
                for j in range(0, len(test_set), 10):  # every 10th test pair, for speed
                    left, right, gt = test_set[j]
                    pred = model.module(left[None].to(device), right[None].to(device))[-1][0]
                    gt = gt.to(device)
                    mask = (gt > 0) & (gt < args.max_disp)
                    err_sum += (pred[mask] - gt[mask]).abs().mean().item()
                    n += 1
            epe = err_sum / max(n, 1)
            print(f"epoch {epoch}: subsampled test EPE {epe:.3f} ({time.time() - t0:.0f}s)", flush=True)
            state = {"epoch": epoch, "state_dict": model.module.state_dict(),
                     "optimizer": optimizer.state_dict(), "epe": epe}
            torch.save(state, os.path.join(args.checkpoint_dir, "aanet_latest.pth"))
            if epe < best_epe:
                best_epe = epe
                torch.save(state, os.path.join(args.checkpoint_dir, "aanet_best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
