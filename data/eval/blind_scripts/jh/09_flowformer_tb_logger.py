"""FlowFormer-style training on FlyingChairs -> Things with a RAFT-style Logger.

    torchrun --nproc_per_node=8 09_flowformer_tb_logger.py --stage chairs --name ff-chairs
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from configs import get_cfg  # yacs-style config per stage
from core.FlowFormer import build_flowformer
from core import datasets
from core.loss import sequence_loss
from core.utils.misc import process_cfg

SUM_FREQ = 100


class Logger:
    def __init__(self, scheduler, log_dir):
        self.scheduler = scheduler
        self.total_steps = 0
        self.running_loss = {}
        self.writer = SummaryWriter(log_dir=log_dir)

    def _print_training_status(self):
        metrics_data = [self.running_loss[k] / SUM_FREQ for k in sorted(self.running_loss.keys())]
        training_str = "[{:6d}, {:10.7f}] ".format(self.total_steps + 1, self.scheduler.get_last_lr()[0])
        metrics_str = ("{:10.4f}, " * len(metrics_data)).format(*metrics_data)
        print(training_str + metrics_str, flush=True)
        for k in self.running_loss:
            self.writer.add_scalar(k, self.running_loss[k] / SUM_FREQ, self.total_steps)
            self.running_loss[k] = 0.0

    def push(self, metrics):
        self.total_steps += 1
        for key in metrics:
            self.running_loss[key] = self.running_loss.get(key, 0.0) + metrics[key]
        if self.total_steps % SUM_FREQ == SUM_FREQ - 1:
            self._print_training_status()
            self.running_loss = {}

    def write_dict(self, results):
        for key in results:
            self.writer.add_scalar(key, results[key], self.total_steps)

    def close(self):
        self.writer.close()


def fetch_dataset(cfg):
    if cfg.stage == "chairs":
        aug = {"crop_size": cfg.image_size, "min_scale": -0.1, "max_scale": 1.0, "do_flip": True}
        return datasets.FlyingChairs(aug, split="training")
    aug = {"crop_size": cfg.image_size, "min_scale": -0.4, "max_scale": 0.8, "do_flip": True}
    clean = datasets.FlyingThings3D(aug, dstype="frames_cleanpass")
    final = datasets.FlyingThings3D(aug, dstype="frames_finalpass")
    return clean + final


@torch.no_grad()
def validate_chairs(net, device):
    net.eval()
    val_dataset = datasets.FlyingChairs(split="validation")
    epe_sum = torch.zeros((), dtype=torch.float64, device=device)
    n_pix = 0
    for idx in range(len(val_dataset)):
        img1, img2, flow_gt, _ = val_dataset[idx]
        flow_pre, _ = net(img1[None].to(device), img2[None].to(device))
        epe = torch.sum((flow_pre[0] - flow_gt.to(device)) ** 2, dim=0).sqrt()
        epe_sum += epe.sum().double()
        n_pix += epe.numel()
    net.train()
    return {"chairs_epe": (epe_sum / n_pix).item()}


def train(cfg):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed + rank)

    model = build_flowformer(cfg).to(device)
    if cfg.restore_ckpt is not None:
        state = torch.load(cfg.restore_ckpt, map_location="cpu")
        model.load_state_dict({k.replace("module.", "", 1): v for k, v in state.items()}, strict=True)
    model = DDP(model, device_ids=[local_rank])
    if rank == 0:
        print(f"Parameter Count: {sum(p.numel() for p in model.parameters() if p.requires_grad)}")

    train_dataset = fetch_dataset(cfg)
    sampler = DistributedSampler(train_dataset, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_dataset, batch_size=cfg.batch_size, sampler=sampler,
                              pin_memory=True, num_workers=cfg.num_workers, drop_last=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.canonical_lr,
                                  weight_decay=cfg.trainer.adamw_decay, eps=cfg.trainer.epsilon)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, cfg.trainer.canonical_lr, cfg.trainer.num_steps + 100,
        pct_start=0.05, cycle_momentum=False, anneal_strategy=cfg.trainer.anneal_strategy)
    scaler = torch.cuda.amp.GradScaler(enabled=cfg.mixed_precision)

    logger = Logger(scheduler, log_dir=os.path.join("runs", cfg.name))

    total_steps = 0
    epoch = 0
    model.train()
    if cfg.stage != "chairs":
        model.module.freeze_bn()
    t0 = time.time()
    while total_steps <= cfg.trainer.num_steps:
        sampler.set_epoch(epoch)
        for data_blob in train_loader:
            image1, image2, flow, valid = [x.to(device, non_blocking=True) for x in data_blob]
            if cfg.add_noise:
                stdv = np.random.uniform(0.0, 5.0)
                image1 = (image1 + stdv * torch.randn(*image1.shape, device=device)).clamp(0.0, 255.0)
                image2 = (image2 + stdv * torch.randn(*image2.shape, device=device)).clamp(0.0, 255.0)

            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast(enabled=cfg.mixed_precision):
                flow_predictions = model(image1, image2)
            loss, metrics = sequence_loss(flow_predictions, flow, valid, cfg)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.clip)
            scaler.step(optimizer)
            scheduler.step()
            scaler.update()

            metrics.update({"time/step": time.time() - t0})
            logger.push(metrics)
            t0 = time.time()

            if total_steps % cfg.val_freq == cfg.val_freq - 1:
                if rank == 0:
                    ckpt_path = f"checkpoints/{total_steps + 1}_{cfg.name}.pth"
                    os.makedirs("checkpoints", exist_ok=True)
                    torch.save(model.module.state_dict(), ckpt_path)
                    results = {}
                    for val_dataset in cfg.validation:
                        if val_dataset == "chairs":
                            results.update(validate_chairs(model.module, device))
                    logger.write_dict(results)
                    model.train()
                    if cfg.stage != "chairs":
                        model.module.freeze_bn()
                dist.barrier()

            total_steps += 1
            if total_steps > cfg.trainer.num_steps:
                break
        epoch += 1

    logger.close()
    if rank == 0:
        torch.save(model.module.state_dict(), f"checkpoints/{cfg.name}.pth")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", default="flowformer", help="name your experiment")
    parser.add_argument("--stage", default="chairs", help="determines which dataset to use for training")
    parser.add_argument("--validation", type=str, nargs="+", default=["chairs"])
    parser.add_argument("--restore_ckpt", default=None)
    parser.add_argument("--mixed_precision", action="store_true")
    parser.add_argument("--add_noise", action="store_true")
    args = parser.parse_args()

    cfg = get_cfg(args.stage)
    cfg.update(vars(args))
    process_cfg(cfg)
    train(cfg)
