"""SwAV pre-training (ResNet-50, 2x224 + 6x96 multi-crop, 3000 prototypes, feature queue).

torchrun --nproc_per_node=8 15_swav_queue.py --data_path /data/imagenet/train --dump_path exp/swav_400ep
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import wandb
from torchvision import datasets, transforms
from torchvision.transforms import InterpolationMode

parser = argparse.ArgumentParser(description="SwAV")
parser.add_argument("--data_path", type=str, required=True)
parser.add_argument("--dump_path", type=str, default=".")
parser.add_argument("--nmb_crops", type=int, nargs="+", default=[2, 6])
parser.add_argument("--size_crops", type=int, nargs="+", default=[224, 96])
parser.add_argument("--min_scale_crops", type=float, nargs="+", default=[0.14, 0.05])
parser.add_argument("--max_scale_crops", type=float, nargs="+", default=[1.0, 0.14])
parser.add_argument("--crops_for_assign", type=int, nargs="+", default=[0, 1])
parser.add_argument("--temperature", default=0.1, type=float)
parser.add_argument("--epsilon", default=0.05, type=float)
parser.add_argument("--sinkhorn_iterations", default=3, type=int)
parser.add_argument("--feat_dim", default=128, type=int)
parser.add_argument("--nmb_prototypes", default=3000, type=int)
parser.add_argument("--queue_length", type=int, default=3840)
parser.add_argument("--epoch_queue_starts", type=int, default=15)
parser.add_argument("--epochs", default=400, type=int)
parser.add_argument("--batch_size", default=64, type=int, help="per GPU")
parser.add_argument("--base_lr", default=4.8, type=float, help="lr at batch 4096")
parser.add_argument("--final_lr", type=float, default=0.0048)
parser.add_argument("--freeze_prototypes_niters", default=5005, type=int)
parser.add_argument("--wd", default=1e-6, type=float)
parser.add_argument("--warmup_epochs", default=10, type=int)
parser.add_argument("--workers", default=10, type=int)
parser.add_argument("--checkpoint_freq", type=int, default=25)
parser.add_argument("--wandb_project", default="swav")
parser.add_argument("--run_name", default=None)


class MultiCropDataset(datasets.ImageFolder):
    def __init__(self, root, size_crops, nmb_crops, min_scale_crops, max_scale_crops):
        super().__init__(root)
        color = transforms.Compose([
            transforms.RandomApply([transforms.ColorJitter(0.8, 0.8, 0.8, 0.2)], p=0.8),
            transforms.RandomGrayscale(p=0.2)])
        norm = transforms.Normalize([0.485, 0.456, 0.406], [0.228, 0.224, 0.225])
        self.trans = []
        for size, n, lo, hi in zip(size_crops, nmb_crops, min_scale_crops, max_scale_crops):
            t = transforms.Compose([
                transforms.RandomResizedCrop(size, scale=(lo, hi), interpolation=InterpolationMode.BICUBIC),
                transforms.RandomHorizontalFlip(p=0.5), color,
                transforms.RandomApply([transforms.GaussianBlur(23, (0.1, 2.0))], p=0.5),
                transforms.ToTensor(), norm])
            self.trans.extend([t] * n)

    def __getitem__(self, index):
        path, _ = self.samples[index]
        image = self.loader(path)
        return [t(image) for t in self.trans]


class SwAVModel(nn.Module):
    def __init__(self, feat_dim, nmb_prototypes, hidden_mlp=2048):
        super().__init__()
        self.backbone = torchvision.models.resnet50()
        self.backbone.fc = nn.Identity()
        self.projection_head = nn.Sequential(nn.Linear(2048, hidden_mlp), nn.BatchNorm1d(hidden_mlp),
                                             nn.ReLU(inplace=True), nn.Linear(hidden_mlp, feat_dim))
        self.prototypes = nn.Linear(feat_dim, nmb_prototypes, bias=False)

    def forward(self, inputs):
        idx_crops = torch.cumsum(torch.unique_consecutive(
            torch.tensor([inp.shape[-1] for inp in inputs]), return_counts=True)[1], 0)
        start_idx, feats = 0, []
        for end_idx in idx_crops:
            feats.append(self.backbone(torch.cat(inputs[start_idx:end_idx]).cuda(non_blocking=True)))
            start_idx = end_idx
        z = F.normalize(self.projection_head(torch.cat(feats)), dim=1, p=2)
        return z, self.prototypes(z)


@torch.no_grad()
def distributed_sinkhorn(out, epsilon, iterations, world_size):
    Q = torch.exp(out / epsilon).t()
    B = Q.shape[1] * world_size
    K = Q.shape[0]
    sum_Q = torch.sum(Q)
    dist.all_reduce(sum_Q)
    Q /= sum_Q
    for _ in range(iterations):
        sum_of_rows = torch.sum(Q, dim=1, keepdim=True)
        dist.all_reduce(sum_of_rows)
        Q /= sum_of_rows
        Q /= K
        Q /= torch.sum(Q, dim=0, keepdim=True)
        Q /= B
    Q *= B
    return Q.t()


class LARS(torch.optim.Optimizer):
    def __init__(self, params, lr, momentum=0.9, weight_decay=0.0, eta=0.001):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                d = p.grad
                if p.ndim > 1:
                    d = d.add(p, alpha=g["weight_decay"])
                    pn, dn = p.norm(), d.norm()
                    d = d * torch.where((pn > 0) & (dn > 0), g["eta"] * pn / dn, torch.ones_like(pn))
                buf = self.state[p].setdefault("mu", torch.zeros_like(p))
                buf.mul_(g["momentum"]).add_(d)
                p.add_(buf, alpha=-g["lr"])


def main():
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    train_dataset = MultiCropDataset(args.data_path, args.size_crops, args.nmb_crops,
                                     args.min_scale_crops, args.max_scale_crops)
    sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)
    train_loader = torch.utils.data.DataLoader(train_dataset, sampler=sampler, batch_size=args.batch_size,
                                               num_workers=args.workers, pin_memory=True, drop_last=True)

    model = SwAVModel(args.feat_dim, args.nmb_prototypes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])

    global_batch = args.batch_size * world_size
    peak_lr = args.base_lr * global_batch / 4096
    final_lr = args.final_lr * global_batch / 4096
    optimizer = LARS(model.parameters(), lr=peak_lr, weight_decay=args.wd)
    niter = len(train_loader)
    warmup = np.linspace(0, peak_lr, niter * args.warmup_epochs)
    iters = np.arange(niter * (args.epochs - args.warmup_epochs))
    cosine = final_lr + 0.5 * (peak_lr - final_lr) * (1 + np.cos(np.pi * iters / len(iters)))
    lr_schedule = np.concatenate((warmup, cosine))

    os.makedirs(args.dump_path, exist_ok=True)
    ckpt_path = os.path.join(args.dump_path, "checkpoint.pth.tar")
    queue_path = os.path.join(args.dump_path, f"queue{rank}.pth")
    start_epoch, queue = 0, None
    if os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch = ckpt["epoch"]
        if os.path.isfile(queue_path):
            queue = torch.load(queue_path, map_location="cpu")["queue"].cuda()

    # each rank keeps its own slice of the queue
    queue_length = args.queue_length - args.queue_length % (global_batch)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        if queue_length > 0 and epoch >= args.epoch_queue_starts and queue is None:
            queue = torch.zeros(len(args.crops_for_assign), queue_length // world_size, args.feat_dim).cuda()
        model.train()
        use_the_queue = False
        end = time.time()
        for it, inputs in enumerate(train_loader):
            iteration = epoch * niter + it
            for g in optimizer.param_groups:
                g["lr"] = lr_schedule[iteration]

            with torch.no_grad():
                w = model.module.prototypes.weight.data.clone()
                model.module.prototypes.weight.copy_(F.normalize(w, dim=1, p=2))

            embedding, output = model(inputs)
            embedding = embedding.detach()
            bs = inputs[0].size(0)

            loss = 0
            for i, crop_id in enumerate(args.crops_for_assign):
                with torch.no_grad():
                    out = output[bs * crop_id: bs * (crop_id + 1)].detach()
                    if queue is not None:
                        if use_the_queue or not torch.all(queue[i, -1, :] == 0):
                            use_the_queue = True
                            out = torch.cat((queue[i] @ model.module.prototypes.weight.t(), out))
                        queue[i, bs:] = queue[i, :-bs].clone()
                        queue[i, :bs] = embedding[crop_id * bs: (crop_id + 1) * bs]
                    q = distributed_sinkhorn(out, args.epsilon, args.sinkhorn_iterations, world_size)[-bs:]
                subloss = 0
                for v in np.delete(np.arange(np.sum(args.nmb_crops)), crop_id):
                    x = output[bs * v: bs * (v + 1)] / args.temperature
                    subloss -= torch.mean(torch.sum(q * F.log_softmax(x, dim=1), dim=1))
                loss += subloss / (np.sum(args.nmb_crops) - 1)
            loss /= len(args.crops_for_assign)

            optimizer.zero_grad()
            loss.backward()
            if iteration < args.freeze_prototypes_niters:
                for name, p in model.named_parameters():
                    if "prototypes" in name:
                        p.grad = None
            optimizer.step()

            if it % 50 == 0:
                loss_t = loss.detach().clone()
                dist.all_reduce(loss_t, op=dist.ReduceOp.AVG)
                wandb.log({"loss": loss_t.item(), "lr": lr_schedule[iteration],
                           "queue_in_use": int(use_the_queue)}, step=iteration)
                if rank == 0:
                    print(f"Epoch {epoch} [{it}/{niter}] loss {loss_t.item():.4f} "
                          f"lr {lr_schedule[iteration]:.4f} {time.time() - end:.1f}s", flush=True)

        if rank == 0:
            save_dict = {"epoch": epoch + 1, "state_dict": model.module.state_dict(),
                         "optimizer": optimizer.state_dict()}
            torch.save(save_dict, ckpt_path)
            if (epoch + 1) % args.checkpoint_freq == 0 or epoch + 1 == args.epochs:
                torch.save(save_dict, os.path.join(args.dump_path, f"ckp-{epoch}.pth"))
        if queue is not None:
            torch.save({"queue": queue}, queue_path)

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
