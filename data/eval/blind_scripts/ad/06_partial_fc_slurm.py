"""ArcFace with Partial FC (class centres sharded across GPUs), launched by Slurm.

sbatch -N 2 --ntasks-per-node=8 --gpus-per-node=8 --cpus-per-task=10 job.sh, where job.sh does
    export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    export MASTER_PORT=29531
    srun python 06_partial_fc_slurm.py --rec /shared/faces/glint360k --output /shared/work/pfc_r100
"""
import argparse
import logging
import numbers
import os
import time

import mxnet as mx
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision import transforms

from backbones import get_model
from eval import verification


class MXFaceDataset(Dataset):
    def __init__(self, root_dir):
        self.transform = transforms.Compose([transforms.ToPILImage(), transforms.RandomHorizontalFlip(),
                                             transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.5] * 3)])
        self.imgrec = mx.recordio.MXIndexedRecordIO(os.path.join(root_dir, "train.idx"),
                                                    os.path.join(root_dir, "train.rec"), "r")
        header, _ = mx.recordio.unpack(self.imgrec.read_idx(0))
        self.imgidx = np.array(range(1, int(header.label[0]))) if header.flag > 0 \
            else np.array(list(self.imgrec.keys))

    def __getitem__(self, index):
        header, img = mx.recordio.unpack(self.imgrec.read_idx(self.imgidx[index]))
        label = header.label
        if not isinstance(label, numbers.Number):
            label = label[0]
        sample = mx.image.imdecode(img).asnumpy()
        return self.transform(sample), torch.tensor(label, dtype=torch.long)

    def __len__(self):
        return len(self.imgidx)


class AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor):
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(out, tensor)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        grad = torch.stack(grads)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        # DDP averages the backbone gradients over ranks, the loss is a global mean
        return grad[dist.get_rank()] * dist.get_world_size()


class DistCrossEntropy(torch.autograd.Function):
    """Softmax cross entropy when every rank only holds a slice of the logits' columns."""

    @staticmethod
    def forward(ctx, logits, label):
        max_logits = logits.max(dim=1, keepdim=True).values
        dist.all_reduce(max_logits, dist.ReduceOp.MAX)
        probs = (logits - max_logits).exp()
        sum_exp = probs.sum(dim=1, keepdim=True)
        dist.all_reduce(sum_exp, dist.ReduceOp.SUM)
        probs.div_(sum_exp)
        index = torch.where(label != -1)[0]
        picked = torch.zeros(logits.size(0), 1, device=logits.device)
        picked[index] = probs[index].gather(1, label[index])
        dist.all_reduce(picked, dist.ReduceOp.SUM)
        ctx.save_for_backward(index, probs, label)
        return picked.clamp_min(1e-30).log().mean() * -1

    @staticmethod
    def backward(ctx, grad_out):
        index, probs, label = ctx.saved_tensors
        grad = probs.clone()
        grad[index] -= F.one_hot(label[index].squeeze(1), probs.size(1)).to(grad.dtype)
        return grad / probs.size(0) * grad_out, None


