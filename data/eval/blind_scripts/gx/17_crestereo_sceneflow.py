"""CREStereo (PyTorch port) pre-training on SceneFlow + CREStereo synthetic data.

    torchrun --nproc_per_node=8 17_crestereo_sceneflow.py --cfg cfgs/train_sceneflow.yaml
"""
import argparse
import glob
import logging
import os
import pickle
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from nets import Model
from dataset_utils import read_pfm, StereoAugmentor


class SceneFlowStereo(Dataset):
    """Left/right/disparity triplets from FlyingThings3D, Driving and Monkaa.

    Walking the SceneFlow tree on the NFS share takes several minutes, so the
    resulting file list is cached next to the data.
    """

    SUBSETS = ("flyingthings3d", "driving", "monkaa")

    def __init__(self, root, crop_size, passes=("frames_cleanpass", "frames_finalpass"), cache_dir=None):
        self.augmentor = StereoAugmentor(crop_size, min_scale=-0.2, max_scale=0.5, yjitter=True)
        cache_dir = cache_dir or root
        cache_file = os.path.join(cache_dir, "sceneflow_{}.pkl".format("_".join(passes)))
        if os.path.exists(cache_file):
            with open(cache_file, "rb") as f:
                self.samples = pickle.load(f)
        else:
            self.samples = self._scan(root, passes)
            with open(cache_file, "wb") as f:
                pickle.dump(self.samples, f)

    @staticmethod
    def _scan(root, passes):
        samples = []
        for subset in SceneFlowStereo.SUBSETS:
            for p in passes:
                lefts = sorted(glob.glob(os.path.join(root, subset, p, "**", "left", "*.png"), recursive=True))
                for left in lefts:
                    if "TEST" in left:
                        continue
                    right = left.replace(os.sep + "left" + os.sep, os.sep + "right" + os.sep)
                    disp = left.replace(p, "disparity").replace(".png", ".pfm")
                    if os.path.exists(right) and os.path.exists(disp):
                        samples.append((left, right, disp))
        return samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        left, right, disp = self.samples[idx]
        img1 = cv2.imread(left, cv2.IMREAD_COLOR)[:, :, ::-1]
        img2 = cv2.imread(right, cv2.IMREAD_COLOR)[:, :, ::-1]
        d = read_pfm(disp).astype(np.float32)
        img1, img2, d, valid = self.augmentor(img1, img2, d)
        return (torch.from_numpy(img1.copy()).permute(2, 0, 1).float(),
                torch.from_numpy(img2.copy()).permute(2, 0, 1).float(),
                torch.from_numpy(d.copy())[None], torch.from_numpy(valid.copy())[None].float())


class CREStereoSynthetic(Dataset):
    def __init__(self, root, crop_size):
        self.lefts = sorted(glob.glob(os.path.join(root, "*", "*_left.jpg")))
        self.augmentor = StereoAugmentor(crop_size, min_scale=-0.2, max_scale=0.5, yjitter=True)

    def __len__(self):
        return len(self.lefts)

    def __getitem__(self, idx):
        left = self.lefts[idx]
        img1 = cv2.imread(left)[:, :, ::-1]
        img2 = cv2.imread(left.replace("_left.jpg", "_right.jpg"))[:, :, ::-1]
        d = cv2.imread(left.replace("_left.jpg", "_left.disp.png"), cv2.IMREAD_UNCHANGED).astype(np.float32) / 32.0
        img1, img2, d, valid = self.augmentor(img1, img2, d)
        return (torch.from_numpy(img1.copy()).permute(2, 0, 1).float(),
                torch.from_numpy(img2.copy()).permute(2, 0, 1).float(),
                torch.from_numpy(d.copy())[None], torch.from_numpy(valid.copy())[None].float())


