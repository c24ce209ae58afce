# FCOS R-50-FPN 1x training script (maskrcnn-benchmark style).
#
#   torchrun --nproc_per_node=8 11_fcos_train.py --config-file configs/fcos/fcos_R_50_FPN_1x.yaml \
#       OUTPUT_DIR training_dir/fcos_R_50_FPN_1x
import argparse
import datetime
import logging
import os
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from fcos_core.config import cfg
from fcos_core.data import build_dataset, BatchCollator
from fcos_core.data.samplers import GroupedBatchSampler, IterationBasedBatchSampler
from fcos_core.engine.inference import inference
from fcos_core.modeling.detector import build_detection_model
from fcos_core.solver import make_lr_scheduler, make_optimizer
from fcos_core.utils.checkpoint import DetectronCheckpointer
from fcos_core.utils.comm import get_rank, synchronize, reduce_loss_dict
from fcos_core.utils.logger import setup_logger


def make_train_loader(cfg, is_distributed, start_iter):
    num_gpus = dist.get_world_size() if is_distributed else 1
    images_per_batch = cfg.SOLVER.IMS_PER_BATCH
    assert images_per_batch % num_gpus == 0, "SOLVER.IMS_PER_BATCH must be divisible by the number of GPUs"
    images_per_gpu = images_per_batch // num_gpus
    dataset = build_dataset(cfg.DATASETS.TRAIN, is_train=True, cfg=cfg)
    sampler = DistributedSampler(dataset, shuffle=True) if is_distributed else \
        torch.utils.data.RandomSampler(dataset)
    aspect_ratios = [dataset.get_img_info(i)["height"] / dataset.get_img_info(i)["width"]
                     for i in range(len(dataset))]
    group_ids = [int(r > 1.0) for r in aspect_ratios]
    batch_sampler = GroupedBatchSampler(sampler, group_ids, images_per_gpu, drop_uneven=False)
    # IterationBasedBatchSampler calls sampler.set_epoch() on every new pass over the data
    batch_sampler = IterationBasedBatchSampler(batch_sampler, cfg.SOLVER.MAX_ITER, start_iter)
    return DataLoader(dataset, num_workers=cfg.DATALOADER.NUM_WORKERS, batch_sampler=batch_sampler,
                      collate_fn=BatchCollator(cfg.DATALOADER.SIZE_DIVISIBILITY))


def make_test_loaders(cfg, is_distributed):
    loaders = []
    for name in cfg.DATASETS.TEST:
        dataset = build_dataset([name], is_train=False, cfg=cfg)
        sampler = DistributedSampler(dataset, shuffle=False) if is_distributed else \
            torch.utils.data.SequentialSampler(dataset)
        loaders.append((name, DataLoader(dataset, batch_size=1, sampler=sampler, num_workers=4,
                                         collate_fn=BatchCollator(cfg.DATALOADER.SIZE_DIVISIBILITY))))
    return loaders


def run_test(cfg, model, distributed, iteration):
    if distributed:
        model = model.module
    torch.cuda.empty_cache()
    results = {}
    for name, loader in make_test_loaders(cfg, distributed):
        output_folder = os.path.join(cfg.OUTPUT_DIR, "inference", name, f"iter_{iteration:07d}")
        if get_rank() == 0:
            os.makedirs(output_folder, exist_ok=True)
        # inference() all-gathers the predictions and evaluates on the main process
        results[name] = inference(model, loader, dataset_name=name, iou_types=("bbox",),
                                  box_only=False, device=cfg.MODEL.DEVICE, output_folder=output_folder)
        synchronize()
    return results


