"""ArcFace + Partial FC on a crawled set, dropping low-quality crops (SER-FIQ scores precomputed in the list).

List format: <relative path> <label> <quality>
    torchrun --nproc_per_node=8 train_quality_filtered.py --list /data/crawl/train_q.lst --min-quality 0.35
"""
import argparse
import logging
import os
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

logger = logging.getLogger("qf")


class ShardedQualityList(Dataset):
    """Every rank parses only its own slice of the (very large) list file."""

    def __init__(self, root, list_file, rank, world_size, min_quality):
        self.root = root
        self.samples = []
        with open(list_file) as f:
            for i, line in enumerate(f):
                if i % world_size != rank:
                    continue
                path, label, quality = line.split()
                if float(quality) < min_quality:
                    continue
                self.samples.append((path, int(label)))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        path, label = self.samples[idx]
        img = cv2.imread(os.path.join(self.root, path))
        img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        if np.random.rand() < 0.5:
            img = cv2.flip(img, 1)
        img = torch.from_numpy(img.transpose(2, 0, 1).copy()).float()
        return (img - 127.5) / 127.5, label


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/crawl/aligned")
    ap.add_argument("--list", required=True)
    ap.add_argument("--num-classes", type=int, default=611000)
    ap.add_argument("--min-quality", type=float, default=0.35)
    ap.add_argument("--network", default="r100")
    ap.add_argument("--sample-rate", type=float, default=0.3)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--warmup-epochs", type=int, default=1)
    ap.add_argument("--val-prefix", default="/data/val_bins")
    ap.add_argument("--output", default="work_dirs/crawl_r100_qf")
    return ap.parse_args()


def worker_init(worker_id):
    seed = torch.initial_seed() % 2 ** 32
    np.random.seed(seed)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    os.makedirs(args.output, exist_ok=True)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    writer = SummaryWriter(os.path.join(args.output, "tb")) if rank == 0 else None

    dataset = ShardedQualityList(args.root, args.list, rank, world_size, args.min_quality)
    generator = torch.Generator()
    generator.manual_seed(1000 + rank)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=6, pin_memory=True,
                        drop_last=True, worker_init_fn=worker_init, generator=generator, persistent_workers=True)
    logger.info("rank 0 keeps %d images after quality filtering", len(dataset))

    backbone = get_model(args.network, dropout=0.0, fp16=True, num_features=512).to(device)
    backbone = DDP(backbone, device_ids=[local_rank], broadcast_buffers=False, bucket_cap_mb=16)
    pfc = PartialFC_V2(CombinedMarginLoss(64, 1.0, 0.5, 0.0), 512, args.num_classes, args.sample_rate, True)
    pfc.train().to(device)

    total_batch = args.batch_size * world_size
    opt = torch.optim.SGD([{"params": backbone.parameters()}, {"params": pfc.parameters()}],
                          lr=args.lr * total_batch / 1024, momentum=0.9, weight_decay=5e-4)
    steps_per_epoch = len(loader)
    warmup, total = steps_per_epoch * args.warmup_epochs, steps_per_epoch * args.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: (i + 1) / warmup if i < warmup else max(0.0, 1 - (i - warmup) / (total - warmup)) ** 2)
    scaler = torch.cuda.amp.GradScaler(growth_interval=100)
    verifier = CallBackVerification(val_targets=["lfw", "cfp_fp", "agedb_30", "ijbc_pairs"],
                                    rec_prefix=args.val_prefix, summary_writer=writer)

    step = 0
    for epoch in range(args.epochs):
        tic = time.time()
        for img, label in loader:
            img = img.to(device, non_blocking=True)
            label = label.to(device, non_blocking=True)
            loss = pfc(backbone(img), label)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(backbone.parameters(), 5)
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                logger.info("epoch %d step %d loss %.4f lr %.5f %.0f img/s", epoch, step, loss.item(),
                            sched.get_last_lr()[0], 100 * total_batch / (time.time() - tic))
                writer.add_scalar("loss", loss.item(), step)
                tic = time.time()
            if step % 3000 == 0:
                verifier(step, backbone)

        torch.save(pfc.state_dict(), os.path.join(args.output, f"softmax_fc_gpu_{rank}.pt"))
        if rank == 0:
            torch.save(backbone.module.state_dict(), os.path.join(args.output, "model.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
