"""Supervised monocular depth on KITTI (Eigen split, projected LiDAR), ResNet-50 U-Net.

    torchrun --nproc_per_node=4 19_monodepth_kitti.py --data_path /data/kitti_raw \
        --gt_path /data/kitti_depth_annotated --filenames_train splits/eigen_train_files_with_gt.txt \
        --filenames_eval splits/eigen_test_files_with_gt.txt --log_dir logs/r50_unet
"""
import argparse
import os
import time

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
from torch.utils.tensorboard import SummaryWriter


class KittiDepth(Dataset):
    def __init__(self, data_path, gt_path, filenames, mode, height=352, width=704):
        with open(filenames) as f:
            lines = [l.split() for l in f if l.strip()]
        # eval list has entries without ground truth ("None")
        self.lines = [l for l in lines if l[1] != "None"]
        self.data_path, self.gt_path, self.mode = data_path, gt_path, mode
        self.height, self.width = height, width
        self.norm = torchvision.transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])

    def __len__(self):
        return len(self.lines)

    def __getitem__(self, idx):
        rgb_file, depth_file = self.lines[idx][0], self.lines[idx][1]
        image = Image.open(os.path.join(self.data_path, rgb_file))
        depth = Image.open(os.path.join(self.gt_path, rgb_file.split("/")[0], depth_file))
        # KITTI benchmark crop
        h, w = image.height, image.width
        top, left = int(h - 352), int((w - 1216) / 2)
        image = image.crop((left, top, left + 1216, top + 352))
        depth = depth.crop((left, top, left + 1216, top + 352))
        image = np.asarray(image, dtype=np.float32) / 255.0
        depth = np.asarray(depth, dtype=np.float32)[..., None] / 256.0

        if self.mode == "train":
            x = np.random.randint(0, image.shape[1] - self.width + 1)
            image, depth = image[:, x:x + self.width], depth[:, x:x + self.width]
            if np.random.rand() > 0.5:
                image, depth = image[:, ::-1], depth[:, ::-1]
            gamma = np.random.uniform(0.9, 1.1)
            image = np.clip(image ** gamma * np.random.uniform(0.9, 1.1), 0, 1)

        image = self.norm(torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1))))
        depth = torch.from_numpy(np.ascontiguousarray(depth.transpose(2, 0, 1)))
        return image, depth


class UpBlock(nn.Module):
    def __init__(self, cin, cskip, cout):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(cin + cskip, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout),
                                  nn.ELU(inplace=True), nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(cout), nn.ELU(inplace=True))

    def forward(self, x, skip):
        x = F.interpolate(x, size=skip.shape[-2:], mode="nearest")
        return self.conv(torch.cat([x, skip], 1))


class DepthNet(nn.Module):
    def __init__(self, max_depth=80.0):
        super().__init__()
        r = torchvision.models.resnet50(weights=torchvision.models.ResNet50_Weights.IMAGENET1K_V2)
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu)
        self.pool = r.maxpool
        self.layer1, self.layer2, self.layer3, self.layer4 = r.layer1, r.layer2, r.layer3, r.layer4
        self.up4 = UpBlock(2048, 1024, 512)
        self.up3 = UpBlock(512, 512, 256)
        self.up2 = UpBlock(256, 256, 128)
        self.up1 = UpBlock(128, 64, 64)
        self.head = nn.Sequential(nn.Conv2d(64, 32, 3, 1, 1), nn.ELU(inplace=True), nn.Conv2d(32, 1, 3, 1, 1))
        self.max_depth = max_depth

    def forward(self, x):
        s0 = self.stem(x)
        s1 = self.layer1(self.pool(s0))
        s2 = self.layer2(s1)
        s3 = self.layer3(s2)
        s4 = self.layer4(s3)
        d = self.up4(s4, s3)
        d = self.up3(d, s2)
        d = self.up2(d, s1)
        d = self.up1(d, s0)
        d = F.interpolate(d, size=x.shape[-2:], mode="bilinear", align_corners=False)
        return torch.sigmoid(self.head(d)) * self.max_depth


class SILogLoss(nn.Module):
    def __init__(self, variance_focus=0.85):
        super().__init__()
        self.variance_focus = variance_focus

    def forward(self, depth_est, depth_gt, mask):
        d = torch.log(depth_est[mask]) - torch.log(depth_gt[mask])
        return torch.sqrt((d ** 2).mean() - self.variance_focus * (d.mean() ** 2)) * 10.0


