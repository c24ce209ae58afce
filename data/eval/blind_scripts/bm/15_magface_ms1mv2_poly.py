"""MagFace (magnitude-aware margin) on MS1MV2, IResNet-100, polynomial LR with warmup.

    torchrun --nproc_per_node=8 15_magface_ms1mv2_poly.py --rec /data/faces_emore --batch-size 128
"""
import argparse
import logging
import math
import numbers
import os
import time

import mxnet as mx
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms

from backbones import get_model
from eval import verification


def get_args():
    ap = argparse.ArgumentParser(description="MagFace training")
    ap.add_argument("--rec", default="/data/faces_emore")
    ap.add_argument("--num-classes", type=int, default=85742)
    ap.add_argument("--num-image", type=int, default=5822653)
    ap.add_argument("--network", default="r100")
    ap.add_argument("--batch-size", type=int, default=128, help="images per GPU")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--warmup-epochs", type=int, default=1)
    ap.add_argument("--l-a", type=float, default=10.0)
    ap.add_argument("--u-a", type=float, default=110.0)
    ap.add_argument("--l-margin", type=float, default=0.45)
    ap.add_argument("--u-margin", type=float, default=0.8)
    ap.add_argument("--lambda-g", type=float, default=35.0)
    ap.add_argument("--output", default="work_dirs/magface_r100")
    ap.add_argument("--verbose", type=int, default=2000)
    return ap.parse_args()


class MXFaceDataset(Dataset):
    def __init__(self, root_dir):
        self.transform = transforms.Compose([
            transforms.ToPILImage(), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
            transforms.Normalize(mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5])])
        self.imgrec = mx.recordio.MXIndexedRecordIO(os.path.join(root_dir, "train.idx"),
                                                    os.path.join(root_dir, "train.rec"), "r")
        header, _ = mx.recordio.unpack(self.imgrec.read_idx(0))
        self.imgidx = np.array(range(1, int(header.label[0])))

    def __getitem__(self, index):
        header, img = mx.recordio.unpack(self.imgrec.read_idx(int(self.imgidx[index])))
        label = header.label if isinstance(header.label, numbers.Number) else header.label[0]
        return self.transform(mx.image.imdecode(img).asnumpy()), torch.tensor(label, dtype=torch.long)

    def __len__(self):
        return len(self.imgidx)


class MagLinear(nn.Module):
    def __init__(self, in_features, out_features, s=64.0, l_a=10, u_a=110, l_margin=0.45, u_margin=0.8):
        super().__init__()
        self.weight = nn.Parameter(torch.Tensor(in_features, out_features))
        self.weight.data.uniform_(-1, 1).renorm_(2, 1, 1e-5).mul_(1e5)
        self.s, self.l_a, self.u_a = s, l_a, u_a
        self.l_margin, self.u_margin = l_margin, u_margin

    def _margin(self, x_norm):
        return (self.u_margin - self.l_margin) / (self.u_a - self.l_a) * (x_norm - self.l_a) + self.l_margin

    def forward(self, x):
        x_norm = torch.norm(x, dim=1, keepdim=True).clamp(self.l_a, self.u_a)
        ada_margin = self._margin(x_norm)
        cos_m, sin_m = torch.cos(ada_margin), torch.sin(ada_margin)
        cos_theta = torch.mm(F.normalize(x), F.normalize(self.weight, dim=0)).clamp(-1, 1)
        sin_theta = torch.sqrt((1.0 - cos_theta.pow(2)).clamp(min=1e-6))
        cos_theta_m = cos_theta * cos_m - sin_theta * sin_m
        min_cos_theta = torch.cos(math.pi - ada_margin)
        cos_theta_m = torch.where(cos_theta > min_cos_theta, cos_theta_m, cos_theta - torch.sin(math.pi - ada_margin) * ada_margin)
        return [self.s * cos_theta, self.s * cos_theta_m], x_norm


class MagLoss(nn.Module):
    def __init__(self, l_a, u_a, lambda_g):
        super().__init__()
        self.l_a, self.u_a, self.lambda_g = l_a, u_a, lambda_g

    def forward(self, logits, target, x_norm):
        loss_g = (x_norm / self.u_a ** 2 + 1 / x_norm).mean()
        cos_theta, cos_theta_m = logits
        one_hot = torch.zeros_like(cos_theta).scatter_(1, target.view(-1, 1), 1.0)
        output = one_hot * cos_theta_m + (1.0 - one_hot) * cos_theta
        return F.cross_entropy(output, target) + self.lambda_g * loss_g, loss_g


class MagFaceNet(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.features = get_model(args.network, num_features=512, fp16=True)
        self.fc = MagLinear(512, args.num_classes, l_a=args.l_a, u_a=args.u_a,
                            l_margin=args.l_margin, u_margin=args.u_margin)

    def forward(self, x):
        return self.fc(self.features(x).float())


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    summary = SummaryWriter(os.path.join(args.output, "tensorboard")) if rank == 0 else None

    dataset = MXFaceDataset(args.rec)
    sampler = DistributedSampler(dataset, shuffle=True, seed=2048)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    model = DDP(MagFaceNet(args).cuda(), device_ids=[local_rank])
    criterion = MagLoss(args.l_a, args.u_a, args.lambda_g)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)

    total_step = args.num_image // args.batch_size * args.epochs
    warmup_step = args.num_image // args.batch_size * args.warmup_epochs

    def poly_lr(step):
        if step < warmup_step:
            return (step + 1) / warmup_step
        return (1 - (step - warmup_step) / (total_step - warmup_step)) ** 2

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, poly_lr)
    scaler = torch.cuda.amp.GradScaler(growth_interval=100)

    val_callback = None
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        val_callback = verification.CallBackVerification(["lfw", "cfp_fp", "agedb_30"], args.rec, summary_writer=summary)

    global_step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for step, (img, label) in enumerate(loader):
            img, label = img.cuda(non_blocking=True), label.cuda(non_blocking=True)
            logits, x_norm = model(img)
            loss, loss_g = criterion(logits, label, x_norm)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 5)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            global_step += 1

            if rank == 0 and global_step % 50 == 0:
                speed = 50 * args.batch_size * world_size / (time.time() - tic)
                tic = time.time()
                lr = scheduler.get_last_lr()[0]
                logging.info("epoch %d step %d loss %.4f loss_g %.4f mean_norm %.2f lr %.6f %.0f samples/s",
                             epoch, global_step, loss.item(), loss_g.item(), x_norm.mean().item(), lr, speed)
                summary.add_scalar("loss", loss.item(), global_step)
                summary.add_scalar("lr", lr, global_step)
            if rank == 0 and global_step % args.verbose == 0:
                val_callback(global_step, model.module.features)

        if rank == 0:
            torch.save(model.module.state_dict(), os.path.join(args.output, f"magface_epoch_{epoch:02d}.pth"))
        dist.barrier()

    if summary is not None:
        summary.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
