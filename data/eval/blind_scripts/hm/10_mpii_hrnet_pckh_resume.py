"""HRNet-W32 on MPII (256x256), PCKh@0.5 evaluation, preemption-safe resume.

The cluster preempts jobs; the sbatch wrapper re-launches the same command and
training continues from <output>/checkpoint.pth.

    torchrun --nproc_per_node=4 10_mpii_hrnet_pckh_resume.py --cfg experiments/mpii/hrnet/w32_256x256_adam_lr1e-3.yaml
"""
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
import torch.nn as nn
import torchvision.transforms as transforms
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from lib.config import cfg, update_config
from lib.core.loss import JointsMSELoss
from lib.dataset.mpii import MPIIDataset
from lib.models.pose_hrnet import get_pose_net
from lib.utils.transforms import flip_back

logger = logging.getLogger(__name__)

# MPII joint order: 0 r-ankle ... 8 upper neck, 9 head top ... 15 l-wrist
HEAD_TOP, UPPER_NECK = 9, 8
PCKH_THR = 0.5


def parse_args():
    parser = argparse.ArgumentParser(description="Train HRNet on MPII")
    parser.add_argument("--cfg", required=True)
    parser.add_argument("--seed", type=int, default=317)
    parser.add_argument("opts", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    update_config(cfg, args)
    return args


def get_max_preds(heatmaps):
    b, k, h, w = heatmaps.shape
    flat = heatmaps.reshape(b, k, -1)
    maxvals, idx = flat.max(dim=2)
    preds = torch.stack([idx % w, idx // w], dim=2).float()
    preds *= (maxvals > 0).unsqueeze(-1).float()
    return preds, maxvals


@torch.no_grad()
def validate(model, loader, device, flip_pairs):
    """Accumulates PCKh hits per joint on this rank, then sums them over all ranks."""
    model.eval()
    hits = torch.zeros(16, device=device)
    counts = torch.zeros(16, device=device)
    loss_sum = torch.zeros(2, device=device)
    criterion = JointsMSELoss(use_target_weight=True)
    for inp, target, target_weight, meta in loader:
        inp = inp.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        target_weight = target_weight.to(device, non_blocking=True)
        out = model(inp)
        if cfg.TEST.FLIP_TEST:
            out_flip = model(inp.flip(3)).cpu().numpy()
            out_flip = torch.from_numpy(flip_back(out_flip, flip_pairs).copy()).to(device)
            out_flip[:, :, :, 1:] = out_flip.clone()[:, :, :, 0:-1]
            out = (out + out_flip) * 0.5
        loss_sum += torch.stack([criterion(out, target, target_weight) * inp.size(0),
                                 torch.tensor(float(inp.size(0)), device=device)])
        pred, _ = get_max_preds(out)
        gt, _ = get_max_preds(target)
        # head segment length in heatmap pixels, from the ground-truth head box
        head_size = meta["head_size"].to(device).float() / (cfg.MODEL.IMAGE_SIZE[0] / cfg.MODEL.HEATMAP_SIZE[0])
        vis = target_weight.squeeze(-1) > 0
        d = (pred - gt).norm(dim=2) / head_size.unsqueeze(1).clamp(min=1e-6)
        hits += ((d <= PCKH_THR) & vis).float().sum(0)
        counts += vis.float().sum(0)
    dist.all_reduce(hits)
    dist.all_reduce(counts)
    dist.all_reduce(loss_sum)
    pckh = hits / counts.clamp(min=1)
    return pckh, (loss_sum[0] / loss_sum[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed + rank)
    cudnn.benchmark = cfg.CUDNN.BENCHMARK
    cudnn.deterministic = cfg.CUDNN.DETERMINISTIC

    output_dir = os.path.join(cfg.OUTPUT_DIR, cfg.DATASET.DATASET, os.path.basename(args.cfg).split(".")[0])
    writer = None
    if rank == 0:
        os.makedirs(output_dir, exist_ok=True)
        logging.basicConfig(filename=os.path.join(output_dir, "train.log"), level=logging.INFO,
                            format="%(asctime)-15s %(message)s")
        logging.getLogger("").addHandler(logging.StreamHandler())
        writer = SummaryWriter(log_dir=os.path.join(output_dir, "tb"))
    dist.barrier()

    model = get_pose_net(cfg, is_train=True)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    criterion = JointsMSELoss(use_target_weight=cfg.LOSS.USE_TARGET_WEIGHT).to(device)

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_dataset = MPIIDataset(cfg, cfg.DATASET.ROOT, cfg.DATASET.TRAIN_SET, True,
                                transforms.Compose([transforms.ToTensor(), normalize]))
    valid_dataset = MPIIDataset(cfg, cfg.DATASET.ROOT, cfg.DATASET.TEST_SET, False,
                                transforms.Compose([transforms.ToTensor(), normalize]))
    train_sampler = DistributedSampler(train_dataset)
    train_loader = DataLoader(train_dataset, batch_size=cfg.TRAIN.BATCH_SIZE_PER_GPU, sampler=train_sampler,
                              num_workers=cfg.WORKERS, pin_memory=cfg.PIN_MEMORY, drop_last=True)
    # strided split without DistributedSampler's padding, so no sample is counted twice in PCKh
    valid_shard = Subset(valid_dataset, range(rank, len(valid_dataset), world_size))
    valid_loader = DataLoader(valid_shard, batch_size=cfg.TEST.BATCH_SIZE_PER_GPU, shuffle=False,
                              num_workers=cfg.WORKERS, pin_memory=cfg.PIN_MEMORY)

    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.TRAIN.LR)
    begin_epoch, best_perf = cfg.TRAIN.BEGIN_EPOCH, 0.0
    checkpoint_file = os.path.join(output_dir, "checkpoint.pth")
    if cfg.AUTO_RESUME and os.path.exists(checkpoint_file):
        checkpoint = torch.load(checkpoint_file)
        begin_epoch = checkpoint["epoch"]
        best_perf = checkpoint["perf"]
        model.module.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        logger.info("=> loaded checkpoint '%s' (epoch %d)", checkpoint_file, begin_epoch)
    lr_scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, cfg.TRAIN.LR_STEP, cfg.TRAIN.LR_FACTOR,
                                                        last_epoch=begin_epoch - 1)

    global_step = begin_epoch * len(train_loader)
    for epoch in range(begin_epoch, cfg.TRAIN.END_EPOCH):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for i, (inp, target, target_weight, _) in enumerate(train_loader):
            inp = inp.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            target_weight = target_weight.to(device, non_blocking=True)
            loss = criterion(model(inp), target, target_weight)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            global_step += 1
            if writer is not None and i % cfg.PRINT_FREQ == 0:
                writer.add_scalar("train_loss", loss.item(), global_step)
                logger.info("Epoch %d [%d/%d] loss %.6f %.2fs/it", epoch, i, len(train_loader), loss.item(),
                            (time.time() - tic) / (i + 1))
        lr_scheduler.step()

        pckh, val_loss = validate(model.module, valid_loader, device, valid_dataset.flip_pairs)
        mean_pckh = pckh.mean().item()
        if rank == 0:
            names = ["r_ankle", "r_knee", "r_hip", "l_hip", "l_knee", "l_ankle", "pelvis", "thorax",
                     "upper_neck", "head_top", "r_wrist", "r_elbow", "r_shoulder", "l_shoulder", "l_elbow", "l_wrist"]
            logger.info("epoch %d val loss %.6f PCKh@0.5 %.2f | %s", epoch, val_loss, mean_pckh * 100,
                        " ".join(f"{n}:{v * 100:.1f}" for n, v in zip(names, pckh.tolist())))
            writer.add_scalar("valid_loss", val_loss, epoch)
            writer.add_scalar("valid_PCKh", mean_pckh, epoch)
            is_best = mean_pckh >= best_perf
            best_perf = max(best_perf, mean_pckh)
            torch.save({"epoch": epoch + 1, "model": cfg.MODEL.NAME, "state_dict": model.module.state_dict(),
                        "perf": best_perf, "optimizer": optimizer.state_dict()}, checkpoint_file)
            if is_best:
                torch.save(model.module.state_dict(), os.path.join(output_dir, "model_best.pth"))
        dist.barrier()

    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(output_dir, "final_state.pth"))
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
