import argparse
import importlib
import logging
import os
import sys
import time

import numpy as np
import torch
from easydict import EasyDict as edict
from torch import distributed
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter

from backbones import get_model
from dataset import MXFaceDataset
from losses import CombinedMarginLoss
from lr_scheduler import PolynomialLRWarmup
from partial_fc_v2 import PartialFC_V2
from utils.utils_callbacks import CallBackVerification
from utils.utils_distributed_sampler import DistributedSampler, get_dist_info, worker_init_fn
from utils.utils_logging import AverageMeter, init_logging

assert torch.__version__ >= "1.12.0", "In order to enjoy the features of the new torch, we have upgraded the torch to 1.12.0"

rank = int(os.environ["RANK"])
local_rank = int(os.environ["LOCAL_RANK"])
world_size = int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(local_rank)
distributed.init_process_group("nccl")


def default_config():
    cfg = edict()
    cfg.margin_list = (1.0, 0.5, 0.0)
    cfg.network = "r50"
    cfg.resume = False
    cfg.output = "work_dirs/ms1mv3_r50"
    cfg.embedding_size = 512
    cfg.sample_rate = 1.0
    cfg.fp16 = True
    cfg.momentum = 0.9
    cfg.weight_decay = 5e-4
    cfg.batch_size = 128
    cfg.lr = 0.1
    cfg.verbose = 2000
    cfg.frequent = 10
    cfg.seed = 2048
    cfg.num_workers = 2
    cfg.rec = "/train_tmp/ms1m-retinaface-t1"
    cfg.num_classes = 93431
    cfg.num_image = 5179510
    cfg.num_epoch = 20
    cfg.warmup_epoch = 0
    cfg.val_targets = ["lfw", "cfp_fp", "agedb_30"]
    return cfg


def get_config(config_file):
    cfg = default_config()
    if config_file:
        module = importlib.import_module("configs." + os.path.basename(config_file).replace(".py", ""))
        cfg.update(module.config)
    return cfg


def setup_seed(seed):
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)
    np.random.seed(seed)


def main(args):
    cfg = get_config(args.config)
    setup_seed(cfg.seed + rank)
    os.makedirs(cfg.output, exist_ok=True)
    init_logging(rank, cfg.output)

    summary_writer = SummaryWriter(log_dir=os.path.join(cfg.output, "tensorboard")) if rank == 0 else None

    train_set = MXFaceDataset(root_dir=cfg.rec, local_rank=local_rank)
    rank_, world_size_ = get_dist_info()
    train_sampler = DistributedSampler(train_set, num_replicas=world_size_, rank=rank_, shuffle=True, seed=cfg.seed)
    train_loader = DataLoader(
        dataset=train_set,
        batch_size=cfg.batch_size,
        sampler=train_sampler,
        num_workers=cfg.num_workers,
        pin_memory=True,
        drop_last=True,
        worker_init_fn=lambda worker_id: worker_init_fn(worker_id, cfg.num_workers, rank, cfg.seed),
    )

    backbone = get_model(cfg.network, dropout=0.0, fp16=cfg.fp16, num_features=cfg.embedding_size).cuda()
    backbone = torch.nn.parallel.DistributedDataParallel(
        module=backbone, broadcast_buffers=False, device_ids=[local_rank], bucket_cap_mb=16)
    backbone.register_comm_hook(None, fp16_compress_hook)
    backbone.train()

    margin_loss = CombinedMarginLoss(64, cfg.margin_list[0], cfg.margin_list[1], cfg.margin_list[2])
    module_partial_fc = PartialFC_V2(margin_loss, cfg.embedding_size, cfg.num_classes, cfg.sample_rate, False)
    module_partial_fc.train().cuda()
    opt = torch.optim.SGD(
        params=[{"params": backbone.parameters()}, {"params": module_partial_fc.parameters()}],
        lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)

    cfg.total_batch_size = cfg.batch_size * world_size
    cfg.warmup_step = cfg.num_image // cfg.total_batch_size * cfg.warmup_epoch
    cfg.total_step = cfg.num_image // cfg.total_batch_size * cfg.num_epoch
    lr_scheduler = PolynomialLRWarmup(optimizer=opt, warmup_iters=cfg.warmup_step, total_iters=cfg.total_step)

    start_epoch = 0
    global_step = 0
    if cfg.resume:
        backbone.module.load_state_dict(torch.load(os.path.join(cfg.output, "model.pt"), map_location="cpu"))
        state = torch.load(os.path.join(cfg.output, f"softmax_fc_gpu_{rank}.pt"), map_location="cpu")
        start_epoch = state["epoch"]
        global_step = state["global_step"]
        module_partial_fc.load_state_dict(state["state_dict_softmax_fc"])
        opt.load_state_dict(state["state_optimizer"])
        lr_scheduler.load_state_dict(state["state_lr_scheduler"])
        del state

    for key, value in cfg.items():
        num_space = 25 - len(key)
        logging.info(": " + key + " " * num_space + str(value))

    callback_verification = CallBackVerification(
        val_targets=cfg.val_targets, rec_prefix=cfg.rec, summary_writer=summary_writer)

    loss_am = AverageMeter()
    amp = torch.cuda.amp.grad_scaler.GradScaler(growth_interval=100)
    tic = time.time()

    for epoch in range(start_epoch, cfg.num_epoch):
        train_sampler.set_epoch(epoch)
        for _, (img, local_labels) in enumerate(train_loader):
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
                if rank == 0 and global_step % cfg.frequent == 0:
                    speed = cfg.frequent * cfg.total_batch_size / (time.time() - tic)
                    tic = time.time()
                    lr = lr_scheduler.get_last_lr()[0]
                    logging.info(
                        "Speed %.2f samples/sec   Loss %.4f   LearningRate %.6f   Epoch: %d   Global Step: %d   "
                        "Fp16 Grad Scale: %2.f", speed, loss_am.avg, lr, epoch, global_step, amp.get_scale())
                    summary_writer.add_scalar("loss", loss_am.avg, global_step)
                    summary_writer.add_scalar("learning_rate", lr, global_step)
                    loss_am.reset()
                if global_step % cfg.verbose == 0:
                    callback_verification(global_step, backbone)

        save_checkpoint(cfg, epoch, global_step, backbone, module_partial_fc, opt, lr_scheduler)

    if rank == 0:
        summary_writer.close()
    distributed.destroy_process_group()


def save_checkpoint(cfg, epoch, global_step, backbone, module_partial_fc, opt, lr_scheduler):
    # the softmax weights and their momentum are different on every GPU
    torch.save({
        "epoch": epoch + 1,
        "global_step": global_step,
        "state_dict_softmax_fc": module_partial_fc.state_dict(),
        "state_optimizer": opt.state_dict(),
        "state_lr_scheduler": lr_scheduler.state_dict(),
    }, os.path.join(cfg.output, f"softmax_fc_gpu_{rank}.pt"))
    torch.save(backbone.module.state_dict(), os.path.join(cfg.output, "model.pt"))
    distributed.barrier()


if __name__ == "__main__":
    torch.backends.cudnn.benchmark = True
    parser = argparse.ArgumentParser(description="Distributed Arcface Training in Pytorch")
    parser.add_argument("config", type=str, nargs="?", default="", help="py config file")
    main(parser.parse_args())
