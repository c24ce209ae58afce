"""Partial FC (model-parallel softmax) on Glint360K.

The backbone is data parallel (DDP); the 360k-class classifier is split by class
over the ranks and is never wrapped in DDP. Embeddings and labels of the whole
global batch are gathered onto every rank, each rank computes logits against its
own class shard, and the softmax normaliser is all-reduced.
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
import timm
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

logger = logging.getLogger("partial_fc")


class MXFaceDataset(Dataset):
    def __init__(self, root_dir):
        super().__init__()
        self.transform = transforms.Compose([
            transforms.ToPILImage(), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
            transforms.Normalize(mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5])])
        self.imgrec = mx.recordio.MXIndexedRecordIO(
            os.path.join(root_dir, "train.idx"), os.path.join(root_dir, "train.rec"), "r")
        header, _ = mx.recordio.unpack(self.imgrec.read_idx(0))
        if header.flag > 0:
            self.imgidx = np.array(range(1, int(header.label[0])))
        else:
            self.imgidx = np.array(list(self.imgrec.keys))

    def __getitem__(self, index):
        header, img = mx.recordio.unpack(self.imgrec.read_idx(self.imgidx[index]))
        label = header.label if isinstance(header.label, numbers.Number) else header.label[0]
        sample = mx.image.imdecode(img).asnumpy()
        return self.transform(sample), torch.tensor(label, dtype=torch.long)

    def __len__(self):
        return len(self.imgidx)


class AllGatherFunc(torch.autograd.Function):
    """all_gather whose backward sums each rank's gradient back to its owner."""

    @staticmethod
    def forward(ctx, tensor, *gather_list):
        gather_list = list(gather_list)
        dist.all_gather(gather_list, tensor)
        return tuple(gather_list)

    @staticmethod
    def backward(ctx, *grads):
        grad_list = list(grads)
        rank = dist.get_rank()
        works = [dist.reduce(grad_list[i], i, dist.ReduceOp.SUM, async_op=True)
                 for i in range(dist.get_world_size())]
        for w in works:
            w.wait()
        grad_out = grad_list[rank]
        # DDP averages the backbone gradients over ranks; scale back to the full-batch gradient
        grad_out *= len(grad_list)
        return (grad_out, *[None for _ in range(len(grad_list))])


AllGather = AllGatherFunc.apply


class DistCrossEntropyFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, label):
        batch_size = logits.size(0)
        max_logits, _ = torch.max(logits, dim=1, keepdim=True)
        dist.all_reduce(max_logits, dist.ReduceOp.MAX)
        logits.sub_(max_logits).exp_()
        sum_exp = torch.sum(logits, dim=1, keepdim=True)
        dist.all_reduce(sum_exp, dist.ReduceOp.SUM)
        logits.div_(sum_exp)
        index = torch.where(label != -1)[0]
        loss = torch.zeros(batch_size, 1, device=logits.device)
        loss[index] = logits[index].gather(1, label[index])
        dist.all_reduce(loss, dist.ReduceOp.SUM)
        ctx.save_for_backward(index, logits, label)
        return loss.clamp_min_(1e-30).log_().mean() * (-1)

    @staticmethod
    def backward(ctx, loss_grad):
        index, logits, label = ctx.saved_tensors
        one_hot = torch.zeros(size=[index.size(0), logits.size(1)], device=logits.device)
        one_hot.scatter_(1, label[index], 1)
        logits[index] -= one_hot
        logits.div_(logits.size(0))
        return logits * loss_grad.item(), None


