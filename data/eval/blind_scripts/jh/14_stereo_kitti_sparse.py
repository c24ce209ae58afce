"""Fine-tune IGEV-Stereo on KITTI 2012 + 2015 (sparse LiDAR disparity).

    torchrun --nproc_per_node=4 14_stereo_kitti_sparse.py \
        --restore_ckpt pretrained/sceneflow.pth --kitti12 /data/kitti12 --kitti15 /data/kitti15
"""
import argparse
import logging
import os
import os.path as osp
from glob import glob

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from core.igev_stereo import IGEVStereo

log = logging.getLogger("igev-kitti")


def read_kitti_disp(path):
    disp = np.array(Image.open(path), dtype=np.float32) / 256.0
    valid = disp > 0.0
    return disp, valid


class KittiStereo(Dataset):
    def __init__(self, root, year, crop=(320, 736), train=True, val_ids=()):
        if year == 2015:
            lefts = sorted(glob(osp.join(root, "training", "image_2", "*_10.png")))
            disps = sorted(glob(osp.join(root, "training", "disp_occ_0", "*_10.png")))
            rights = [p.replace("image_2", "image_3") for p in lefts]
        else:
            lefts = sorted(glob(osp.join(root, "training", "colored_0", "*_10.png")))
            disps = sorted(glob(osp.join(root, "training", "disp_occ", "*_10.png")))
            rights = [p.replace("colored_0", "colored_1") for p in lefts]
        keep = [i for i in range(len(lefts)) if (i in val_ids) != train]
        self.items = [(lefts[i], rights[i], disps[i]) for i in keep]
        self.crop, self.train = crop, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        l, r, d = self.items[idx]
        left = np.array(Image.open(l).convert("RGB"), dtype=np.float32)
        right = np.array(Image.open(r).convert("RGB"), dtype=np.float32)
        disp, valid = read_kitti_disp(d)
        if self.train:
            # asymmetric colour jitter and random crop; the lower part of the image
            # is favoured because the LiDAR points are there
            right = np.clip(right * np.random.uniform(0.8, 1.2, size=(1, 1, 3)), 0, 255)
            ch, cw = self.crop
            h, w = disp.shape
            y0 = np.random.randint(max(0, h - ch - 40), h - ch + 1)
            x0 = np.random.randint(0, w - cw + 1)
            left, right = left[y0:y0 + ch, x0:x0 + cw], right[y0:y0 + ch, x0:x0 + cw]
            disp, valid = disp[y0:y0 + ch, x0:x0 + cw], valid[y0:y0 + ch, x0:x0 + cw]
        to_t = lambda a: torch.from_numpy(np.ascontiguousarray(a))
        return (to_t(left).permute(2, 0, 1), to_t(right).permute(2, 0, 1),
                to_t(disp)[None], to_t(valid.astype(np.float32)))


def sequence_loss(disp_preds, disp_init, disp_gt, valid, gamma=0.9, max_disp=192):
    n = len(disp_preds)
    valid = ((valid >= 0.5) & (disp_gt[:, 0] < max_disp))[:, None]
    loss = 1.0 * F.smooth_l1_loss(disp_init[valid], disp_gt[valid], reduction="mean")
    for i in range(n):
        w = (gamma ** (15 / (n - 1))) ** (n - i - 1)
        loss = loss + w * (disp_preds[i] - disp_gt).abs()[valid].mean()
    epe = (disp_preds[-1] - disp_gt).abs()[valid]
    return loss, epe


