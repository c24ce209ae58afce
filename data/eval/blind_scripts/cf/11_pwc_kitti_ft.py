"""Fine-tune PWC-Net on KITTI 2012 + 2015 (sparse flow), distributed.

torchrun --nproc_per_node=4 ft_kitti.py --cfg configs/kitti_ft.yaml
"""
import argparse
import logging
import os
import os.path as osp
import random
from glob import glob

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

from pwc.models import PWCDCNet
from pwc.augment import SparseAugmentor

cv2.setNumThreads(0)
logging.basicConfig(format="%(asctime)s [%(levelname)s] %(message)s", level=logging.INFO)
log = logging.getLogger("pwc-kitti")


def read_kitti_flow(path):
    flow = cv2.imread(path, cv2.IMREAD_ANYDEPTH | cv2.IMREAD_COLOR)[:, :, ::-1].astype(np.float32)
    flow, valid = flow[:, :, :2], flow[:, :, 2]
    flow = (flow - 2 ** 15) / 64.0
    return flow, valid


class KittiFlow(Dataset):
    def __init__(self, root, year, augmentor=None):
        img_dir = "colored_0" if year == 2012 else "image_2"
        flow_dir = "flow_occ"
        self.img1 = sorted(glob(osp.join(root, img_dir, "*_10.png")))
        self.img2 = sorted(glob(osp.join(root, img_dir, "*_11.png")))
        self.flow = sorted(glob(osp.join(root, flow_dir, "*_10.png")))
        assert len(self.img1) == len(self.img2) == len(self.flow)
        self.augmentor = augmentor

    def __len__(self):
        return len(self.flow)

    def __getitem__(self, i):
        im1 = cv2.imread(self.img1[i])[:, :, ::-1].astype(np.float32) / 255.0
        im2 = cv2.imread(self.img2[i])[:, :, ::-1].astype(np.float32) / 255.0
        flow, valid = read_kitti_flow(self.flow[i])
        if self.augmentor is not None:
            im1, im2, flow, valid = self.augmentor(im1, im2, flow, valid)
        to_t = lambda a: torch.from_numpy(np.ascontiguousarray(a))
        return to_t(im1).permute(2, 0, 1), to_t(im2).permute(2, 0, 1), to_t(flow).permute(2, 0, 1), to_t(valid)


def sparse_multiscale_loss(preds, flow, valid, weights, div_flow=20.0):
    """Upsample every pyramid level to full resolution and take the EPE over valid pixels."""
    H, W = flow.shape[-2:]
    mask = valid > 0.5
    loss = 0.0
    for pred, w in zip(preds, weights):
        up = F.interpolate(pred * div_flow, (H, W), mode="bilinear", align_corners=False)
        up = up * (H / pred.shape[-2])
        epe = torch.norm(up - flow, p=2, dim=1)
        loss = loss + w * epe[mask].sum() / mask.sum().clamp(min=1)
    return loss


def pad64(x):
    h, w = x.shape[-2:]
    ph, pw = (64 - h % 64) % 64, (64 - w % 64) % 64
    return F.pad(x, [0, pw, 0, ph], mode="replicate"), (h, w)


@torch.no_grad()
def evaluate(model, dataset, device, rank, world, div_flow):
    model.eval()
    epe_list, out_list = [], []
    for idx in range(rank, len(dataset), world):
        im1, im2, flow, valid = dataset[idx]
        im1, (h, w) = pad64(im1[None].to(device))
        im2, _ = pad64(im2[None].to(device))
        pred = model(im1, im2) * div_flow
        pred = F.interpolate(pred, im1.shape[-2:], mode="bilinear", align_corners=False) * 4.0
        pred = pred[0, :, :h, :w]
        flow, valid = flow.to(device), valid.to(device) > 0.5
        epe = torch.norm(pred - flow, p=2, dim=0)[valid]
        mag = torch.norm(flow, p=2, dim=0)[valid]
        epe_list.append(epe)
        out_list.append(((epe > 3.0) & (epe / mag > 0.05)).float())
    model.train()

    epe_all = torch.cat(epe_list)
    out_all = torch.cat(out_list)
    gathered_epe = [torch.zeros_like(epe_all) for _ in range(world)]
    gathered_out = [torch.zeros_like(out_all) for _ in range(world)]
    dist.all_gather(gathered_epe, epe_all)
    dist.all_gather(gathered_out, out_all)
    epe_all = torch.cat(gathered_epe)
    out_all = torch.cat(gathered_out)
    return epe_all.mean().item(), 100.0 * out_all.mean().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    with open(args.cfg) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank != 0:
        log.setLevel(logging.WARNING)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    aug = SparseAugmentor(crop_size=cfg["crop"], min_scale=-0.2, max_scale=0.4, do_flip=False)
    k12 = KittiFlow(cfg["kitti2012"], 2012, aug)
    k15 = KittiFlow(cfg["kitti2015"], 2015, aug)
    n15 = len(k15)
    val_idx = list(range(n15 - cfg["num_val"], n15))
    train_set = ConcatDataset([k12, Subset(k15, list(range(0, n15 - cfg["num_val"])))])
    val_set = Subset(KittiFlow(cfg["kitti2015"], 2015, None), val_idx)

    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=sampler, num_workers=cfg.get("workers", 4),
                        pin_memory=True, drop_last=True)

    model = PWCDCNet(md=4)
    sd = torch.load(cfg["init"], map_location="cpu")
    model.load_state_dict(sd.get("state_dict", sd))
    model = DDP(model.to(device), device_ids=[local_rank])

    optimizer = torch.optim.Adam(model.parameters(), lr=cfg["lr"], weight_decay=cfg.get("wd", 4e-4))
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, cfg["milestones"], gamma=0.5)
    weights = cfg.get("loss_weights", [0.32, 0.08, 0.02, 0.01, 0.005])
    div_flow = cfg.get("div_flow", 20.0)
    os.makedirs(cfg["out_dir"], exist_ok=True)

    best = float("inf")
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        acc = torch.zeros(2, device=device)
        for im1, im2, flow, valid in loader:
            im1, im2 = im1.to(device, non_blocking=True), im2.to(device, non_blocking=True)
            flow, valid = flow.to(device, non_blocking=True), valid.to(device, non_blocking=True)
            preds = model(im1, im2)
            loss = sparse_multiscale_loss(preds, flow, valid, weights, div_flow)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(acc)
        log.info("epoch %d  loss %.4f  lr %.2e", epoch, (acc[0] / acc[1]).item(), scheduler.get_last_lr()[0])

        if (epoch + 1) % cfg.get("eval_every", 10) == 0:
            epe, fl = evaluate(model.module, val_set, device, rank, world, div_flow)
            log.info("epoch %d  KITTI-15 val  EPE %.3f  Fl-all %.2f%%", epoch, epe, fl)
            if rank == 0:
                torch.save({"epoch": epoch, "state_dict": model.module.state_dict()},
                           osp.join(cfg["out_dir"], "last.pth"))
                if fl < best:
                    best = fl
                    torch.save({"epoch": epoch, "state_dict": model.module.state_dict()},
                               osp.join(cfg["out_dir"], "best.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