def sequence_loss(flow_preds, flow_gt, valid, gamma=0.8, max_disp=512.0):
    n_predictions = len(flow_preds)
    flow_loss = 0.0
    valid = (valid >= 0.5) & (flow_gt.abs() < max_disp)
    for i in range(n_predictions):
        i_weight = gamma ** (n_predictions - i - 1)
        # the network predicts a 2-channel flow; only x carries the (negative) disparity
        i_loss = F.l1_loss(flow_preds[i][:, :1], -flow_gt, reduction="none")
        flow_loss += i_weight * (valid * i_loss).mean()
    epe = (flow_preds[-1][:, :1] + flow_gt).abs()[valid]
    return flow_loss, epe.mean().detach()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg", required=True)
    args = parser.parse_args()
    with open(args.cfg) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(cfg.get("seed", 0) + rank)
    torch.manual_seed(cfg.get("seed", 0))

    log_dir = cfg["log_dir"]
    if rank == 0:
        os.makedirs(os.path.join(log_dir, "models"), exist_ok=True)
        logging.basicConfig(filename=os.path.join(log_dir, "train.log"), level=logging.INFO,
                            format="%(asctime)s %(message)s")
        logging.getLogger().addHandler(logging.StreamHandler())
    logger = logging.getLogger("crestereo")

    crop = tuple(cfg["crop_size"])
    train_set = ConcatDataset([
        SceneFlowStereo(cfg["sceneflow_root"], crop),
        CREStereoSynthetic(cfg["crestereo_root"], crop),
    ])
    sampler = DistributedSampler(train_set, shuffle=True, seed=cfg.get("seed", 0))
    loader = DataLoader(train_set, batch_size=cfg["batch_size"] // world, sampler=sampler,
                        num_workers=cfg.get("num_workers", 8), pin_memory=True, drop_last=True)

    model = Model(max_disp=cfg["max_disp"], mixed_precision=cfg.get("mixed_precision", False), test_mode=False)
    model = DDP(model.to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg["base_lr"], betas=(0.9, 0.999))

    start_epoch = 0
    ckpt_path = os.path.join(log_dir, "models", "latest.pth")
    if cfg.get("resume", True) and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optim_state_dict"])
        start_epoch = ckpt["epoch"] + 1
        if rank == 0:
            logger.info("resumed from epoch %d", ckpt["epoch"])

    writer = SummaryWriter(os.path.join(log_dir, "tb")) if rank == 0 else None
    iters_per_epoch = len(loader)
    total_iters = cfg["n_total_epoch"] * iters_per_epoch
    warmup = cfg.get("warmup_iters", 6000)

    for epoch in range(start_epoch, cfg["n_total_epoch"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (left, right, gt_disp, valid) in enumerate(loader):
            cur = epoch * iters_per_epoch + it
            # linear warmup, then linear decay to 5% of the base lr
            if cur < warmup:
                lr = cfg["base_lr"] * 0.05 + (cfg["base_lr"] - cfg["base_lr"] * 0.05) * cur / warmup
            else:
                lr = cfg["base_lr"] - (cfg["base_lr"] * 0.95) * (cur - warmup) / max(1, total_iters - warmup)
            for g in optimizer.param_groups:
                g["lr"] = lr

            left, right = left.to(device, non_blocking=True), right.to(device, non_blocking=True)
            gt_disp, valid = gt_disp.to(device, non_blocking=True), valid.to(device, non_blocking=True)

            flow_predictions = model(left, right, iters=cfg["n_iters"])
            loss, epe = sequence_loss(flow_predictions, gt_disp, valid, gamma=0.8)

            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()

            if it % cfg.get("log_every", 50) == 0:
                stats = torch.stack([loss.detach(), epe])
                dist.all_reduce(stats)
                stats /= world
                if rank == 0:
                    writer.add_scalar("train/loss", stats[0].item(), cur)
                    writer.add_scalar("train/epe", stats[1].item(), cur)
                    logger.info("epoch %d it %d/%d lr %.2e loss %.3f epe %.3f %.2fs/it", epoch, it, iters_per_epoch,
                                lr, stats[0].item(), stats[1].item(), (time.time() - t0) / (it + 1))

        if rank == 0:
            state = {"epoch": epoch, "state_dict": model.module.state_dict(),
                     "optim_state_dict": optimizer.state_dict()}
            torch.save(state, os.path.join(log_dir, "models", "epoch-%d.pth" % epoch))
            torch.save(state, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
