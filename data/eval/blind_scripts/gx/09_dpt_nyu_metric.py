"""Fine-tune DPT-Hybrid for metric depth on NYU Depth v2 (Eigen split).

    torchrun --nproc_per_node=4 09_dpt_nyu_metric.py --nyu_root /data/nyu_depth_v2 \
        --weights weights/dpt_hybrid-midas-501f0c75.pt --out output/dpt_nyu
"""
import argparse
import logging
import os
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
from torchvision import transforms

from dpt.models import DPTDepthModel

log = logging.getLogger("dpt_nyu")

# Eigen crop used for NYU evaluation
EIGEN_CROP = (45, 471, 41, 601)


class NYUv2(Dataset):
    def __init__(self, root, split_file, train, crop=(416, 544)):
        with open(split_file) as f:
            self.pairs = [l.split()[:2] for l in f if l.strip()]
        self.root, self.train, self.crop = root, train, crop
        self.normalize = transforms.Normalize(mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5])
        self.color = transforms.ColorJitter(0.2, 0.2, 0.2, 0.05)

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        rgb_file, depth_file = self.pairs[i]
        img = Image.open(os.path.join(self.root, rgb_file.lstrip("/"))).convert("RGB")
        depth = np.asarray(Image.open(os.path.join(self.root, depth_file.lstrip("/"))), dtype=np.float32) / 1000.0

        if self.train:
            img = self.color(img)
        img = transforms.functional.to_tensor(img)
        depth = torch.from_numpy(depth)[None]

        if self.train:
            if np.random.rand() < 0.5:
                img, depth = img.flip(-1), depth.flip(-1)
            h, w = depth.shape[-2:]
            ch, cw = self.crop
            y0, x0 = np.random.randint(0, h - ch + 1), np.random.randint(0, w - cw + 1)
            img, depth = img[:, y0:y0 + ch, x0:x0 + cw], depth[:, y0:y0 + ch, x0:x0 + cw]
        return self.normalize(img), depth


class SILogLoss(nn.Module):
    def __init__(self, variance_focus=0.85):
        super().__init__()
        self.variance_focus = variance_focus

    def forward(self, pred, target, mask):
        d = torch.log(pred[mask]) - torch.log(target[mask])
        return torch.sqrt((d ** 2).mean() - self.variance_focus * (d.mean() ** 2)) * 10.0


def compute_errors(gt, pred):
    thresh = np.maximum((gt / pred), (pred / gt))
    a1 = (thresh < 1.25).mean()
    a2 = (thresh < 1.25 ** 2).mean()
    a3 = (thresh < 1.25 ** 3).mean()
    abs_rel = np.mean(np.abs(gt - pred) / gt)
    rmse = np.sqrt(((gt - pred) ** 2).mean())
    log10 = np.mean(np.abs(np.log10(gt) - np.log10(pred)))
    return dict(a1=a1, a2=a2, a3=a3, abs_rel=abs_rel, rmse=rmse, log10=log10)


@torch.no_grad()
def evaluate(model, loader, device, max_depth):
    model.eval()
    errors = []
    for img, depth in loader:
        img = img.to(device)
        pred = model(img)
        pred_flip = model(img.flip(-1)).flip(-1)
        pred = 0.5 * (pred + pred_flip)
        pred = F.interpolate(pred[:, None], size=depth.shape[-2:], mode="bicubic", align_corners=False)
        pred = pred.clamp(1e-3, max_depth).squeeze(1).cpu().numpy()
        gt = depth.squeeze(1).numpy()
        for p, g in zip(pred, gt):
            valid = (g > 1e-3) & (g < max_depth)
            eval_mask = np.zeros_like(valid)
            t, b, l, r = EIGEN_CROP
            eval_mask[t:b, l:r] = 1
            valid = valid & eval_mask.astype(bool)
            errors.append(compute_errors(g[valid], p[valid]))
    model.train()
    return {k: float(np.mean([e[k] for e in errors])) for k in errors[0]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--nyu_root", required=True)
    parser.add_argument("--train_list", default="splits/nyudepthv2_train_files_with_gt.txt")
    parser.add_argument("--test_list", default="splits/nyudepthv2_test_files_with_gt.txt")
    parser.add_argument("--weights", default=None, help="MiDaS/DPT relative-depth weights to start from")
    parser.add_argument("--out", default="output/dpt_nyu")
    parser.add_argument("--max_depth", type=float, default=10.0)
    parser.add_argument("--batch_size", type=int, default=4, help="per GPU")
    parser.add_argument("--lr", type=float, default=5e-6)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--amp", action="store_true")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s [%(levelname)s] %(message)s")

    # metric depth head: DPT predicts inverse depth, scale/shift turn it into metres
    model = DPTDepthModel(path=args.weights, scale=0.000305, shift=0.1378, invert=True,
                          backbone="vitb_rn50_384", non_negative=True, enable_attention_hooks=False)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    # the timm ViT keeps its classifier head and final norm, which the DPT decoder never uses
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    train_set = NYUv2(args.nyu_root, args.train_list, train=True)
    test_set = NYUv2(args.nyu_root, args.test_list, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=1, sampler=test_sampler, num_workers=2)

    backbone_params = [p for n, p in model.module.named_parameters() if n.startswith("pretrained.")]
    head_params = [p for n, p in model.module.named_parameters() if not n.startswith("pretrained.")]
    optimizer = torch.optim.AdamW([{"params": backbone_params, "lr": args.lr},
                                   {"params": head_params, "lr": args.lr * 10}], weight_decay=1e-2)
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[args.lr, args.lr * 10],
                                                    total_steps=total_steps, pct_start=0.3,
                                                    div_factor=25, final_div_factor=100)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    criterion = SILogLoss()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_absrel = float("inf")
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for img, depth in train_loader:
            img = img.to(device, non_blocking=True)
            depth = depth.to(device, non_blocking=True).squeeze(1)
            mask = (depth > 1e-3) & (depth < args.max_depth)

            with torch.autocast("cuda", enabled=args.amp):
                pred = model(img)
            pred = F.interpolate(pred[:, None].float(), size=depth.shape[-2:], mode="bilinear",
                                 align_corners=True).squeeze(1).clamp(min=1e-3)
            loss = criterion(pred, depth, mask)

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1

            if step % 50 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l)
                log.info("epoch %d step %d/%d silog %.4f lr %.2e (%.1fs)", epoch, step, total_steps,
                         l.item() / world_size, scheduler.get_last_lr()[0], time.time() - t0)

        metrics = evaluate(model.module, test_loader, device, args.max_depth)
        if rank == 0:
            log.info("epoch %d: " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()), epoch)
            state = {"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "metrics": metrics}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if metrics["abs_rel"] < best_absrel:
                best_absrel = metrics["abs_rel"]
                torch.save(state, os.path.join(args.out, "best.pt"))
                log.info("new best abs_rel %.4f", best_absrel)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
