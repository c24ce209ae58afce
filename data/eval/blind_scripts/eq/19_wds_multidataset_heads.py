"""
Joint training of one ConvNeXt backbone on several image-classification datasets, each with
its own label space and its own linear head. Every dataset is a WebDataset shard set.

    torchrun --nproc_per_node=8 19_wds_multidataset_heads.py --config mixes/inat_places_in1k.yaml
"""
import argparse
import os
import random
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.transforms as T
import webdataset as wds
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP

DEFAULT_MIX = {
    "in1k": {"shards": "/data/wds/imagenet1k/train-{0000..1023}.tar", "classes": 1000, "weight": 0.4},
    "inat21": {"shards": "/data/wds/inat2021/train-{0000..0499}.tar", "classes": 10000, "weight": 0.35},
    "places365": {"shards": "/data/wds/places365/train-{0000..0359}.tar", "classes": 365, "weight": 0.25},
}


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None, help="yaml with a `datasets:` mapping like DEFAULT_MIX")
    ap.add_argument("--backbone", default="convnext_small")
    ap.add_argument("--batch_size", type=int, default=96)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--steps", type=int, default=150_000)
    ap.add_argument("--warmup", type=int, default=5_000)
    ap.add_argument("--workers", type=int, default=4, help="per dataset")
    ap.add_argument("--out", default="/shared/exp/multidata_convnext")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


TRAIN_TF = T.Compose([
    T.RandomResizedCrop(224, scale=(0.25, 1.0)),
    T.RandomHorizontalFlip(),
    T.ColorJitter(0.3, 0.3, 0.3),
    T.ToTensor(),
    T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
])


def stream(spec, batch_size, workers):
    ds = (wds.WebDataset(spec["shards"], resampled=True, handler=wds.warn_and_continue)
          .shuffle(5000)
          .decode("pil", handler=wds.warn_and_continue)
          .to_tuple("jpg;jpeg;png", "cls")
          .map_tuple(TRAIN_TF, int)
          .batched(batch_size, partial=False))
    return iter(wds.WebLoader(ds, batch_size=None, num_workers=workers, pin_memory=True,
                              persistent_workers=True))


class MultiHeadNet(nn.Module):
    def __init__(self, backbone, datasets):
        super().__init__()
        self.backbone = timm.create_model(backbone, pretrained=True, num_classes=0, drop_path_rate=0.2)
        dim = self.backbone.num_features
        self.heads = nn.ModuleDict({name: nn.Linear(dim, d["classes"]) for name, d in datasets.items()})

    def forward(self, x, dataset):
        return self.heads[dataset](self.backbone(x))


def main():
    args = parse_args()
    mix = DEFAULT_MIX
    if args.config:
        with open(args.config) as f:
            mix = yaml.safe_load(f)["datasets"]

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    picker = random.Random(args.seed + rank)

    model = MultiHeadNet(args.backbone, mix).to(device)
    model = DDP(model, device_ids=[local_rank])

    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    other = [p for n, p in model.named_parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": other, "weight_decay": 0.0}], lr=args.lr)
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt,
        [torch.optim.lr_scheduler.LinearLR(opt, 1e-3, 1.0, total_iters=args.warmup),
         torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps - args.warmup, eta_min=1e-6)],
        milestones=[args.warmup])
    crit = nn.CrossEntropyLoss(label_smoothing=0.1)

    names = list(mix)
    weights = [mix[n]["weight"] for n in names]
    iters = {n: stream(mix[n], args.batch_size, args.workers) for n in names}

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"datasets {names} weights {weights}; global batch {args.batch_size * world}")

    meters = {n: torch.zeros(3, device=device) for n in names}  # loss sum, correct, count
    model.train()
    t0 = time.time()
    for step in range(1, args.steps + 1):
        name = picker.choices(names, weights)[0]
        images, labels = next(iters[name])
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(images, name)
            loss = crit(logits, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        opt.step()
        sched.step()
        meters[name] += torch.stack([loss.detach().float() * labels.numel(),
                                     (logits.argmax(-1) == labels).sum().float(),
                                     torch.tensor(float(labels.numel()), device=device)])

        if step % 200 == 0:
            stats = torch.stack([meters[n] for n in names])
            dist.all_reduce(stats)
            if rank == 0:
                parts = " | ".join(f"{n}: loss {s[0] / max(s[2], 1):.3f} acc {s[1] / max(s[2], 1):.3f}"
                                   for n, s in zip(names, stats.tolist()))
                print(f"step {step} lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 200:.2f}s/it | {parts}",
                      flush=True)
                t0 = time.time()
            for n in names:
                meters[n].zero_()

        if step % 10_000 == 0 or step == args.steps:
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                            "sched": sched.state_dict(), "step": step, "mix": mix},
                           os.path.join(args.out, f"step_{step:06d}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
