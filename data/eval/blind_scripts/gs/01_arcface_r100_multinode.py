"""ArcFace R100 on MS1MV3 with a model-parallel classifier, 2 nodes x 8 GPUs.

Launch on every node:
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=$NODE_RANK \
        --master_addr=$MASTER_ADDR --master_port=29500 \
        train_r100_mn.py --output /mnt/lustre/face/work_dirs/ms1mv3_r100
"""
import argparse
import logging
import math
import numbers
import os
import pickle
import time

import cv2
import mxnet as mx
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

from backbones import get_model

logger = logging.getLogger("arcface")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--rec", default="/mnt/lustre/face/datasets/ms1m-retinaface-t1")
    p.add_argument("--val-targets", nargs="+", default=["lfw", "cfp_fp", "agedb_30"])
    p.add_argument("--output", default="/mnt/lustre/face/work_dirs/ms1mv3_r100")
    p.add_argument("--network", default="r100")
    p.add_argument("--embedding-size", type=int, default=512)
    p.add_argument("--num-classes", type=int, default=93431)
    p.add_argument("--num-image", type=int, default=5179510)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=0.1, help="for a global batch of 512")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--warmup-epochs", type=int, default=0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--verbose", type=int, default=2000)
    # kept so that old launch scripts using torch.distributed.launch still parse
    p.add_argument("--local_rank", "--local-rank", type=int, default=0)
    return p.parse_args()


class MXFaceDataset(Dataset):
    def __init__(self, root_dir):
        super().__init__()
        self.transform = transforms.Compose([
            transforms.ToPILImage(),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5]),
        ])
        path_imgrec = os.path.join(root_dir, "train.rec")
        path_imgidx = os.path.join(root_dir, "train.idx")
        self.imgrec = mx.recordio.MXIndexedRecordIO(path_imgidx, path_imgrec, "r")
        header, _ = mx.recordio.unpack(self.imgrec.read_idx(0))
        if header.flag > 0:
            self.imgidx = np.array(range(1, int(header.label[0])))
        else:
            self.imgidx = np.array(list(self.imgrec.keys))

    def __getitem__(self, index):
        s = self.imgrec.read_idx(self.imgidx[index])
        header, img = mx.recordio.unpack(s)
        label = header.label
        if not isinstance(label, numbers.Number):
            label = label[0]
        sample = mx.image.imdecode(img).asnumpy()
        return self.transform(sample), torch.tensor(label, dtype=torch.long)

    def __len__(self):
        return len(self.imgidx)


class AllGatherFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, *gather_list):
        gather_list = list(gather_list)
        dist.all_gather(gather_list, tensor)
        return tuple(gather_list)

    @staticmethod
    def backward(ctx, *grads):
        grad_list = list(grads)
        rank = dist.get_rank()
        grad_out = grad_list[rank]
        ops = [
            dist.reduce(grad_out, rank, dist.ReduceOp.SUM, async_op=True)
            if i == rank
            else dist.reduce(grad_list[i], i, dist.ReduceOp.SUM, async_op=True)
            for i in range(dist.get_world_size())
        ]
        for op in ops:
            op.wait()
        grad_out *= len(grad_list)
        return (grad_out, *[None for _ in range(len(grad_list))])


class DistCrossEntropyFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, label):
        batch_size = logits.size(0)
        max_logits, _ = torch.max(logits, dim=1, keepdim=True)
        dist.all_reduce(max_logits, dist.ReduceOp.MAX)
        logits.sub_(max_logits)
        logits.exp_()
        sum_logits_exp = torch.sum(logits, dim=1, keepdim=True)
        dist.all_reduce(sum_logits_exp, dist.ReduceOp.SUM)
        logits.div_(sum_logits_exp)
        index = torch.where(label != -1)[0]
        loss = torch.zeros(batch_size, 1, device=logits.device)
        loss[index] = logits[index].gather(1, label[index])
        dist.all_reduce(loss, dist.ReduceOp.SUM)
        ctx.save_for_backward(index, logits, label)
        return loss.clamp_min_(1e-30).log_().mean() * (-1)

    @staticmethod
    def backward(ctx, loss_gradient):
        index, logits, label = ctx.saved_tensors
        batch_size = logits.size(0)
        one_hot = torch.zeros(size=[index.size(0), logits.size(1)], device=logits.device)
        one_hot.scatter_(1, label[index], 1)
        logits[index] -= one_hot
        logits.div_(batch_size)
        return logits * loss_gradient.item(), None


class ArcFace(nn.Module):
    def __init__(self, s=64.0, margin=0.5):
        super().__init__()
        self.s = s
        self.cos_m = math.cos(margin)
        self.sin_m = math.sin(margin)
        self.th = math.cos(math.pi - margin)
        self.mm = math.sin(math.pi - margin) * margin

    def forward(self, logits, labels):
        index = torch.where(labels != -1)[0]
        target = logits[index, labels[index].view(-1)]
        sin_t = (1.0 - target * target).clamp_min(1e-6).sqrt()
        phi = target * self.cos_m - sin_t * self.sin_m
        phi = torch.where(target > self.th, phi, target - self.mm)
        logits[index, labels[index].view(-1)] = phi
        return logits * self.s


