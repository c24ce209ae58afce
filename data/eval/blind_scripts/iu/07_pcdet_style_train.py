"""Training entry for OpenPCDet models (PointPillars / SECOND / PV-RCNN configs), trimmed-down tools/train.py.

    torchrun --nproc_per_node=8 07_pcdet_style_train.py --launcher pytorch \
        --cfg_file cfgs/kitti_models/pointpillar.yaml --batch_size 32 --extra_tag pp_8gpu
"""
import argparse
import datetime
import glob
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from tensorboardX import SummaryWriter

from pcdet.config import cfg, cfg_from_list, cfg_from_yaml_file, log_config_to_file
from pcdet.datasets.kitti.kitti_dataset import KittiDataset
from pcdet.models import build_network, load_data_to_gpu
from pcdet.utils import common_utils


def parse_config():
    parser = argparse.ArgumentParser(description="arg parser")
    parser.add_argument("--cfg_file", type=str, required=True, help="specify the config for training")
    parser.add_argument("--batch_size", type=int, default=None, help="total batch size over all GPUs")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--extra_tag", type=str, default="default")
    parser.add_argument("--ckpt", type=str, default=None, help="checkpoint to start from")
    parser.add_argument("--launcher", choices=["none", "pytorch"], default="none")
    parser.add_argument("--local_rank", type=int, default=0, help="local rank for distributed training")
    parser.add_argument("--max_ckpt_save_num", type=int, default=30)
    parser.add_argument("--eval_interval", type=int, default=10)
    parser.add_argument("--set", dest="set_cfgs", default=None, nargs=argparse.REMAINDER)
    args = parser.parse_args()

    cfg_from_yaml_file(args.cfg_file, cfg)
    cfg.TAG = Path(args.cfg_file).stem
    cfg.EXP_GROUP_PATH = "/".join(args.cfg_file.split("/")[1:-1])
    if args.set_cfgs is not None:
        cfg_from_list(args.set_cfgs, cfg)
    return args, cfg


def init_dist_pytorch(local_rank, backend="nccl"):
    if mp.get_start_method(allow_none=True) is None:
        mp.set_start_method("spawn")
    num_gpus = torch.cuda.device_count()
    torch.cuda.set_device(local_rank % num_gpus)
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=60))
    return dist.get_world_size(), dist.get_rank()


def build_loader(dataset, batch_size, workers, dist_train, training):
    sampler = None
    if dist_train:
        sampler = DistributedSampler(dataset, shuffle=training)
    loader = DataLoader(dataset, batch_size=batch_size, pin_memory=True, num_workers=workers,
                        shuffle=(sampler is None) and training, collate_fn=dataset.collate_batch,
                        drop_last=training, sampler=sampler, timeout=0)
    return loader, sampler


def save_checkpoint(model, optimizer, epoch, it, filename):
    model_state = model.module.state_dict() if isinstance(model, DistributedDataParallel) else model.state_dict()
    model_state = {k: v.cpu() for k, v in model_state.items()}
    torch.save({"epoch": epoch, "it": it, "model_state": model_state, "optimizer_state": optimizer.state_dict()},
               f"{filename}.pth")


@torch.no_grad()
def eval_one_epoch(model, loader, dataset, class_names, dist_test, logger):
    model.eval()
    det_annos = []
    for batch_dict in loader:
        load_data_to_gpu(batch_dict)
        pred_dicts, _ = model(batch_dict)
        det_annos += dataset.generate_prediction_dicts(batch_dict, pred_dicts, class_names)
    if dist_test:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, det_annos)
        # DistributedSampler pads the split, keep one entry per frame
        seen, det_annos = set(), []
        for part in parts:
            for anno in part:
                if anno["frame_id"] not in seen:
                    seen.add(anno["frame_id"])
                    det_annos.append(anno)
    model.train()
    if dist_test and dist.get_rank() != 0:
        return {}
    result_str, result_dict = dataset.evaluation(det_annos, class_names, eval_metric="kitti")
    logger.info(result_str)
    return result_dict


