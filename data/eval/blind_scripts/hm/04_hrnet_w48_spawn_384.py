"""HRNet-W48 384x288 top-down training on COCO, launched with torch.multiprocessing.spawn.

Single node:  python 04_hrnet_w48_spawn_384.py --cfg experiments/coco/hrnet/w48_384x288_adam_lr1e-3.yaml
Two nodes:    python 04_hrnet_w48_spawn_384.py --cfg ... --nnodes 2 --node-rank 0 --dist-url tcp://10.1.1.20:23456
"""
import argparse
import json
import os
import pprint
import shutil
import time

import numpy as np
import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torchvision.transforms as transforms
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from lib.config import cfg as default_cfg, update_config
from lib.core.function import AverageMeter
from lib.core.inference import get_final_preds
from lib.core.loss import JointsMSELoss
from lib.dataset.coco import COCODataset
from lib.models.pose_hrnet import get_pose_net
from lib.utils.transforms import flip_back
from lib.utils.utils import create_logger, get_optimizer


def parse_args():
    parser = argparse.ArgumentParser(description="Train keypoints network")
    parser.add_argument("--cfg", required=True, type=str)
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--dist-url", default="tcp://127.0.0.1:23456")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("opts", nargs=argparse.REMAINDER, default=None)
    return parser.parse_args()


def train_epoch(cfg, loader, model, criterion, optimizer, scaler, epoch, gpu, logger):
    batch_time, losses = AverageMeter(), AverageMeter()
    model.train()
    end = time.time()
    for i, (inp, target, target_weight, _) in enumerate(loader):
        inp = inp.cuda(gpu, non_blocking=True)
        target = target.cuda(gpu, non_blocking=True)
        target_weight = target_weight.cuda(gpu, non_blocking=True)
        with torch.cuda.amp.autocast():
            outputs = model(inp)
            if isinstance(outputs, list):
                loss = sum(criterion(o, target, target_weight) for o in outputs)
            else:
                loss = criterion(outputs, target, target_weight)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.update(loss.item(), inp.size(0))
        batch_time.update(time.time() - end)
        end = time.time()
        if logger is not None and i % cfg.PRINT_FREQ == 0:
            logger.info(f"Epoch [{epoch}][{i}/{len(loader)}] time {batch_time.val:.3f}s ({batch_time.avg:.3f}s) "
                        f"loss {losses.val:.6f} ({losses.avg:.6f})")


@torch.no_grad()
def inference(cfg, loader, model, dataset, gpu):
    """Returns this rank's predictions keyed by dataset index."""
    model.eval()
    preds_by_idx = {}
    for inp, _, _, meta in loader:
        inp = inp.cuda(gpu, non_blocking=True)
        output = model(inp)
        output = output[-1] if isinstance(output, list) else output
        if cfg.TEST.FLIP_TEST:
            out_flip = model(inp.flip(3))
            out_flip = out_flip[-1] if isinstance(out_flip, list) else out_flip
            out_flip = flip_back(out_flip.cpu().numpy(), dataset.flip_pairs)
            out_flip = torch.from_numpy(out_flip.copy()).cuda(gpu)
            if cfg.TEST.SHIFT_HEATMAP:
                out_flip[:, :, :, 1:] = out_flip.clone()[:, :, :, 0:-1]
            output = (output + out_flip) * 0.5
        c, s = meta["center"].numpy(), meta["scale"].numpy()
        score = meta["score"].numpy()
        preds, maxvals = get_final_preds(cfg, output.float().cpu().numpy(), c, s)
        for j, idx in enumerate(meta["index"].tolist()):
            preds_by_idx[idx] = dict(kpts=np.concatenate([preds[j], maxvals[j]], 1).astype(np.float32),
                                     center=c[j], scale=s[j], area=float(np.prod(s[j] * 200)),
                                     score=float(score[j]), image=meta["image"][j])
    return preds_by_idx