class PartialFC(nn.Module):
    def __init__(self, embedding_size, num_classes, rank, world_size, sample_rate=0.2, s=64.0, m=0.5):
        super().__init__()
        self.num_local = num_classes // world_size + int(rank < num_classes % world_size)
        self.class_start = num_classes // world_size * rank + min(rank, num_classes % world_size)
        self.num_sample = int(sample_rate * self.num_local)
        self.sample_rate, self.s, self.m = sample_rate, s, m
        self.weight = nn.Parameter(torch.normal(0, 0.01, (self.num_local, embedding_size)))

    def sample(self, labels, index_positive):
        with torch.no_grad():
            positive = torch.unique(labels[index_positive], sorted=True)
            if self.num_sample - positive.size(0) >= 0:
                perm = torch.rand(self.num_local, device=labels.device)
                perm[positive] = 2.0
                index = torch.topk(perm, k=self.num_sample)[1].sort()[0]
            else:
                index = positive
            labels[index_positive] = torch.searchsorted(index, labels[index_positive])
        return self.weight[index]

    def forward(self, local_embeddings, local_labels):
        embeddings = torch.cat(AllGather.apply(local_embeddings))
        labels = [torch.empty_like(local_labels) for _ in range(dist.get_world_size())]
        dist.all_gather(labels, local_labels)
        labels = torch.cat(labels).view(-1, 1)
        index_positive = (labels >= self.class_start) & (labels < self.class_start + self.num_local)
        labels[~index_positive] = -1
        labels[index_positive] -= self.class_start
        weight = self.sample(labels, index_positive) if self.sample_rate < 1 else self.weight

        cos = F.linear(F.normalize(embeddings), F.normalize(weight)).clamp(-1, 1)
        idx = torch.where(labels.view(-1) != -1)[0]
        target = cos[idx, labels[idx].view(-1)]
        theta = torch.acos(target.clamp(-1 + 1e-7, 1 - 1e-7))
        cos = cos.clone()
        cos[idx, labels[idx].view(-1)] = torch.cos(theta + self.m)
        return DistCrossEntropy.apply(cos * self.s, labels)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rec", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--network", default="r100")
    ap.add_argument("--num-classes", type=int, default=360232)
    ap.add_argument("--batch-size", type=int, default=128, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.1, help="for a global batch of 1024")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--sample-rate", type=float, default=0.2)
    ap.add_argument("--val-targets", nargs="+", default=["lfw", "cfp_fp", "agedb_30"])
    args = ap.parse_args()

    rank = int(os.environ["SLURM_PROCID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s r{rank} %(message)s")
    os.makedirs(args.output, exist_ok=True)

    dataset = MXFaceDataset(args.rec)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=2048)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    backbone = get_model(args.network, dropout=0.0, num_features=512)
    backbone = nn.SyncBatchNorm.convert_sync_batchnorm(backbone).cuda()
    backbone = DDP(backbone, device_ids=[local_rank], broadcast_buffers=False, bucket_cap_mb=16)
    # the classifier shard is local to this rank, so it is not wrapped in DDP
    pfc = PartialFC(512, args.num_classes, rank, world_size, sample_rate=args.sample_rate).cuda()

    global_batch = args.batch_size * world_size
    lr = args.lr * global_batch / 1024
    optimizer = torch.optim.SGD([{"params": backbone.parameters()}, {"params": pfc.parameters()}],
                                lr=lr, momentum=0.9, weight_decay=5e-4)
    total_steps = len(loader) * args.epochs
    warmup = len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warmup if s < warmup else (1 - (s - warmup) / (total_steps - warmup)) ** 2)

    start_epoch, global_step = 0, 0
    ckpt_path = os.path.join(args.output, f"checkpoint_gpu_{rank}.pt")
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=f"cuda:{local_rank}")
        assert ckpt["world_size"] == world_size, "partial fc shards need the same number of GPUs"
        backbone.module.load_state_dict(ckpt["backbone"])
        pfc.load_state_dict(ckpt["pfc"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, global_step = ckpt["epoch"], ckpt["global_step"]

    val_sets = {}
    if rank == 0:
        for name in args.val_targets:
            val_sets[name] = verification.load_bin(os.path.join(args.rec, name + ".bin"), (112, 112))

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        backbone.train()
        tic = time.time()
        for img, label in loader:
            img, label = img.cuda(non_blocking=True), label.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                emb = backbone(img)
            loss = pfc(emb.float(), label)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(backbone.parameters(), 5)
            optimizer.step()
            scheduler.step()
            global_step += 1
            if global_step % 100 == 0 and rank == 0:
                speed = 100 * global_batch / (time.time() - tic)
                tic = time.time()
                logging.info("epoch %d step %d loss %.4f lr %.5f %.0f samples/s", epoch, global_step,
                             loss.item(), scheduler.get_last_lr()[0], speed)

        torch.save({"backbone": backbone.module.state_dict(), "pfc": pfc.state_dict(),
                    "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "epoch": epoch + 1, "global_step": global_step, "world_size": world_size}, ckpt_path)
        if rank == 0:
            torch.save(backbone.module.state_dict(), os.path.join(args.output, "model.pt"))
            backbone.eval()
            for name, data in val_sets.items():
                _, _, acc, std, _, _ = verification.test(data, backbone.module, 10, 10)
                logging.info("[%s] epoch %d accuracy-flip %.5f+-%.5f", name, epoch, acc, std)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
