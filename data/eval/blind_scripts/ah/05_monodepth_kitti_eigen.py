"""Supervised monocular depth on KITTI (Eigen split, Garg crop), ResNet-50 U-Net + SILog loss.

Multi-GPU:
    torchrun --standalone --nproc_per_node=4 train_depth.py --config configs/kitti_eigen_r50.yaml
"""
import argparse
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import yaml
from PIL import Image
from torch.cuda.amp import GradScaler, autocast
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger(__name__)


class KittiDepth(Dataset):
    def __init__(self, data_path, gt_path, filenames_file, mode, input_h=352, input_w=704):
        with open(filenames_file) as f:
            self.lines = [l.split() for l in f.read().splitlines() if l.strip()]
        # Eigen test list contains frames without projected GT
        self.lines = [l for l in self.lines if l[1] != "None"]
        self.data_path, self.gt_path, self.mode = data_path, gt_path, mode
        self.h, self.w = input_h, input_w
        self.norm = torchvision.transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])

    def __len__(self):
        return len(self.lines)

    def __getitem__(self, idx):
        rgb_file, depth_file, focal = self.lines[idx][0], self.lines[idx][1], float(self.lines[idx][2])
        image = Image.open(os.path.join(self.data_path, rgb_file))
        depth = Image.open(os.path.join(self.gt_path, depth_file))
        # KB crop to 352 x 1216
        H, W = image.height, image.width
        top, left = H - 352, (W - 1216) // 2
        image = image.crop((left, top, left + 1216, top + 352))
        depth = depth.crop((left, top, left + 1216, top + 352))
        image = np.asarray(image, dtype=np.float32) / 255.0
        depth = np.asarray(depth, dtype=np.float32)[..., None] / 256.0
        if self.mode == "train":
            x = random.randint(0, image.shape[1] - self.w)
            y = random.randint(0, image.shape[0] - self.h)
            image, depth = image[y:y + self.h, x:x + self.w], depth[y:y + self.h, x:x + self.w]
            if random.random() > 0.5:
                image, depth = image[:, ::-1], depth[:, ::-1]
            if random.random() > 0.5:
                gamma = random.uniform(0.9, 1.1)
                bright = random.uniform(0.9, 1.1)
                colors = np.random.uniform(0.9, 1.1, size=3)
                image = np.clip((image ** gamma) * bright * colors, 0, 1)
        image = self.norm(torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1))
        depth = torch.from_numpy(np.ascontiguousarray(depth)).permute(2, 0, 1)
        return {"image": image, "depth": depth, "focal": focal}


class UpBlock(nn.Module):
    def __init__(self, cin, cskip, cout):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(cin + cskip, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout),
                                  nn.ELU(), nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout),
                                  nn.ELU())

    def forward(self, x, skip):
        x = F.interpolate(x, size=skip.shape[-2:], mode="bilinear", align_corners=False)
        return self.conv(torch.cat([x, skip], 1))


class DepthNet(nn.Module):
    def __init__(self, max_depth=80.0):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu)
        self.pool = r.maxpool
        self.l1, self.l2, self.l3, self.l4 = r.layer1, r.layer2, r.layer3, r.layer4
        self.u4 = UpBlock(2048, 1024, 512)
        self.u3 = UpBlock(512, 512, 256)
        self.u2 = UpBlock(256, 256, 128)
        self.u1 = UpBlock(128, 64, 64)
        self.head = nn.Sequential(nn.Conv2d(64, 32, 3, 1, 1), nn.ELU(), nn.Conv2d(32, 1, 3, 1, 1), nn.Sigmoid())
        self.max_depth = max_depth

    def forward(self, x):
        s0 = self.stem(x)
        s1 = self.l1(self.pool(s0))
        s2 = self.l2(s1)
        s3 = self.l3(s2)
        s4 = self.l4(s3)
        y = self.u1(self.u2(self.u3(self.u4(s4, s3), s2), s1), s0)
        y = F.interpolate(y, size=x.shape[-2:], mode="bilinear", align_corners=False)
        return self.head(y) * self.max_depth


class SILogLoss(nn.Module):
    def __init__(self, variance_focus=0.85):
        super().__init__()
        self.vf = variance_focus

    def forward(self, pred, gt, mask):
        d = torch.log(pred[mask]) - torch.log(gt[mask])
        return torch.sqrt((d ** 2).mean() - self.vf * d.mean() ** 2) * 10.0


