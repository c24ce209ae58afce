# ArcFace on an image-list dataset ("relative/path.jpg<TAB>label" per line), Partial FC head.
# torchrun --nproc_per_node=8 train_imagelist.py --list /data/faces/train.lst --root /data/faces/imgs
import argparse
import logging
import os
import random
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.tensorboard import SummaryWriter

from backbones import get_model
from losses import CombinedMarginLoss
from partial_fc_v2 import PartialFC_V2
from utils.utils_callbacks import CallBackVerification
from utils.utils_logging import AverageMeter


class ImageListDataset(Dataset):
    def __init__(self, root, list_file, train=True):
        self.root = root
        self.train = train
        self.items = []
        with open(list_file) as f:
            for line in f:
                path, label = line.rstrip("\n").split("\t")
                self.items.append((path, int(label)))
        self.num_classes = max(label for _, label in self.items) + 1

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        path, label = self.items[index]
        img = cv2.imread(os.path.join(self.root, path), cv2.IMREAD_COLOR)
        img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        if img.shape[0] != 112 or img.shape[1] != 112:
            img = cv2.resize(img, (112, 112))
        if self.train and random.random() < 0.5:
            img = img[:, ::-1]
        img = torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1))).float()
        img = img.div_(255).sub_(0.5).div_(0.5)
        return img, label


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--list", required=True)
    p.add_argument("--val-root", default="/data/faces/val_bins")
    p.add_argument("--network", default="r50")
    p.add_argument("--embedding-size", type=int, default=512)
    p.add_argument("--margin", type=float, nargs=3, default=(1.0, 0.5, 0.0))
    p.add_argument("--sample-rate", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--warmup-epochs", type=int, default=1)
    p.add_argument("--num-workers", type=int, default=8)
    p.add_argument("--output", default="work_dirs/imagelist_r50")
    p.add_argument("--seed", type=int, default=2048)
    p.add_argument("--fp16", action="store_true")
    return p.parse_args()


def main():
    args = parse_args()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")

    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    os.makedirs(args.output, exist_ok=True)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank {rank}] %(message)s")
    writer = SummaryWriter(os.path.join(args.output, "tensorboard")) if rank == 0 else None

    train_set = ImageListDataset(args.root, args.list, train=True)
    train_loader = DataLoader(
        train_set,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.num_workers,
        pin_memory=True,
        drop_last=True,
        persistent_workers=True,
    )
    logging.info("images: %d, identities: %d", len(train_set), train_set.num_classes)

    backbone = get_model(args.network, dropout=0.0, fp16=args.fp16, num_features=args.embedding_size).cuda()
    backbone = DDP(backbone, device_ids=[local_rank], broadcast_buffers=False, bucket_cap_mb=16)
    backbone.train()

    margin_loss = CombinedMarginLoss(64, *args.margin)
    partial_fc = PartialFC_V2(margin_loss, args.embedding_size, train_set.num_classes, args.sample_rate, args.fp16)
    partial_fc.train().cuda()

    optimizer = torch.optim.SGD(
        [{"params": backbone.parameters()}, {"params": partial_fc.parameters()}],
        lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)
    steps_per_epoch = len(train_loader)
    total_steps = steps_per_epoch * args.epochs
    warmup_steps = steps_per_epoch * args.warmup_epochs

    def lr_factor(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return (1.0 - (step - warmup_steps) / (total_steps - warmup_steps)) ** 2

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    scaler = torch.cuda.amp.GradScaler(growth_interval=100, enabled=args.fp16)

    verification = CallBackVerification(val_targets=["lfw", "cfp_fp", "agedb_30"], rec_prefix=args.val_root,
                                        summary_writer=writer)
    loss_meter = AverageMeter()
    global_step = 0
    start = time.time()

    for epoch in range(args.epochs):
        for img, label in train_loader:
            img = img.cuda(non_blocking=True)
            label = label.cuda(non_blocking=True)
            embeddings = backbone(img)
            loss = partial_fc(embeddings, label)

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(backbone.parameters(), 5)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            global_step += 1
            loss_meter.update(loss.item(), 1)

            if rank == 0 and global_step % 100 == 0:
                elapsed = time.time() - start
                eta_h = elapsed / global_step * (total_steps - global_step) / 3600
                logging.info("epoch %d step %d/%d loss %.4f lr %.5f eta %.1fh", epoch, global_step, total_steps,
                             loss_meter.avg, scheduler.get_last_lr()[0], eta_h)
                writer.add_scalar("loss", loss_meter.avg, global_step)
                writer.add_scalar("lr", scheduler.get_last_lr()[0], global_step)
                loss_meter.reset()

            if global_step % 2000 == 0:
                verification(global_step, backbone)

        torch.save({"epoch": epoch + 1, "partial_fc": partial_fc.state_dict(),
                    "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                   os.path.join(args.output, f"checkpoint_gpu_{rank}.pt"))
        if rank == 0:
            torch.save(backbone.module.state_dict(), os.path.join(args.output, "model.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