@torch.no_grad()
def evaluate(model, loader, device, args):
    """Garg crop, depth capped at 80 m. Sums are reduced across ranks."""
    model.eval()
    sums = torch.zeros(6, device=device, dtype=torch.float64)  # abs_rel, sq_rel, rmse, d1, silog, n
    for image, gt in loader:
        image, gt = image.to(device), gt.to(device)
        pred = model(image)
        pred = 0.5 * (pred + model(image.flip(-1)).flip(-1))
        pred = pred.clamp(args.min_depth_eval, args.max_depth_eval)
        _, _, h, w = gt.shape
        valid = (gt > args.min_depth_eval) & (gt < args.max_depth_eval)
        crop = torch.zeros_like(valid)
        crop[..., int(0.40810811 * h):int(0.99189189 * h), int(0.03594771 * w):int(0.96405229 * w)] = True
        valid &= crop
        for p, g, m in zip(pred, gt, valid):
            p, g = p[m], g[m]
            thresh = torch.maximum(g / p, p / g)
            err = torch.log(p) - torch.log(g)
            sums += torch.stack([((g - p).abs() / g).mean(), (((g - p) ** 2) / g).mean(),
                                 torch.sqrt(((g - p) ** 2).mean()), (thresh < 1.25).float().mean(),
                                 torch.sqrt((err ** 2).mean() - err.mean() ** 2) * 100,
                                 torch.ones((), device=device)]).double()
    dist.all_reduce(sums)
    model.train()
    n = sums[5].item()
    return dict(zip(["abs_rel", "sq_rel", "rmse", "d1", "silog"], (sums[:5] / n).tolist()))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data_path", required=True)
    p.add_argument("--gt_path", required=True)
    p.add_argument("--filenames_train", required=True)
    p.add_argument("--filenames_eval", required=True)
    p.add_argument("--log_dir", default="logs/monodepth")
    p.add_argument("--batch_size", type=int, default=4, help="per GPU")
    p.add_argument("--num_epochs", type=int, default=50)
    p.add_argument("--learning_rate", type=float, default=1e-4)
    p.add_argument("--end_learning_rate", type=float, default=1e-5)
    p.add_argument("--weight_decay", type=float, default=1e-2)
    p.add_argument("--max_depth", type=float, default=80.0)
    p.add_argument("--min_depth_eval", type=float, default=1e-3)
    p.add_argument("--max_depth_eval", type=float, default=80.0)
    p.add_argument("--eval_freq", type=int, default=1, help="epochs")
    p.add_argument("--num_threads", type=int, default=8)
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(rank)
    torch.manual_seed(0)

    model = DepthNet(args.max_depth)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    train_set = KittiDepth(args.data_path, args.gt_path, args.filenames_train, "train")
    eval_set = KittiDepth(args.data_path, args.gt_path, args.filenames_eval, "eval")
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=args.num_threads,
                              pin_memory=True, drop_last=True)
    eval_loader = DataLoader(torch.utils.data.Subset(eval_set, range(rank, len(eval_set), world)),
                             batch_size=1, shuffle=False, num_workers=2)

    optimizer = torch.optim.AdamW([{"params": model.module.parameters()}], lr=args.learning_rate,
                                  weight_decay=args.weight_decay)
    num_total_steps = args.num_epochs * len(train_loader)
    criterion = SILogLoss()
    writer = SummaryWriter(args.log_dir) if rank == 0 else None

    best_abs_rel = 1e9
    global_step = 0
    for epoch in range(args.num_epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for image, depth_gt in train_loader:
            image = image.to(device, non_blocking=True)
            depth_gt = depth_gt.to(device, non_blocking=True)

            # polynomial decay, as in BTS
            lr = (args.learning_rate - args.end_learning_rate) * (1 - global_step / num_total_steps) ** 0.9 \
                + args.end_learning_rate
            for g in optimizer.param_groups:
                g["lr"] = lr

            depth_est = model(image)
            mask = depth_gt > 1.0
            loss = criterion(depth_est, depth_gt, mask)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            global_step += 1

            if global_step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l)
                if rank == 0:
                    writer.add_scalar("silog_loss", l.item() / world, global_step)
                    writer.add_scalar("learning_rate", lr, global_step)
                    print(f"[epoch {epoch}] step {global_step}/{num_total_steps} loss {l.item() / world:.4f} "
                          f"{(time.time() - t0):.0f}s", flush=True)

        if rank == 0 and (epoch + 1) % args.eval_freq == 0:
            metrics = evaluate(model.module, eval_loader, device, args)
            for k, v in metrics.items():
                writer.add_scalar("eval/" + k, v, global_step)
            print(f"epoch {epoch} eval: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()), flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch}, os.path.join(args.log_dir, "model_latest.pth"))
            if metrics["abs_rel"] < best_abs_rel:
                best_abs_rel = metrics["abs_rel"]
                torch.save({"model": model.module.state_dict(), "epoch": epoch},
                           os.path.join(args.log_dir, "model_best_abs_rel.pth"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