@torch.no_grad()
def evaluate(net, val_set, device, iters=32):
    net.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for i in range(len(val_set)):
        left, right, disp, valid = val_set[i]
        left, right = left[None].to(device), right[None].to(device)
        h, w = left.shape[-2:]
        ph, pw = (32 - h % 32) % 32, (32 - w % 32) % 32
        left = F.pad(left, (pw // 2, pw - pw // 2, ph, 0), mode="replicate")
        right = F.pad(right, (pw // 2, pw - pw // 2, ph, 0), mode="replicate")
        pred = net(left, right, iters=iters, test_mode=True)[0, 0, ph:, pw // 2: pw // 2 + w]
        disp, valid = disp[0].to(device), valid.to(device) >= 0.5
        err = (pred - disp).abs()[valid]
        sums += torch.stack([err.sum(), ((err > 3) & (err > 0.05 * disp[valid])).sum(),
                             valid.sum()]).double()
    net.train()
    return (sums[0] / sums[2]).item(), (100 * sums[1] / sums[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--restore_ckpt", required=True)
    ap.add_argument("--kitti12", required=True)
    ap.add_argument("--kitti15", required=True)
    ap.add_argument("--out", default="checkpoints/igev_kitti")
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--num_steps", type=int, default=50000)
    ap.add_argument("--train_iters", type=int, default=22)
    ap.add_argument("--valid_iters", type=int, default=32)
    ap.add_argument("--max_disp", type=int, default=192)
    ap.add_argument("--mixed_precision", action="store_true")
    ap.add_argument("--hidden_dims", nargs="+", type=int, default=[128] * 3)
    ap.add_argument("--n_gru_layers", type=int, default=3)
    ap.add_argument("--corr_levels", type=int, default=2)
    ap.add_argument("--corr_radius", type=int, default=4)
    ap.add_argument("--n_downsample", type=int, default=2)
    ap.add_argument("--slow_fast_gru", action="store_true")
    ap.add_argument("--precision_dtype", default="float16")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    np.random.seed(2023 + rank)
    torch.manual_seed(2023)

    val_ids = set(range(0, 200, 10))  # 20 held-out pairs of KITTI-15 for model selection
    train_set = ConcatDataset([KittiStereo(args.kitti15, 2015, val_ids=val_ids),
                               KittiStereo(args.kitti12, 2012)])
    val_set = KittiStereo(args.kitti15, 2015, train=False, val_ids=val_ids)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    model = IGEVStereo(args)
    ckpt = torch.load(args.restore_ckpt, map_location="cpu")
    model.load_state_dict({k.removeprefix("module."): v for k, v in ckpt.items()}, strict=True)
    model.to(device)
    model.freeze_bn()
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5, eps=1e-8)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, args.num_steps + 100, pct_start=0.01,
                                                    cycle_momentum=False, anneal_strategy="linear")
    scaler = torch.cuda.amp.GradScaler(enabled=args.mixed_precision)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    step, epoch, best_d1 = 0, 0, 100.0
    model.train()
    model.module.freeze_bn()
    while step < args.num_steps:
        sampler.set_epoch(epoch)
        for left, right, disp, valid in loader:
            left, right = left.to(device, non_blocking=True), right.to(device, non_blocking=True)
            disp, valid = disp.to(device, non_blocking=True), valid.to(device, non_blocking=True)
            if valid.sum() < 500:
                # crop fell above the LiDAR coverage, nothing to supervise
                continue
            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast(enabled=args.mixed_precision):
                disp_init, disp_preds = model(left, right, iters=args.train_iters)
            loss, epe = sequence_loss([d.float() for d in disp_preds], disp_init.float(), disp, valid,
                                      max_disp=args.max_disp)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                log.info("step %d loss %.3f epe %.3f lr %.2e", step, loss.item(), epe.mean().item(),
                         scheduler.get_last_lr()[0])
            if step % 2500 == 0:
                if rank == 0:
                    epe_v, d1 = evaluate(model.module, val_set, device, args.valid_iters)
                    log.info("step %d  val epe %.3f  D1 %.2f%%", step, epe_v, d1)
                    torch.save(model.module.state_dict(), osp.join(args.out, f"igev_kitti_{step}.pth"))
                    if d1 < best_d1:
                        best_d1 = d1
                        torch.save(model.module.state_dict(), osp.join(args.out, "igev_kitti_best.pth"))
                    model.module.freeze_bn()
                dist.barrier()
            if step >= args.num_steps:
                break
        epoch += 1

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
