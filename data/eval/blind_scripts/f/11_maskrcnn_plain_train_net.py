"""plain_train_net.py -- Mask R-CNN training loop in the detectron2 "plain" style, without the
detectron2 dependency (torchvision model, our own launch/comm helpers).

    python plain_train_net.py --num-gpus 8 --config configs/mask_rcnn_R50_FPN_3x.yaml OUTPUT_DIR out/mrcnn
"""
import argparse
import logging
import os
import socket
import time
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import CocoDetection
from torchvision.models.detection import maskrcnn_resnet50_fpn_v2
from torchvision.transforms.v2 import functional as F2
from torchvision import tv_tensors
from torchvision.datasets import wrap_dataset_for_transforms_v2

logger = logging.getLogger("plain_train_net")


# ----------------------------------------------------------------------------- comm / launch
def get_world_size():
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def get_rank():
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main_process():
    return get_rank() == 0


def synchronize():
    if get_world_size() > 1:
        dist.barrier()


def _find_free_port():
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


def launch(main_func, num_gpus_per_machine, num_machines=1, machine_rank=0, dist_url=None, args=()):
    world_size = num_machines * num_gpus_per_machine
    if world_size > 1:
        if dist_url == "auto":
            assert num_machines == 1, "dist_url=auto not supported in multi-machine jobs."
            dist_url = f"tcp://127.0.0.1:{_find_free_port()}"
        mp.spawn(_distributed_worker, nprocs=num_gpus_per_machine,
                 args=(main_func, world_size, num_gpus_per_machine, machine_rank, dist_url, args),
                 daemon=False)
    else:
        main_func(*args)


def _distributed_worker(local_rank, main_func, world_size, num_gpus_per_machine, machine_rank, dist_url, args):
    assert torch.cuda.is_available(), "cuda is not available. Please check your installation."
    global_rank = machine_rank * num_gpus_per_machine + local_rank
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="NCCL", init_method=dist_url, world_size=world_size, rank=global_rank)
    dist.barrier(device_ids=[local_rank])
    try:
        main_func(*args)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- data / model
def trivial_batch_collator(batch):
    return tuple(zip(*batch))


def build_train_loader(cfg):
    ds = CocoDetection(cfg["DATASETS"]["TRAIN_IMAGES"], cfg["DATASETS"]["TRAIN_JSON"])
    # drop images without annotations, as detectron2 does with FILTER_EMPTY_ANNOTATIONS
    ds.ids = [i for i in ds.ids if len(ds.coco.getAnnIds(imgIds=i, iscrowd=False)) > 0]
    ds = wrap_dataset_for_transforms_v2(ds, target_keys=("boxes", "labels", "masks"))
    sampler = DistributedSampler(ds, num_replicas=get_world_size(), rank=get_rank(), shuffle=True, seed=cfg["SEED"])
    loader = DataLoader(ds, batch_size=cfg["SOLVER"]["IMS_PER_BATCH"] // get_world_size(), sampler=sampler,
                        num_workers=cfg["DATALOADER"]["NUM_WORKERS"], collate_fn=trivial_batch_collator,
                        pin_memory=True, drop_last=True)
    return loader, sampler


def to_device(images, targets, device):
    images = [F2.to_dtype(F2.to_image(im), torch.float32, scale=True).to(device, non_blocking=True) for im in images]
    out = []
    for t in targets:
        out.append({"boxes": t["boxes"].to(device), "labels": t["labels"].to(device),
                    "masks": t["masks"].to(device)})
    return images, out


def build_model(cfg):
    model = maskrcnn_resnet50_fpn_v2(weights=None, weights_backbone="IMAGENET1K_V1",
                                     num_classes=cfg["MODEL"]["NUM_CLASSES"])
    return model


def warmup_multistep(optimizer, it, cfg):
    base_lr = cfg["SOLVER"]["BASE_LR"]
    warm = cfg["SOLVER"]["WARMUP_ITERS"]
    factor = 1.0
    if it < warm:
        alpha = it / warm
        factor = cfg["SOLVER"]["WARMUP_FACTOR"] * (1 - alpha) + alpha
    for step in cfg["SOLVER"]["STEPS"]:
        if it >= step:
            factor *= cfg["SOLVER"]["GAMMA"]
    for g in optimizer.param_groups:
        g["lr"] = base_lr * factor