class PartialFC(nn.Module):
    def __init__(self, embedding_size, num_classes, sample_rate, s=64.0, m=0.5):
        super().__init__()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # the first (num_classes % world_size) ranks own one extra class
        self.num_local = num_classes // self.world_size + int(self.rank < num_classes % self.world_size)
        self.class_start = num_classes // self.world_size * self.rank + min(self.rank, num_classes % self.world_size)
        self.num_sample = int(sample_rate * self.num_local)
        self.weight = nn.Parameter(torch.normal(0, 0.01, (self.num_local, embedding_size)))
        self.s, self.cos_m, self.sin_m = s, math.cos(m), math.sin(m)
        self.th, self.mm = math.cos(math.pi - m), math.sin(math.pi - m) * m

    def sample(self, labels, index_positive):
        with torch.no_grad():
            positive = torch.unique(labels[index_positive], sorted=True)
            if self.num_sample - positive.size(0) >= 0:
                perm = torch.rand(size=[self.num_local], device=labels.device)
                perm[positive] = 2.0
                index = torch.topk(perm, k=self.num_sample)[1].sort()[0]
            else:
                index = positive
            labels[index_positive] = torch.searchsorted(index, labels[index_positive])
        return self.weight[index]

    def margin(self, cosine, labels):
        index = torch.where(labels != -1)[0]
        target = cosine[index, labels[index].view(-1)]
        sin_t = torch.sqrt((1.0 - target * target).clamp(min=1e-6))
        phi = target * self.cos_m - sin_t * self.sin_m
        phi = torch.where(target > self.th, phi, target - self.mm)
        cosine[index, labels[index].view(-1)] = phi.to(cosine.dtype)
        return cosine * self.s

    def forward(self, local_embeddings, local_labels):
        batch_size = local_embeddings.size(0)
        emb_list = [torch.zeros_like(local_embeddings) for _ in range(self.world_size)]
        lab_list = [torch.zeros_like(local_labels) for _ in range(self.world_size)]
        embeddings = torch.cat(AllGather(local_embeddings, *emb_list))
        dist.all_gather(lab_list, local_labels)
        labels = torch.cat(lab_list).view(-1, 1)
        assert embeddings.size(0) == batch_size * self.world_size

        index_positive = (self.class_start <= labels) & (labels < self.class_start + self.num_local)
        labels[~index_positive] = -1
        labels[index_positive] -= self.class_start
        weight = self.sample(labels, index_positive) if self.num_sample < self.num_local else self.weight
        cosine = F.linear(F.normalize(embeddings.float()), F.normalize(weight)).clamp(-1, 1)
        logits = self.margin(cosine, labels)
        return DistCrossEntropyFunc.apply(logits, labels)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rec", default="/train_tmp/glint360k")
    parser.add_argument("--num-classes", type=int, default=360232)
    parser.add_argument("--network", default="resnet101", help="timm model name for the backbone")
    parser.add_argument("--embedding-size", type=int, default=512)
    parser.add_argument("--sample-rate", type=float, default=0.1)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--warmup-epochs", type=int, default=0)
    parser.add_argument("--output", default="/mnt/shared/work_dirs/glint360k_r100")
    parser.add_argument("--resume", action="store_true")
    return parser.parse_args()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR)
    os.makedirs(args.output, exist_ok=True)

    dataset = MXFaceDataset(args.rec)
    sampler = DistributedSampler(dataset, shuffle=True, seed=2048)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    backbone = timm.create_model(args.network, num_classes=args.embedding_size, in_chans=3)
    backbone = backbone.cuda()
    backbone = DistributedDataParallel(backbone, device_ids=[local_rank], bucket_cap_mb=16)
    head = PartialFC(args.embedding_size, args.num_classes, args.sample_rate).cuda()

    total_batch = args.batch_size * world_size
    steps_per_epoch = len(loader)
    total_steps = steps_per_epoch * args.epochs
    warmup_steps = steps_per_epoch * args.warmup_epochs
    lr = args.lr * total_batch / 512
    optimizer = torch.optim.SGD([{"params": backbone.parameters()}, {"params": head.parameters()}],
                                lr=lr, momentum=0.9, weight_decay=5e-4)

    def poly(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return (1 - (step - warmup_steps) / (total_steps - warmup_steps)) ** 2

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, poly)
    scaler = torch.cuda.amp.GradScaler(growth_interval=100)

    start_epoch, global_step = 0, 0
    if args.resume:
        ckpt = torch.load(os.path.join(args.output, f"checkpoint_gpu_{rank}.pt"),
                          map_location=f"cuda:{local_rank}")
        assert ckpt["world_size"] == world_size, "partial fc shards were saved with another world size"
        backbone.module.load_state_dict(ckpt["backbone"])
        head.load_state_dict(ckpt["partial_fc"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, global_step = ckpt["epoch"] + 1, ckpt["global_step"]

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        backbone.train()
        tic = time.time()
        for step, (img, label) in enumerate(loader):
            img, label = img.cuda(non_blocking=True), label.cuda(non_blocking=True)
            with torch.cuda.amp.autocast():
                embeddings = backbone(img)
            loss = head(embeddings, label)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(backbone.parameters(), 5)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            global_step += 1
            if global_step % 100 == 0 and rank == 0:
                speed = 100 * total_batch / (time.time() - tic)
                tic = time.time()
                logger.info("epoch %d step %d/%d loss %.4f lr %.6f speed %.0f samples/s",
                            epoch, step, steps_per_epoch, loss.item(), scheduler.get_last_lr()[0], speed)

        # every rank writes its own classifier shard; the backbone is identical on all ranks
        torch.save({"epoch": epoch, "global_step": global_step, "world_size": world_size,
                    "backbone": backbone.module.state_dict(), "partial_fc": head.state_dict(),
                    "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                   os.path.join(args.output, f"checkpoint_gpu_{rank}.pt"))
        if rank == 0:
            torch.save(backbone.module.state_dict(), os.path.join(args.output, "model.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
