"""WebFace42M (2M identities) / R100 with Partial FC, sample rate 0.2.

    torchrun --nproc_per_node=8 train_wf42m_pfc.py --output /mnt/nas/face/wf42m_r100_pfc02
"""
import argparse
import logging
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from backbones import get_model
from dataset import MXFaceDataset
from utils.utils_callbacks import CallBackVerification

logger = logging.getLogger(__name__)


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
        ops = [dist.reduce(grad_list[i], i, dist.ReduceOp.SUM, async_op=True) for i in range(len(grad_list))]
        for op in ops:
            op.wait()
        grad_out = grad_list[rank] * len(grad_list)
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
        one_hot = torch.zeros(size=[index.size(0), logits.size(1)], device=logits.device)
        one_hot.scatter_(1, label[index], 1)
        logits[index] -= one_hot
        logits.div_(logits.size(0))
        return logits * loss_gradient.item(), None


class PartialFC(nn.Module):
    def __init__(self, embedding_size, num_classes, sample_rate, s=64.0, m=0.5):
        super().__init__()
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.embedding_size = embedding_size
        self.sample_rate = sample_rate
        self.num_local = num_classes // self.world_size + int(self.rank < num_classes % self.world_size)
        self.class_start = num_classes // self.world_size * self.rank + min(self.rank, num_classes % self.world_size)
        self.num_sample = int(sample_rate * self.num_local)
        self.weight = nn.Parameter(torch.normal(0, 0.01, (self.num_local, embedding_size)))
        self.s = s
        self.cos_m, self.sin_m = math.cos(m), math.sin(m)
        self.th, self.mm = math.cos(math.pi - m), math.sin(math.pi - m) * m

    def sample(self, labels, index_positive):
        # negatives are drawn independently on every rank; positives are always kept
        with torch.no_grad():
            positive = torch.unique(labels[index_positive], sorted=True)
            if self.num_sample - positive.size(0) >= 0:
                perm = torch.rand(size=[self.num_local], device=labels.device)
                perm[positive] = 2.0
                index = torch.topk(perm, k=self.num_sample)[1]
                index = index.sort()[0]
            else:
                index = positive
            labels[index_positive] = torch.searchsorted(index, labels[index_positive])
        return self.weight[index]

    def forward(self, local_embeddings, local_labels):
        local_labels = local_labels.view(-1).long()
        bs = local_embeddings.size(0)
        _emb = [torch.zeros((bs, self.embedding_size), device=local_embeddings.device) for _ in range(self.world_size)]
        _lab = [torch.zeros(bs, dtype=torch.long, device=local_embeddings.device) for _ in range(self.world_size)]
        embeddings = torch.cat(AllGatherFunc.apply(local_embeddings, *_emb))
        dist.all_gather(_lab, local_labels)
        labels = torch.cat(_lab).view(-1, 1)

        index_positive = (self.class_start <= labels) & (labels < self.class_start + self.num_local)
        labels[~index_positive] = -1
        labels[index_positive] -= self.class_start
        weight = self.sample(labels, index_positive) if self.sample_rate < 1 else self.weight

        logits = F.linear(F.normalize(embeddings), F.normalize(weight)).clamp(-1, 1)
        index = torch.where(labels != -1)[0]
        target = logits[index, labels[index].view(-1)]
        sin_t = (1.0 - target * target).clamp_min(1e-6).sqrt()
        phi = torch.where(target > self.th, target * self.cos_m - sin_t * self.sin_m, target - self.mm)
        logits[index, labels[index].view(-1)] = phi
        return DistCrossEntropyFunc.apply(logits * self.s, labels)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rec", default="/train_tmp/WebFace42M")
    ap.add_argument("--output", default="/mnt/nas/face/wf42m_r100_pfc02")
    ap.add_argument("--num-classes", type=int, default=2059906)
    ap.add_argument("--num-image", type=int, default=42474557)
    ap.add_argument("--sample-rate", type=float, default=0.2)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--warmup-epochs", type=int, default=1)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42 + rank)

    os.makedirs(args.output, exist_ok=True)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    writer = SummaryWriter(os.path.join(args.output, "tb")) if rank == 0 else None

    train_set = MXFaceDataset(root_dir=args.rec, local_rank=local_rank)
    sampler = DistributedSampler(train_set, shuffle=True, seed=42)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True, prefetch_factor=4, persistent_workers=True)

    backbone = get_model("r100", dropout=0.0, fp16=True, num_features=512).to(device)
    backbone = DistributedDataParallel(backbone, device_ids=[local_rank], broadcast_buffers=False, bucket_cap_mb=16)
    pfc = PartialFC(512, args.num_classes, args.sample_rate).to(device)

    total_batch = args.batch_size * world_size
    opt = torch.optim.SGD([{"params": backbone.parameters()}, {"params": pfc.parameters()}],
                          lr=args.lr * total_batch / 1024, momentum=0.9, weight_decay=5e-4)
    steps_per_epoch = args.num_image // total_batch
    warmup, total = steps_per_epoch * args.warmup_epochs, steps_per_epoch * args.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: (i + 1) / warmup if i < warmup else max(0.0, 1 - (i - warmup) / (total - warmup)) ** 2)
    scaler = torch.cuda.amp.GradScaler(growth_interval=100)

    start_epoch, global_step = 0, 0
    ckpt_path = os.path.join(args.output, f"checkpoint_gpu_{rank}.pt")
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        assert ckpt["world_size"] == world_size, "the classifier shards were saved with another world size"
        backbone.module.load_state_dict(ckpt["backbone"])
        pfc.load_state_dict(ckpt["pfc"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, global_step = ckpt["epoch"], ckpt["global_step"]
        del ckpt

    verifier = CallBackVerification(val_targets=["lfw", "cfp_fp", "agedb_30"], rec_prefix=args.rec,
                                    summary_writer=writer)
    skipped = 0
    tic = time.time()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for img, label in loader:
            img = img.to(device, non_blocking=True)
            label = label.to(device, non_blocking=True)
            loss = pfc(backbone(img), label)

            # the loss is already reduced over all ranks, so every rank takes the same branch
            if not torch.isfinite(loss):
                skipped += 1
                opt.zero_grad(set_to_none=True)
                continue

            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(backbone.parameters(), 5)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            sched.step()
            global_step += 1

            if rank == 0 and global_step % 100 == 0:
                logger.info("epoch %d step %d/%d loss %.4f lr %.5f scale %.0f skipped %d %.0f img/s",
                            epoch, global_step, total, loss.item(), sched.get_last_lr()[0], scaler.get_scale(),
                            skipped, 100 * total_batch / (time.time() - tic))
                writer.add_scalar("loss", loss.item(), global_step)
                tic = time.time()
            if global_step % 5000 == 0:
                verifier(global_step, backbone)

        torch.save({"backbone": backbone.module.state_dict(), "pfc": pfc.state_dict(), "opt": opt.state_dict(),
                    "sched": sched.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch + 1,
                    "global_step": global_step, "world_size": world_size}, ckpt_path)
        if rank == 0:
            torch.save(backbone.module.state_dict(), os.path.join(args.output, "model.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