# ----------------------------------------------------------------------------- train
def do_train(cfg, model, resume=False):
    device = torch.device("cuda", torch.cuda.current_device())
    model_without_ddp = model.module if isinstance(model, DistributedDataParallel) else model
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=cfg["SOLVER"]["BASE_LR"], momentum=0.9,
                                weight_decay=cfg["SOLVER"]["WEIGHT_DECAY"])
    start_iter = 0
    ckpt_file = os.path.join(cfg["OUTPUT_DIR"], "last_checkpoint.pth")
    if resume and os.path.exists(ckpt_file):
        ckpt = torch.load(ckpt_file, map_location="cpu")
        model_without_ddp.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_iter = ckpt["iteration"] + 1
    max_iter = cfg["SOLVER"]["MAX_ITER"]
    loader, sampler = build_train_loader(cfg)
    scaler = torch.cuda.amp.GradScaler(enabled=cfg["SOLVER"]["AMP"])

    epoch, it = 0, start_iter
    logger.info("Starting training from iteration %d", start_iter)
    while it < max_iter:
        sampler.set_epoch(epoch)
        for images, targets in loader:
            if it >= max_iter:
                break
            t0 = time.perf_counter()
            images, targets = to_device(images, targets, device)
            warmup_multistep(optimizer, it, cfg)
            with torch.autocast("cuda", enabled=cfg["SOLVER"]["AMP"]):
                loss_dict = model(images, targets)
                losses = sum(loss_dict.values())
            optimizer.zero_grad()
            scaler.scale(losses).backward()
            scaler.step(optimizer)
            scaler.update()

            if it % 20 == 0 or it == max_iter - 1:
                keys = sorted(loss_dict.keys())
                vals = torch.stack([loss_dict[k].detach() for k in keys])
                if get_world_size() > 1:
                    dist.all_reduce(vals)
                    vals /= get_world_size()
                if is_main_process():
                    s = "  ".join(f"{k}: {v:.4f}" for k, v in zip(keys, vals.tolist()))
                    logger.info(f"iter: {it}  total_loss: {vals.sum():.4f}  {s}  "
                                f"lr: {optimizer.param_groups[0]['lr']:.6f}  time: {time.perf_counter() - t0:.3f}")
            if (it + 1) % cfg["SOLVER"]["CHECKPOINT_PERIOD"] == 0 or it == max_iter - 1:
                if is_main_process():
                    torch.save({"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                                "iteration": it}, ckpt_file)
                synchronize()
            it += 1
        epoch += 1


def setup(args):
    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    for k, v in zip(args.opts[0::2], args.opts[1::2]):
        cfg[k] = v
    os.makedirs(cfg["OUTPUT_DIR"], exist_ok=True)
    logging.basicConfig(level=logging.INFO if is_main_process() else logging.WARNING,
                        format="[%(asctime)s %(name)s]: %(message)s")
    return cfg


def main(args):
    cfg = setup(args)
    model = build_model(cfg)
    model.to(torch.device("cuda", torch.cuda.current_device()))
    logger.info("Model:\n%s", model)
    if get_world_size() > 1:
        model = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()], broadcast_buffers=False)
    do_train(cfg, model, resume=args.resume)


def default_argument_parser():
    parser = argparse.ArgumentParser(description="plain train net")
    parser.add_argument("--config", default="", metavar="FILE")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--num-gpus", type=int, default=1)
    parser.add_argument("--num-machines", type=int, default=1)
    parser.add_argument("--machine-rank", type=int, default=0)
    parser.add_argument("--dist-url", default="auto")
    parser.add_argument("opts", default=None, nargs=argparse.REMAINDER)
    return parser


args = default_argument_parser().parse_args()
print("Command Line Args:", args)
launch(
    main,
    args.num_gpus,
    num_machines=args.num_machines,
    machine_rank=args.machine_rank,
    dist_url=args.dist_url,
    args=(args,),
)