def main_worker(gpu, ngpus_per_node, args):
    cfg = default_cfg.clone()
    update_config(cfg, args)
    rank = args.node_rank * ngpus_per_node + gpu
    world_size = args.nnodes * ngpus_per_node

    torch.cuda.set_device(gpu)
    dist.init_process_group(backend="nccl", init_method=args.dist_url, world_size=world_size, rank=rank)
    cudnn.benchmark = cfg.CUDNN.BENCHMARK

    logger, final_output_dir = (None, cfg.OUTPUT_DIR)
    if rank == 0:
        logger, final_output_dir, _ = create_logger(cfg, args.cfg, "train")
        logger.info(pprint.pformat(cfg))
        shutil.copy2(args.cfg, final_output_dir)
    obj = [final_output_dir]
    dist.broadcast_object_list(obj, src=0)
    final_output_dir = obj[0]

    model = get_pose_net(cfg, is_train=True)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.cuda(gpu)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[gpu], output_device=gpu)
    criterion = JointsMSELoss(use_target_weight=cfg.LOSS.USE_TARGET_WEIGHT).cuda(gpu)

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    tfm = transforms.Compose([transforms.ToTensor(), normalize])
    train_dataset = COCODataset(cfg, cfg.DATASET.ROOT, cfg.DATASET.TRAIN_SET, True, tfm)
    valid_dataset = COCODataset(cfg, cfg.DATASET.ROOT, cfg.DATASET.TEST_SET, False, tfm)
    train_sampler = DistributedSampler(train_dataset, num_replicas=world_size, rank=rank, shuffle=True)
    valid_sampler = DistributedSampler(valid_dataset, num_replicas=world_size, rank=rank, shuffle=False)
    # HRNet configs give the batch per GPU
    train_loader = DataLoader(train_dataset, batch_size=cfg.TRAIN.BATCH_SIZE_PER_GPU, sampler=train_sampler,
                              num_workers=cfg.WORKERS, pin_memory=cfg.PIN_MEMORY, drop_last=True)
    valid_loader = DataLoader(valid_dataset, batch_size=cfg.TEST.BATCH_SIZE_PER_GPU, sampler=valid_sampler,
                              num_workers=cfg.WORKERS, pin_memory=cfg.PIN_MEMORY)

    optimizer = get_optimizer(cfg, model)
    scaler = torch.cuda.amp.GradScaler()
    begin_epoch, best_perf = cfg.TRAIN.BEGIN_EPOCH, 0.0
    checkpoint_file = os.path.join(final_output_dir, "checkpoint.pth")
    # rank 0 reads the checkpoint and sends it to the other ranks (the other nodes may not see OUTPUT_DIR)
    ckpt_holder = [None]
    if args.resume and rank == 0 and os.path.exists(checkpoint_file):
        ckpt_holder[0] = torch.load(checkpoint_file, map_location="cpu")
    dist.broadcast_object_list(ckpt_holder, src=0)
    checkpoint = ckpt_holder[0]
    if checkpoint is not None:
        begin_epoch = checkpoint["epoch"]
        best_perf = checkpoint["perf"]
        model.module.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scaler.load_state_dict(checkpoint["scaler"])
        if logger:
            logger.info(f"=> resumed from {checkpoint_file} (epoch {begin_epoch})")
    lr_scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, cfg.TRAIN.LR_STEP, cfg.TRAIN.LR_FACTOR,
                                                        last_epoch=begin_epoch - 1)

    for epoch in range(begin_epoch, cfg.TRAIN.END_EPOCH):
        train_sampler.set_epoch(epoch)
        train_epoch(cfg, train_loader, model, criterion, optimizer, scaler, epoch, gpu, logger)
        lr_scheduler.step()

        local_preds = inference(cfg, valid_loader, model, valid_dataset, gpu)
        gathered = [None] * world_size if rank == 0 else None
        dist.gather_object(local_preds, gathered, dst=0)

        perf_indicator = 0.0
        if rank == 0:
            merged = {}
            for part in gathered:
                merged.update(part)  # the padded samples of DistributedSampler repeat an index
            order = sorted(merged)
            all_preds = np.stack([merged[i]["kpts"] for i in order])
            all_boxes = np.array([[*merged[i]["center"], *merged[i]["scale"], merged[i]["area"], merged[i]["score"]]
                                  for i in order])
            image_path = [merged[i]["image"] for i in order]
            name_values, perf_indicator = valid_dataset.evaluate(cfg, all_preds, final_output_dir, all_boxes,
                                                                 image_path, None, None)
            logger.info(f"epoch {epoch}: " + json.dumps(name_values))
            best = perf_indicator >= best_perf
            best_perf = max(best_perf, perf_indicator)
            torch.save({"epoch": epoch + 1, "model": cfg.MODEL.NAME, "state_dict": model.module.state_dict(),
                        "perf": best_perf, "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()},
                       checkpoint_file)
            if best:
                torch.save(model.module.state_dict(), os.path.join(final_output_dir, "model_best.pth"))
        dist.barrier()

    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(final_output_dir, "final_state.pth"))
        logger.info(f"best AP {best_perf:.4f}")
    dist.destroy_process_group()


def main():
    args = parse_args()
    ngpus_per_node = torch.cuda.device_count()
    mp.spawn(main_worker, nprocs=ngpus_per_node, args=(ngpus_per_node, args))


if __name__ == "__main__":
    main()
