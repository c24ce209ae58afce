"""CosFace R50 on Glint360K with Partial FC, tracked in Weights & Biases.

    torchrun --nproc_per_node=8 train_cosface_wandb.py configs/glint360k_cosface_r50.py
"""
import argparse
import importlib
import logging
import os
import time
from datetime import datetime

import numpy as np
import torch
import wandb
from easydict import EasyDict as edict
from torch import distributed
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from backbones import get_model
from dataset import MXFaceDataset
from losses import CombinedMarginLoss
from lr_scheduler import PolynomialLRWarmup
from partial_fc_v2 import PartialFC_V2
from utils.utils_callbacks import CallBackVerification
from utils.utils_logging import AverageMeter, init_logging


def load_config(path):
    cfg = edict(
        network="r50", embedding_size=512, margin_list=(1.0, 0.0, 0.4), sample_rate=1.0,
        fp16=True, momentum=0.9, weight_decay=1e-4, batch_size=128, lr=0.1,
        rec="/train_tmp/glint360k", num_classes=360232, num_image=17091657,
        num_epoch=20, warmup_epoch=0, num_workers=4, frequent=10, verbose=2000,
        val_targets=["lfw", "cfp_fp", "agedb_30"], output=None, seed=2048,
        wandb_entity="face-team", wandb_project="glint360k-cosface", save_artifacts=False,
    )
    if path:
        name = os.path.splitext(os.path.basename(path))[0]
        cfg.update(importlib.import_module(f"configs.{name}").config)
    if cfg.output is None:
        cfg.output = os.path.join("work_dirs", os.path.splitext(os.path.basename(path or "default"))[0])
    return cfg


def main(args):
    cfg = load_config(args.config)

    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    distributed.init_process_group("nccl")

    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    os.makedirs(cfg.output, exist_ok=True)
    init_logging(rank, cfg.output)

    run_name = datetime.now().strftime("%y%m%d_%H%M") + f"_{cfg.network}_cosface"
    wandb.login(key=os.environ.get("WANDB_API_KEY"))
    run = wandb.init(
        entity=cfg.wandb_entity,
        project=cfg.wandb_project,
        name=run_name,
        notes="glint360k cosface m=0.4, partial fc",
        config=dict(cfg),
    )

    train_set = MXFaceDataset(root_dir=cfg.rec, local_rank=local_rank)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler,
                              num_workers=cfg.num_workers, pin_memory=True, drop_last=True)

    backbone = get_model(cfg.network, dropout=0.0, fp16=cfg.fp16, num_features=cfg.embedding_size).cuda()
    backbone = torch.nn.parallel.DistributedDataParallel(
        module=backbone, broadcast_buffers=False, device_ids=[local_rank], bucket_cap_mb=16)
    backbone.train()

    margin_loss = CombinedMarginLoss(64, cfg.margin_list[0], cfg.margin_list[1], cfg.margin_list[2])
    module_partial_fc = PartialFC_V2(margin_loss, cfg.embedding_size, cfg.num_classes, cfg.sample_rate, cfg.fp16)
    module_partial_fc.train().cuda()

    opt = torch.optim.SGD(
        params=[{"params": backbone.parameters()}, {"params": module_partial_fc.parameters()}],
        lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    cfg.total_batch_size = cfg.batch_size * world_size
    cfg.warmup_step = cfg.num_image // cfg.total_batch_size * cfg.warmup_epoch
    cfg.total_step = cfg.num_image // cfg.total_batch_size * cfg.num_epoch
    lr_scheduler = PolynomialLRWarmup(optimizer=opt, warmup_iters=cfg.warmup_step, total_iters=cfg.total_step)

    callback_verification = CallBackVerification(
        val_targets=cfg.val_targets, rec_prefix=cfg.rec, summary_writer=None, wandb_logger=run if rank == 0 else None)

    loss_am = AverageMeter()
    amp = torch.cuda.amp.grad_scaler.GradScaler(growth_interval=100)
    global_step = 0
    tic = time.time()

    for epoch in range(cfg.num_epoch):
        sampler.set_epoch(epoch)
        for img, local_labels in train_loader:
            global_step += 1
            img = img.cuda(non_blocking=True)
            local_labels = local_labels.cuda(non_blocking=True)
            local_embeddings = backbone(img)
            loss = module_partial_fc(local_embeddings, local_labels)

            if cfg.fp16:
                amp.scale(loss).backward()
                amp.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(backbone.parameters(), 5)
                amp.step(opt)
                amp.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(backbone.parameters(), 5)
                opt.step()
            opt.zero_grad()
            lr_scheduler.step()

            with torch.no_grad():
                loss_am.update(loss.item(), 1)
                if global_step % cfg.frequent == 0 and rank == 0:
                    speed = cfg.frequent * cfg.total_batch_size / (time.time() - tic)
                    tic = time.time()
                    lr = lr_scheduler.get_last_lr()[0]
                    run.log({
                        "Loss/Step Loss": loss.item(),
                        "Loss/Train Loss": loss_am.avg,
                        "Process/Step": global_step,
                        "Process/Epoch": epoch,
                        "Speed": speed,
                        "LR": lr,
                    })
                    logging.info("Speed %.2f samples/sec Loss %.4f LR %.6f Epoch %d Step %d/%d",
                                 speed, loss_am.avg, lr, epoch, global_step, cfg.total_step)
                    loss_am.reset()
                if global_step % cfg.verbose == 0:
                    callback_verification(global_step, backbone)

        torch.save(module_partial_fc.state_dict(), os.path.join(cfg.output, f"softmax_fc_gpu_{rank}.pt"))
        if rank == 0:
            path_module = os.path.join(cfg.output, "model.pt")
            torch.save(backbone.module.state_dict(), path_module)
            if cfg.save_artifacts:
                artifact = wandb.Artifact(f"{run_name}_E{epoch}", type="model")
                artifact.add_file(path_module)
                run.log_artifact(artifact)
        distributed.barrier()

    if rank == 0:
        run.finish()
    distributed.destroy_process_group()


if __name__ == "__main__":
    torch.backends.cudnn.benchmark = True
    parser = argparse.ArgumentParser(description="CosFace training with wandb")
    parser.add_argument("config", type=str, nargs="?", default="")
    main(parser.parse_args())
