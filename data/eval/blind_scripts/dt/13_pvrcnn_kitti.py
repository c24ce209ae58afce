"""PV-RCNN on KITTI (Car / Pedestrian / Cyclist), OpenPCDet-style config.

    torchrun --nproc_per_node=4 train_pvrcnn.py --cfg_file cfgs/kitti_models/pv_rcnn.yaml --batch_size 8 \
        --extra_tag r40_gtaug --ckpt_save_interval 5
"""
import argparse
import datetime
import glob
import logging
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from easydict import EasyDict
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from av3d.datasets.kitti import KittiDataset, collate_batch_pcdet
from av3d.models import PVRCNN
from av3d.eval.kitti import kitti_eval_r40


def parse_config():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg_file", type=str, required=True)
    parser.add_argument("--batch_size", type=int, default=8, help="total batch size, split over GPUs")
    parser.add_argument("--epochs", type=int, default=80)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--extra_tag", type=str, default="default")
    parser.add_argument("--ckpt_save_interval", type=int, default=1)
    parser.add_argument("--max_ckpt_save_num", type=int, default=10)
    parser.add_argument("--eval_interval", type=int, default=10)
    args = parser.parse_args()
    with open(args.cfg_file) as f:
        cfg = EasyDict(yaml.safe_load(f))
    return args, cfg


def create_logger(log_file, rank):
    logger = logging.getLogger("pvrcnn")
    logger.setLevel(logging.INFO if rank == 0 else logging.ERROR)
    fmt = logging.Formatter("%(asctime)s  %(levelname)5s  %(message)s")
    sh = logging.StreamHandler()
    sh.setFormatter(fmt)
    logger.addHandler(sh)
    if log_file is not None:
        fh = logging.FileHandler(log_file)
        fh.setFormatter(fmt)
        logger.addHandler(fh)
    return logger


def load_data_to_gpu(batch):
    for k, v in batch.items():
        if isinstance(v, np.ndarray) and k not in ("frame_id", "metadata", "calib", "image_shape"):
            batch[k] = torch.from_numpy(v).cuda(non_blocking=True)
            if k in ("voxel_coords", "voxel_num_points"):
                batch[k] = batch[k].int()
            else:
                batch[k] = batch[k].float() if batch[k].is_floating_point() else batch[k]


def build_optimizer_scheduler(model, opt_cfg, total_iters):
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt_cfg.LR, betas=(0.95, 0.99),
                                  weight_decay=opt_cfg.WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=opt_cfg.LR, total_steps=total_iters,
                                                    pct_start=opt_cfg.PCT_START, div_factor=opt_cfg.DIV_FACTOR,
                                                    base_momentum=0.85, max_momentum=0.95)
    return optimizer, scheduler


def save_ckpt(path, model, optimizer, epoch, it):
    torch.save({"epoch": epoch, "it": it, "model_state": model.module.state_dict(),
                "optimizer_state": optimizer.state_dict()}, path)


@torch.no_grad()
def eval_one_epoch(net, dataset, cfg, out_dir, logger):
    net.eval()
    loader = DataLoader(dataset, batch_size=4, shuffle=False, num_workers=4, collate_fn=collate_batch_pcdet)
    det_annos = []
    for batch in tqdm(loader, desc="eval", dynamic_ncols=True):
        load_data_to_gpu(batch)
        pred_dicts = net(batch)
        det_annos += dataset.generate_prediction_dicts(batch, pred_dicts, cfg.CLASS_NAMES)
    result_str, result = kitti_eval_r40(dataset.kitti_infos, det_annos, cfg.CLASS_NAMES)
    logger.info("\n" + result_str)
    with open(out_dir / "result.txt", "w") as f:
        f.write(result_str)
    net.train()
    return result