def do_train(model, data_loader, optimizer, scheduler, checkpointer, device, checkpoint_period,
             arguments, distributed, test_period):
    logger = logging.getLogger("fcos_core.trainer")
    max_iter = len(data_loader)
    start_iter = arguments["iteration"]
    model.train()
    meters = defaultdict(float)
    start_training_time = time.time()
    end = time.time()
    for iteration, (images, targets, _) in enumerate(data_loader, start_iter):
        iteration = iteration + 1
        arguments["iteration"] = iteration

        images = images.to(device)
        targets = [t.to(device) for t in targets]
        loss_dict = model(images, targets)
        losses = sum(loss for loss in loss_dict.values())

        loss_dict_reduced = reduce_loss_dict(loss_dict)
        for k, v in loss_dict_reduced.items():
            meters[k] = 0.9 * meters[k] + 0.1 * v.item() if meters[k] else v.item()

        optimizer.zero_grad()
        losses.backward()
        optimizer.step()
        scheduler.step()

        batch_time = time.time() - end
        end = time.time()
        if iteration % 20 == 0 or iteration == max_iter:
            eta = datetime.timedelta(seconds=int(batch_time * (max_iter - iteration)))
            logger.info(f"eta: {eta}  iter: {iteration}  "
                        + "  ".join(f"{k}: {v:.4f}" for k, v in meters.items())
                        + f"  lr: {optimizer.param_groups[0]['lr']:.6f}"
                        + f"  max mem: {torch.cuda.max_memory_allocated() / 1024 ** 2:.0f}MB")
        if iteration % checkpoint_period == 0:
            checkpointer.save(f"model_{iteration:07d}", **arguments)
        if test_period > 0 and iteration % test_period == 0:
            run_test(cfg, model, distributed, iteration)
            model.train()
        if iteration == max_iter:
            checkpointer.save("model_final", **arguments)

    total = datetime.timedelta(seconds=int(time.time() - start_training_time))
    logger.info(f"Total training time: {total} ({(time.time() - start_training_time) / max_iter:.4f} s / it)")


def main():
    parser = argparse.ArgumentParser(description="PyTorch Object Detection Training")
    parser.add_argument("--config-file", default="", metavar="FILE")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--skip-test", dest="skip_test", action="store_true")
    parser.add_argument("opts", default=None, nargs=argparse.REMAINDER)
    args = parser.parse_args()

    num_gpus = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else 1
    args.distributed = num_gpus > 1
    if args.distributed:
        torch.cuda.set_device(args.local_rank)
        dist.init_process_group(backend="nccl", init_method="env://")
        synchronize()

    cfg.merge_from_file(args.config_file)
    cfg.merge_from_list(args.opts)
    cfg.freeze()

    output_dir = cfg.OUTPUT_DIR
    if output_dir and get_rank() == 0:
        os.makedirs(output_dir, exist_ok=True)
    logger = setup_logger("fcos_core", output_dir, get_rank())
    logger.info(f"Using {num_gpus} GPUs")
    logger.info(f"Running with config:\n{cfg}")

    model = build_detection_model(cfg)
    device = torch.device(cfg.MODEL.DEVICE)
    model.to(device)
    if cfg.MODEL.USE_SYNCBN:
        assert args.distributed, "SyncBN needs a distributed launch"
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)

    optimizer = make_optimizer(cfg, model)
    scheduler = make_lr_scheduler(cfg, optimizer)  # WarmupMultiStepLR
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[args.local_rank], output_device=args.local_rank,
            broadcast_buffers=False,  # backbone uses FrozenBatchNorm, nothing to broadcast
        )

    arguments = {"iteration": 0}
    save_to_disk = get_rank() == 0
    checkpointer = DetectronCheckpointer(cfg, model, optimizer, scheduler, output_dir, save_to_disk)
    extra = checkpointer.load(cfg.MODEL.WEIGHT)  # loads to CPU, strips "module." when needed
    arguments.update(extra)

    data_loader = make_train_loader(cfg, args.distributed, arguments["iteration"])
    do_train(model, data_loader, optimizer, scheduler, checkpointer, device,
             cfg.SOLVER.CHECKPOINT_PERIOD, arguments, args.distributed, cfg.SOLVER.TEST_PERIOD)

    if not args.skip_test:
        run_test(cfg, model, args.distributed, arguments["iteration"])
    if args.distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