class ModelParallelFC(nn.Module):
    """Each rank keeps the centers of a contiguous block of identities."""

    def __init__(self, margin, embedding_size, num_classes, fp16=False):
        super().__init__()
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.embedding_size = embedding_size
        self.num_local = num_classes // self.world_size + int(self.rank < num_classes % self.world_size)
        self.class_start = num_classes // self.world_size * self.rank + min(self.rank, num_classes % self.world_size)
        self.weight = nn.Parameter(torch.normal(0, 0.01, (self.num_local, embedding_size)))
        self.margin = margin
        self.fp16 = fp16

    def forward(self, local_embeddings, local_labels):
        local_labels = local_labels.view(-1).long()
        bs = local_embeddings.size(0)
        gather_emb = [torch.zeros((bs, self.embedding_size), device=local_embeddings.device)
                      for _ in range(self.world_size)]
        gather_lab = [torch.zeros(bs, dtype=torch.long, device=local_labels.device)
                      for _ in range(self.world_size)]
        embeddings = torch.cat(AllGatherFunc.apply(local_embeddings, *gather_emb))
        dist.all_gather(gather_lab, local_labels)
        labels = torch.cat(gather_lab).view(-1, 1)

        positive = (self.class_start <= labels) & (labels < self.class_start + self.num_local)
        labels[~positive] = -1
        labels[positive] -= self.class_start

        with torch.cuda.amp.autocast(self.fp16):
            logits = F.linear(F.normalize(embeddings), F.normalize(self.weight))
        logits = logits.float().clamp(-1, 1)
        logits = self.margin(logits, labels)
        return DistCrossEntropyFunc.apply(logits, labels)


def load_bin(path, image_size=(112, 112)):
    with open(path, "rb") as f:
        bins, issame = pickle.load(f, encoding="bytes")
    data = torch.empty((len(bins), 3, image_size[0], image_size[1]))
    for i, b in enumerate(bins):
        img = cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_COLOR)
        img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        if img.shape[:2] != image_size:
            img = cv2.resize(img, image_size)
        data[i] = torch.from_numpy(img.transpose(2, 0, 1).copy())
    return data, np.array(issame)


@torch.no_grad()
def verify(model, data, issame, device, batch_size=256):
    model.eval()
    embs = []
    for start in range(0, data.size(0), batch_size):
        img = data[start:start + batch_size].to(device)
        img = (img / 255.0 - 0.5) / 0.5
        emb = model(img) + model(torch.flip(img, dims=[3]))
        embs.append(F.normalize(emb).cpu())
    model.train()
    embs = torch.cat(embs)
    sims = (embs[0::2] * embs[1::2]).sum(1).numpy()
    return max(float(((sims > t) == issame).mean()) for t in np.arange(-1.0, 1.0, 0.005))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s %(message)s")
    os.makedirs(args.output, exist_ok=True)

    torch.manual_seed(2048 + rank)
    np.random.seed(2048 + rank)

    train_set = MXFaceDataset(args.rec)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=2048)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    backbone = get_model(args.network, dropout=0.0, fp16=args.fp16, num_features=args.embedding_size).to(device)
    backbone = DDP(backbone, device_ids=[local_rank], broadcast_buffers=False, bucket_cap_mb=16)
    backbone.train()

    head = ModelParallelFC(ArcFace(64.0, 0.5), args.embedding_size, args.num_classes, args.fp16).to(device)
    head.train()

    total_batch_size = args.batch_size * world_size
    lr = args.lr * total_batch_size / 512
    optimizer = torch.optim.SGD(
        [{"params": backbone.parameters()}, {"params": head.parameters()}],
        lr=lr, momentum=args.momentum, weight_decay=args.weight_decay)
    steps_per_epoch = args.num_image // total_batch_size
    warmup_steps = steps_per_epoch * args.warmup_epochs
    total_steps = steps_per_epoch * args.epochs

    def lr_lambda(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return max(0.0, 1 - (step - warmup_steps) / max(1, total_steps - warmup_steps)) ** 2

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    scaler = torch.cuda.amp.GradScaler(growth_interval=100, enabled=args.fp16)

    start_epoch, global_step = 0, 0
    ckpt_path = os.path.join(args.output, f"checkpoint_gpu_{rank}.pt")
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        start_epoch = ckpt["epoch"]
        global_step = ckpt["global_step"]
        backbone.module.load_state_dict(ckpt["backbone"])
        head.load_state_dict(ckpt["head"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        del ckpt

    val_sets = {}
    if rank == 0:
        for name in args.val_targets:
            path = os.path.join(args.rec, name + ".bin")
            if os.path.exists(path):
                val_sets[name] = load_bin(path)

    tic = time.time()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for img, label in loader:
            img = img.to(device, non_blocking=True)
            label = label.to(device, non_blocking=True)
            global_step += 1

            embeddings = backbone(img)
            loss = head(embeddings, label)

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(backbone.parameters(), 5)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()

            if rank == 0 and global_step % 50 == 0:
                speed = 50 * total_batch_size / (time.time() - tic)
                tic = time.time()
                logger.info("epoch %d step %d/%d loss %.4f lr %.5f %.0f samples/s", epoch, global_step,
                            total_steps, loss.item(), scheduler.get_last_lr()[0], speed)

            if global_step % args.verbose == 0:
                if rank == 0:
                    for name, (data, issame) in val_sets.items():
                        acc = verify(backbone.module, data, issame, device)
                        logger.info("[%s][%d] accuracy-flip: %.5f", name, global_step, acc)
                dist.barrier()

        torch.save({
            "epoch": epoch + 1,
            "global_step": global_step,
            "backbone": backbone.module.state_dict(),
            "head": head.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
        }, ckpt_path)
        if rank == 0:
            torch.save(backbone.module.state_dict(), os.path.join(args.output, "model.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