def main():
    args, cfg = parse_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", timeout=datetime.timedelta(minutes=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    assert args.batch_size % world_size == 0, "batch_size should be divisible by the number of GPUs"
    batch_per_gpu = args.batch_size // world_size

    output_dir = Path("output") / Path(args.cfg_file).stem / args.extra_tag
    ckpt_dir = output_dir / "ckpt"
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    logger = create_logger(output_dir / f"log_train_{datetime.datetime.now():%Y%m%d-%H%M%S}.txt" if rank == 0 else None,
                           rank)
    tb_log = SummaryWriter(log_dir=str(output_dir / "tensorboard")) if rank == 0 else None
    logger.info("world size %d, batch per gpu %d", world_size, batch_per_gpu)
    np.random.seed(1024)

    train_set = KittiDataset(cfg.DATA_CONFIG, class_names=cfg.CLASS_NAMES, training=True)
    val_set = KittiDataset(cfg.DATA_CONFIG, class_names=cfg.CLASS_NAMES, training=False)
    train_loader = DataLoader(train_set, batch_size=batch_per_gpu, shuffle=True, num_workers=args.workers,
                              pin_memory=True, collate_fn=collate_batch_pcdet, drop_last=True,
                              persistent_workers=True)

    model = PVRCNN(model_cfg=cfg.MODEL, num_class=len(cfg.CLASS_NAMES), dataset=train_set)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    model.train()
    total_iters = args.epochs * len(train_loader)
    optimizer, scheduler = build_optimizer_scheduler(model, cfg.OPTIMIZATION, total_iters)
    model = DistributedDataParallel(model, device_ids=[local_rank])

    start_epoch, it = 0, 0
    ckpts = sorted(glob.glob(str(ckpt_dir / "checkpoint_epoch_*.pth")), key=os.path.getmtime)
    if ckpts:
        ck = torch.load(ckpts[-1], map_location="cpu")
        model.module.load_state_dict(ck["model_state"])
        optimizer.load_state_dict(ck["optimizer_state"])
        start_epoch, it = ck["epoch"], ck["it"]
        for _ in range(it):
            scheduler.step()
        logger.info("resumed from %s", ckpts[-1])

    for epoch in range(start_epoch, args.epochs):
        pbar = tqdm(total=len(train_loader), desc=f"epoch {epoch}", dynamic_ncols=True, disable=rank != 0)
        for batch in train_loader:
            load_data_to_gpu(batch)
            ret_dict, tb_dict, _ = model(batch)
            loss = ret_dict["loss"].mean()
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), cfg.OPTIMIZATION.GRAD_NORM_CLIP)
            optimizer.step()
            scheduler.step()
            it += 1
            if rank == 0:
                pbar.update()
                pbar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")
                tb_log.add_scalar("train/loss", loss.item(), it)
                tb_log.add_scalar("meta_data/learning_rate", scheduler.get_last_lr()[0], it)
                for k, v in tb_dict.items():
                    tb_log.add_scalar("train/" + k, v, it)
        pbar.close()

        trained_epoch = epoch + 1
        if rank == 0 and trained_epoch % args.ckpt_save_interval == 0:
            old = sorted(glob.glob(str(ckpt_dir / "checkpoint_epoch_*.pth")), key=os.path.getmtime)
            for f in old[: max(0, len(old) - args.max_ckpt_save_num + 1)]:
                os.remove(f)
            save_ckpt(ckpt_dir / f"checkpoint_epoch_{trained_epoch}.pth", model, optimizer, trained_epoch, it)
        if trained_epoch % args.eval_interval == 0 or trained_epoch == args.epochs:
            if rank == 0:
                eval_dir = output_dir / "eval" / f"epoch_{trained_epoch}"
                eval_dir.mkdir(parents=True, exist_ok=True)
                result = eval_one_epoch(model.module, val_set, cfg, eval_dir, logger)
                for k, v in result.items():
                    tb_log.add_scalar("eval/" + k, v, trained_epoch)
            dist.barrier()

    if tb_log is not None:
        tb_log.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