def compute_errors(gt, pred):
    thresh = np.maximum(gt / pred, pred / gt)
    a1, a2, a3 = (thresh < 1.25).mean(), (thresh < 1.25 ** 2).mean(), (thresh < 1.25 ** 3).mean()
    rmse = np.sqrt(((gt - pred) ** 2).mean())
    rmse_log = np.sqrt(((np.log(gt) - np.log(pred)) ** 2).mean())
    abs_rel = np.mean(np.abs(gt - pred) / gt)
    sq_rel = np.mean(((gt - pred) ** 2) / gt)
    err = np.log(pred) - np.log(gt)
    silog = np.sqrt(np.mean(err ** 2) - np.mean(err) ** 2) * 100
    log10 = np.mean(np.abs(np.log10(pred) - np.log10(gt)))
    return np.array([silog, abs_rel, log10, rmse, sq_rel, rmse_log, a1, a2, a3])


METRIC_NAMES = ["silog", "abs_rel", "log10", "rms", "sq_rel", "log_rms", "d1", "d2", "d3"]


@torch.no_grad()
def evaluate(model, loader, device, min_depth=1e-3, max_depth=80.0):
    model.eval()
    sums, count = np.zeros(len(METRIC_NAMES)), 0
    for batch in loader:
        img = batch["image"].to(device, non_blocking=True)
        pred = model(img)
        pred = 0.5 * (pred + torch.flip(model(torch.flip(img, [3])), [3]))
        pred = pred.cpu().numpy()
        gt = batch["depth"].numpy()
        for p, g in zip(pred[:, 0], gt[:, 0]):
            p = np.clip(p, min_depth, max_depth)
            valid = (g > min_depth) & (g < max_depth)
            H, W = g.shape
            crop = np.zeros_like(valid)
            crop[int(0.40810811 * H):int(0.99189189 * H), int(0.03594771 * W):int(0.96405229 * W)] = 1
            valid &= crop.astype(bool)
            sums += compute_errors(g[valid], p[valid])
            count += 1
    model.train()
    return dict(zip(METRIC_NAMES, sums / max(count, 1)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--resume", default="")
    args = parser.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="[%(asctime)s] %(message)s")
    random.seed(cfg["seed"] + rank)
    np.random.seed(cfg["seed"] + rank)
    torch.manual_seed(cfg["seed"])

    train_set = KittiDepth(cfg["data_path"], cfg["gt_path"], cfg["train_list"], "train")
    val_set = KittiDepth(cfg["data_path_eval"], cfg["gt_path_eval"], cfg["eval_list"], "eval")
    train_sampler = DistributedSampler(train_set)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg["num_threads"], pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=val_sampler, num_workers=2, pin_memory=True)

    model = DepthNet(cfg["max_depth"])
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    enc = [p for n, p in model.module.named_parameters() if n.startswith(("stem", "l1", "l2", "l3", "l4"))]
    dec = [p for n, p in model.module.named_parameters() if not n.startswith(("stem", "l1", "l2", "l3", "l4"))]
    optimizer = torch.optim.AdamW([{"params": enc, "weight_decay": cfg["weight_decay"]},
                                   {"params": dec, "weight_decay": 0.0}], lr=cfg["lr"])
    total_steps = cfg["num_epochs"] * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=cfg["lr"], total_steps=total_steps,
                                                    div_factor=25, final_div_factor=100)
    scaler = GradScaler()
    criterion = SILogLoss(cfg["variance_focus"])

    start_epoch, best_absrel = 0, float("inf")
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_absrel = ckpt["epoch"] + 1, ckpt["best_absrel"]

    os.makedirs(cfg["log_directory"], exist_ok=True)
    for epoch in range(start_epoch, cfg["num_epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_loader):
            image = batch["image"].to(device, non_blocking=True)
            depth_gt = batch["depth"].to(device, non_blocking=True)
            with autocast():
                pred = model(image)
            mask = depth_gt > 1.0
            loss = criterion(pred.float(), depth_gt, mask)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if step % cfg["log_freq"] == 0:
                log.info("epoch %d step %d/%d silog %.4f lr %.6f", epoch, step, len(train_loader),
                         loss.item(), scheduler.get_last_lr()[0])

        metrics = evaluate(model.module, val_loader, device, cfg["min_depth_eval"], cfg["max_depth_eval"])
        if rank == 0:
            log.info("epoch %d | " + " ".join(f"{k} {v:.4f}" for k, v in metrics.items()), epoch)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch,
                     "best_absrel": min(best_absrel, metrics["abs_rel"])}
            torch.save(state, os.path.join(cfg["log_directory"], "last.pth"))
            if metrics["abs_rel"] < best_absrel:
                best_absrel = metrics["abs_rel"]
                torch.save(state, os.path.join(cfg["log_directory"], "best_abs_rel.pth"))
                log.info("new best abs_rel %.4f", best_absrel)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