def main():
    args, cfg = parse_config()
    if args.launcher == "none":
        dist_train, total_gpus, rank = False, 1, 0
    else:
        total_gpus, rank = init_dist_pytorch(args.local_rank)
        dist_train = True

    if args.batch_size is None:
        args.batch_size = cfg.OPTIMIZATION.BATCH_SIZE_PER_GPU
    else:
        assert args.batch_size % total_gpus == 0, "Batch size should match the number of gpus"
        args.batch_size = args.batch_size // total_gpus
    args.epochs = cfg.OPTIMIZATION.NUM_EPOCHS if args.epochs is None else args.epochs
    common_utils.set_random_seed(666 + rank)

    output_dir = cfg.ROOT_DIR / "output" / cfg.EXP_GROUP_PATH / cfg.TAG / args.extra_tag
    ckpt_dir = output_dir / "ckpt"
    output_dir.mkdir(parents=True, exist_ok=True)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    log_file = output_dir / ("train_%s.log" % datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    logger = common_utils.create_logger(log_file, rank=rank)
    logger.info("total_batch_size: %d" % (total_gpus * args.batch_size))
    if rank == 0:
        log_config_to_file(cfg, logger=logger)
    tb_log = SummaryWriter(log_dir=str(output_dir / "tensorboard")) if rank == 0 else None

    train_set = KittiDataset(dataset_cfg=cfg.DATA_CONFIG, class_names=cfg.CLASS_NAMES, training=True, logger=logger)
    test_set = KittiDataset(dataset_cfg=cfg.DATA_CONFIG, class_names=cfg.CLASS_NAMES, training=False, logger=logger)
    train_loader, train_sampler = build_loader(train_set, args.batch_size, args.workers, dist_train, True)
    test_loader, _ = build_loader(test_set, args.batch_size, args.workers, dist_train, False)

    model = build_network(model_cfg=cfg.MODEL, num_class=len(cfg.CLASS_NAMES), dataset=train_set)
    if dist_train:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.OPTIMIZATION.LR,
                                  weight_decay=cfg.OPTIMIZATION.WEIGHT_DECAY, betas=(0.95, 0.99))
    start_epoch, it = 0, 0
    if args.ckpt is None:
        ckpt_list = sorted(glob.glob(str(ckpt_dir / "*.pth")), key=os.path.getmtime)
        args.ckpt = ckpt_list[-1] if ckpt_list else None
    if args.ckpt is not None:
        it, start_epoch = model.load_params_with_optimizer(args.ckpt, to_cpu=dist_train, optimizer=optimizer, logger=logger)
        start_epoch += 1
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=cfg.OPTIMIZATION.LR, total_steps=total_steps,
                                                    pct_start=cfg.OPTIMIZATION.PCT_START, div_factor=cfg.OPTIMIZATION.DIV_FACTOR,
                                                    last_epoch=it - 1 if it > 0 else -1)
    model.train()
    if dist_train:
        model = DistributedDataParallel(model, device_ids=[args.local_rank % torch.cuda.device_count()])
    logger.info(model)

    logger.info("**********************Start training %s/%s(%s)**********************" % (cfg.EXP_GROUP_PATH, cfg.TAG, args.extra_tag))
    for cur_epoch in range(start_epoch, args.epochs):
        if train_sampler is not None:
            train_sampler.set_epoch(cur_epoch)
        end = time.time()
        for cur_it, batch_dict in enumerate(train_loader):
            data_time = time.time() - end
            load_data_to_gpu(batch_dict)
            ret_dict, tb_dict, disp_dict = model(batch_dict)
            loss = ret_dict["loss"].mean()
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), cfg.OPTIMIZATION.GRAD_NORM_CLIP)
            optimizer.step()
            scheduler.step()
            it += 1
            if it % 50 == 0:
                loss_avg = loss.detach().clone()
                if dist_train:
                    dist.all_reduce(loss_avg)
                    loss_avg /= total_gpus
                if rank == 0:
                    logger.info(f"epoch {cur_epoch} iter {cur_it}/{len(train_loader)} loss {loss_avg.item():.4f} "
                                f"lr {scheduler.get_last_lr()[0]:.6f} data {data_time:.3f}s batch {time.time() - end:.3f}s")
                    tb_log.add_scalar("train/loss", loss_avg.item(), it)
                    tb_log.add_scalar("meta_data/learning_rate", scheduler.get_last_lr()[0], it)
                    for key, val in tb_dict.items():
                        tb_log.add_scalar("train/" + key, val, it)
            end = time.time()

        if rank == 0:
            ckpt_list = sorted(glob.glob(str(ckpt_dir / "checkpoint_epoch_*.pth")), key=os.path.getmtime)
            if len(ckpt_list) >= args.max_ckpt_save_num:
                for f in ckpt_list[:len(ckpt_list) - args.max_ckpt_save_num + 1]:
                    os.remove(f)
            save_checkpoint(model, optimizer, cur_epoch, it, str(ckpt_dir / ("checkpoint_epoch_%d" % (cur_epoch + 1))))

        if (cur_epoch + 1) % args.eval_interval == 0 or cur_epoch + 1 == args.epochs:
            result = eval_one_epoch(model, test_loader, test_set, cfg.CLASS_NAMES, dist_train, logger)
            if rank == 0:
                for key, val in result.items():
                    tb_log.add_scalar("eval/" + key, val, cur_epoch + 1)
        if dist_train:
            dist.barrier()

    logger.info("**********************End training %s/%s(%s)**********************" % (cfg.EXP_GROUP_PATH, cfg.TAG, args.extra_tag))
    if dist_train:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
