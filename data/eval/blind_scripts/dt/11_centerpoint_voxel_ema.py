"""CenterPoint-Voxel 0.1 with GT-sampling, CBGS, and an EMA copy of the weights.

Fine-tunes from the public CenterPoint checkpoint (saved by the original repo
from its DDP wrapper, so its keys may start with "module.").

    torchrun --nproc_per_node=8 train_cp_ema.py --config configs/cp_voxel01_ema.py \
        --load-from pretrained/centerpoint_01voxel_second_secfpn_circlenms_4x8_cyclic_20e_nus.pth
"""
import argparse
import copy
import importlib.util
import logging
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from av3d.datasets import NuScenesLidarDataset, collate_sparse_points, CBGSWrapper
from av3d.datasets.transforms import build_train_pipeline, build_test_pipeline
from av3d.models import CenterPointVoxel
from av3d.eval import nuscenes_evaluate

logger = logging.getLogger("cp_ema")


def load_py_config(path):
    spec = importlib.util.spec_from_file_location("cfg", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return {k: getattr(mod, k) for k in dir(mod) if not k.startswith("_")}


class ModelEMA:
    def __init__(self, model, decay=0.9998, tau=2000):
        self.ema = copy.deepcopy(model).eval()
        for p in self.ema.parameters():
            p.requires_grad_(False)
        self.decay_fn = lambda n: decay * (1 - math.exp(-n / tau))
        self.updates = 0

    @torch.no_grad()
    def update(self, model):
        self.updates += 1
        d = self.decay_fn(self.updates)
        msd = model.state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v.mul_(d).add_(msd[k].detach(), alpha=1 - d)
            else:
                v.copy_(msd[k])


def strip_prefix(state_dict, prefix="module."):
    return {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in state_dict.items()}


@torch.no_grad()
def evaluate(net, loader, cfg, tag):
    """net is the plain module (EMA copy or model.module); each rank runs its shard."""
    net.eval()
    dets = {}
    for batch in loader:
        points = [p.cuda(non_blocking=True) for p in batch["points"]]
        for token, det in zip(batch["tokens"], net.predict(net(points))):
            dets[token] = {k: v.cpu() for k, v in det.items()}
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, dets)
    if dist.get_rank() == 0:
        merged = {}
        for s in shards:
            merged.update(s)
        assert len(merged) == len(loader.dataset), (len(merged), len(loader.dataset))
        m = nuscenes_evaluate(merged, cfg["class_names"], cfg["data_root"], os.path.join(cfg["work_dir"], tag))
        logger.info("[%s] mAP %.4f NDS %.4f", tag, m["mAP"], m["NDS"])
        return m
    return None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--load-from", default=None)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    cfg = load_py_config(args.config)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.backends.cudnn.benchmark = True
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s",
                        level=logging.INFO if rank == 0 else logging.ERROR)
    if rank == 0:
        os.makedirs(cfg["work_dir"], exist_ok=True)
        logger.addHandler(logging.FileHandler(os.path.join(cfg["work_dir"], "train.log")))

    train_set = NuScenesLidarDataset(cfg["data_root"], cfg["train_info"], cfg["class_names"],
                                     pipeline=build_train_pipeline(cfg), test_mode=False)
    train_set = CBGSWrapper(train_set, seed=cfg["seed"])  # same seed on every rank -> same resampled index
    val_set = NuScenesLidarDataset(cfg["data_root"], cfg["val_info"], cfg["class_names"],
                                   pipeline=build_test_pipeline(cfg), test_mode=True)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=cfg["seed"], drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=cfg["samples_per_gpu"], sampler=train_sampler,
                              num_workers=cfg["workers_per_gpu"], collate_fn=collate_sparse_points,
                              pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=cfg["samples_per_gpu"], sampler=val_sampler,
                            num_workers=cfg["workers_per_gpu"], collate_fn=collate_sparse_points)

    model = CenterPointVoxel(**cfg["model"])
    if args.load_from:
        sd = torch.load(args.load_from, map_location="cpu")
        sd = strip_prefix(sd.get("state_dict", sd))
        missing, unexpected = model.load_state_dict(sd, strict=False)
        logger.info("loaded %s (missing %d, unexpected %d)", args.load_from, len(missing), len(unexpected))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    ema = ModelEMA(model)
    # SyncBN keeps the running stats identical on every rank, no need to re-broadcast them each step
    model = DDP(model, device_ids=[local_rank], broadcast_buffers=False)

    total_bs = cfg["samples_per_gpu"] * world_size
    lr = cfg["base_lr"] * total_bs / cfg["base_batch_size"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.01)
    total_steps = cfg["epochs"] * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=total_steps,
                                                    pct_start=0.4, div_factor=10, final_div_factor=1e4)
    logger.info("world %d, total batch %d, lr %.2e, %d it/epoch", world_size, total_bs, lr, len(train_loader))

    start_epoch = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        ema.ema.load_state_dict(ck["ema"])
        ema.updates = ck["ema_updates"]
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        start_epoch = ck["epoch"] + 1

    for epoch in range(start_epoch, cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for it, batch in enumerate(train_loader):
            points = [p.cuda(non_blocking=True) for p in batch["points"]]
            gt_boxes = [b.cuda(non_blocking=True) for b in batch["gt_boxes"]]
            gt_labels = [l.cuda(non_blocking=True) for l in batch["gt_labels"]]
            preds = model(points)
            # frames whose objects were all range-filtered give an all-negative heatmap, num_pos is clamped inside
            losses = model.module.loss(preds, gt_boxes, gt_labels)
            loss = sum(losses.values())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), 35.0)
            optimizer.step()
            scheduler.step()
            ema.update(model.module)
            if rank == 0 and it % 50 == 0:
                logger.info("ep %d [%d/%d] loss %.4f gnorm %.2f lr %.2e %.2fs/it", epoch, it, len(train_loader),
                            loss.item(), grad_norm.item(), scheduler.get_last_lr()[0], (time.time() - tic) / (it + 1))

        if rank == 0:
            torch.save({"model": model.module.state_dict(), "ema": ema.ema.state_dict(), "ema_updates": ema.updates,
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(cfg["work_dir"], "latest.pth"))
        dist.barrier()
        if (epoch + 1) % cfg["eval_interval"] == 0 or epoch + 1 == cfg["epochs"]:
            evaluate(ema.ema, val_loader, cfg, f"ema_ep{epoch + 1}")

    if rank == 0:
        torch.save(ema.ema.state_dict(), os.path.join(cfg["work_dir"], "final_ema.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
