"""Multi-dataset semantic segmentation (Cityscapes, Mapillary Vistas, BDD100K).

Shared DeepLabV3 encoder + ASPP, one classifier per dataset (label spaces differ).
Each iteration stacks one batch from every dataset; the three losses are summed.

    torchrun --nproc_per_node=8 13_multidataset_segmentation.py \
        --data_root /datasets --out /checkpoints/mseg --wandb_project mseg
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import ResNet101_Weights
from torchvision.models.segmentation import deeplabv3_resnet101

from segdata import build_seg_dataset  # project-local: returns (image, mask) with crop/flip/scale aug

DATASETS = {"cityscapes": 19, "mapillary": 65, "bdd100k": 19}
IGNORE = 255


class MultiHeadDeepLab(nn.Module):
    def __init__(self):
        super().__init__()
        base = deeplabv3_resnet101(weights=None, weights_backbone=ResNet101_Weights.IMAGENET1K_V2,
                                   num_classes=256, aux_loss=False)
        self.backbone = base.backbone
        # drop the last 1x1 classifier conv of the default head, keep ASPP + 3x3 conv
        self.neck = nn.Sequential(*list(base.classifier.children())[:-1])
        self.heads = nn.ModuleDict({d: nn.Conv2d(256, n, 1) for d, n in DATASETS.items()})

    def forward(self, x, splits):
        size = x.shape[-2:]
        f = self.neck(self.backbone(x)["out"])
        out, i = {}, 0
        for d, n in splits:
            out[d] = F.interpolate(self.heads[d](f[i:i + n]), size=size, mode="bilinear", align_corners=False)
            i += n
        return out


def fast_hist(pred, gt, n):
    k = gt != IGNORE
    return torch.bincount(gt[k] * n + pred[k], minlength=n * n).view(n, n)


@torch.no_grad()
def evaluate(net, val_sets, device, rank, world):
    net.eval()
    mious = {}
    for d, ds in val_sets.items():
        n = DATASETS[d]
        hist = torch.zeros(n, n, dtype=torch.long, device=device)
        for img, gt in DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=2, num_workers=4):
            img, gt = img.to(device), gt.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = net(img, [(d, img.size(0))])[d]
            hist += fast_hist(logits.argmax(1), gt, n)
        dist.all_reduce(hist)
        iou = hist.diag().float() / (hist.sum(0) + hist.sum(1) - hist.diag()).float().clamp(min=1)
        mious[d] = iou.mean().item()
    net.train()
    return mious


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--wandb_project", default="mseg")
    ap.add_argument("--crop", type=int, default=768)
    ap.add_argument("--bs", type=int, default=2, help="images per dataset per GPU")
    ap.add_argument("--iters", type=int, default=90000)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--eval_every", type=int, default=5000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    run = wandb.init(project=args.wandb_project, config=vars(args), name=f"mseg-{world}gpu")

    train_sets = {d: build_seg_dataset(args.data_root, d, "train", crop=args.crop) for d in DATASETS}
    val_sets = {d: build_seg_dataset(args.data_root, d, "val", crop=None) for d in DATASETS}
    samplers, streams = {}, {}
    for d, ds in train_sets.items():
        samplers[d] = DistributedSampler(ds, shuffle=True, drop_last=True)

        def gen(d=d, ds=ds):
            ep = 0
            dl = DataLoader(ds, batch_size=args.bs, sampler=samplers[d], num_workers=4,
                            pin_memory=True, drop_last=True, persistent_workers=True)
            while True:
                samplers[d].set_epoch(ep)
                yield from dl
                ep += 1
        streams[d] = gen()

    net = nn.SyncBatchNorm.convert_sync_batchnorm(MultiHeadDeepLab()).to(device)
    model = DDP(net, device_ids=[local_rank])
    backbone_params = list(model.module.backbone.parameters())
    other_params = [p for n, p in model.module.named_parameters() if not n.startswith("backbone.")]
    opt = torch.optim.SGD([{"params": backbone_params, "lr": args.lr},
                           {"params": other_params, "lr": args.lr * 10}],
                          momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=args.iters, power=0.9)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    for it in range(args.iters):
        batches = {d: next(streams[d]) for d in DATASETS}
        imgs = torch.cat([batches[d][0] for d in DATASETS]).to(device, non_blocking=True)
        splits = [(d, batches[d][0].size(0)) for d in DATASETS]
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(imgs, splits)
            losses = {d: F.cross_entropy(out[d].float(), batches[d][1].to(device, non_blocking=True),
                                         ignore_index=IGNORE) for d in DATASETS}
            loss = sum(losses.values())
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()

        if it % 20 == 0:
            wandb.log({"loss": loss.item(), **{f"loss/{d}": l.item() for d, l in losses.items()},
                       "lr": sched.get_last_lr()[0], "sec_per_iter": (time.time() - t0) / 20}, step=it)
            t0 = time.time()

        if (it + 1) % args.eval_every == 0 or it + 1 == args.iters:
            mious = evaluate(model.module, val_sets, device, rank, world)
            if rank == 0:
                print(f"iter {it + 1}: {mious}", flush=True)
                wandb.log({f"mIoU/{d}": v for d, v in mious.items()} | {"mIoU/mean": float(np.mean(list(mious.values())))},
                          step=it)
                torch.save({"model": model.module.state_dict(), "iter": it + 1, "opt": opt.state_dict()},
                           os.path.join(args.out, f"iter_{it + 1}.pth"))
            dist.barrier()

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
