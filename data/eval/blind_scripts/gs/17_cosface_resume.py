"""CosFace IR-SE50 on MS1MV2, sharded classifier, preemptible queue (resumes from the last checkpoint).

    torchrun --nproc_per_node=8 train_cosface_resumable.py --output /mnt/shared/face/cosface_irse50 --resume auto
"""
import argparse
import glob
import logging
import os
import re
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from backbones import get_model
from dataset import MXFaceDataset
from partial_fc_v2 import AllGather, DistCrossEntropy
from utils.utils_callbacks import CallBackVerification

log = logging.getLogger("cosface")


class CosFaceShard(nn.Module):
    def __init__(self, num_classes, embedding_size=512, s=64.0, m=0.35):
        super().__init__()
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.embedding_size = embedding_size
        self.s, self.m = s, m
        self.num_local = num_classes // self.world_size + int(self.rank < num_classes % self.world_size)
        self.class_start = num_classes // self.world_size * self.rank + min(self.rank, num_classes % self.world_size)
        self.weight = nn.Parameter(torch.normal(0, 0.01, (self.num_local, embedding_size)))
        self.cross_entropy = DistCrossEntropy()

    def forward(self, x, y):
        bs = x.size(0)
        xs = [torch.zeros(bs, self.embedding_size, device=x.device) for _ in range(self.world_size)]
        ys = [torch.zeros(bs, dtype=torch.long, device=x.device) for _ in range(self.world_size)]
        x = torch.cat(AllGather(x, *xs))
        dist.all_gather(ys, y)
        y = torch.cat(ys).view(-1, 1)
        mine = (y >= self.class_start) & (y < self.class_start + self.num_local)
        y[~mine] = -1
        y[mine] -= self.class_start
        cos = F.linear(F.normalize(x), F.normalize(self.weight)).clamp(-1, 1)
        rows = torch.where(y != -1)[0]
        cos[rows, y[rows].view(-1)] -= self.m
        return self.cross_entropy(cos * self.s, y)


def latest_checkpoint(output):
    files = glob.glob(os.path.join(output, "ckpt_ep*.pt"))
    if not files:
        return None
    return max(files, key=lambda f: int(re.search(r"ckpt_ep(\d+)\.pt", f).group(1)))


def save_checkpoint(output, epoch, global_step, backbone, head, opt, sched, scaler, rank):
    torch.save({"head": head.state_dict(), "opt": opt.state_dict()},
               os.path.join(output, f"ckpt_ep{epoch}_rank{rank}.part"))
    if rank == 0:
        torch.save({
            "epoch": epoch,
            "global_step": global_step,
            "backbone": backbone.state_dict(),
            "sched": sched.state_dict(),
            "scaler": scaler.state_dict(),
        }, os.path.join(output, f"ckpt_ep{epoch}.pt"))
    dist.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rec", default="/train_tmp/faces_emore")
    ap.add_argument("--output", default="/mnt/shared/face/cosface_irse50")
    ap.add_argument("--network", default="r50")
    ap.add_argument("--num-classes", type=int, default=85742)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=24)
    ap.add_argument("--milestones", type=int, nargs="+", default=[10, 18, 22])
    ap.add_argument("--resume", default="", help="'auto', a path, or empty")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    os.makedirs(args.output, exist_ok=True)

    dataset = MXFaceDataset(root_dir=args.rec, local_rank=local_rank)
    sampler = DistributedSampler(dataset, shuffle=True, seed=7)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    backbone = get_model(args.network, dropout=0.0, fp16=True, num_features=512).to(device)
    head = CosFaceShard(args.num_classes).to(device)

    ckpt_path = latest_checkpoint(args.output) if args.resume == "auto" else args.resume
    ckpt = None
    if ckpt_path:
        ckpt = torch.load(ckpt_path, map_location="cpu")
        backbone.load_state_dict(ckpt["backbone"])
        log.info("resumed backbone from %s", ckpt_path)

    backbone = DistributedDataParallel(backbone, device_ids=[local_rank], broadcast_buffers=False)
    opt = torch.optim.SGD([{"params": backbone.parameters()}, {"params": head.parameters()}],
                          lr=args.lr * args.batch_size * world_size / 1024, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [m * len(loader) for m in args.milestones], gamma=0.1)
    scaler = torch.cuda.amp.GradScaler(growth_interval=100)

    start_epoch, global_step = 0, 0
    if ckpt is not None:
        part = torch.load(ckpt_path.replace(".pt", f"_rank{rank}.part"), map_location=device)
        head.load_state_dict(part["head"])
        opt.load_state_dict(part["opt"])
        sched.load_state_dict(ckpt["sched"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, global_step = ckpt["epoch"] + 1, ckpt["global_step"]
        del part, ckpt

    verifier = CallBackVerification(val_targets=["lfw", "cfp_fp", "agedb_30"], rec_prefix=args.rec)

    tic = time.time()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for img, label in loader:
            img = img.to(device, non_blocking=True)
            label = label.to(device, non_blocking=True)
            loss = head(backbone(img), label)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(backbone.parameters(), 5)
            scaler.step(opt)
            scaler.update()
            sched.step()
            global_step += 1
            if rank == 0 and global_step % 100 == 0:
                log.info("epoch %d step %d loss %.4f lr %.5f %.0f img/s", epoch, global_step, loss.item(),
                         sched.get_last_lr()[0], 100 * args.batch_size * world_size / (time.time() - tic))
                tic = time.time()
            if global_step % 2000 == 0:
                verifier(global_step, backbone)

        save_checkpoint(args.output, epoch, global_step, backbone, head, opt, sched, scaler, rank)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
