"""RetinaNet R50-FPN v2 on LVIS-style long-tail subset (COCO-format json), large effective batch via
gradient accumulation. Spawns one process per visible GPU itself:

    python retinanet_accum.py --data /data/objects365_sub --accum 4 --batch-size 4
"""
import argparse
import json
import os
import socket
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torchvision
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision.models.detection import retinanet_resnet50_fpn_v2
from torchvision.transforms import v2 as T


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--num-classes", type=int, default=365)
    p.add_argument("--batch-size", type=int, default=4, help="per GPU, per micro-step")
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.01, help="for an effective batch of 16")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--steps", type=int, nargs="+", default=[8, 11])
    p.add_argument("--warmup", type=int, default=500, help="optimizer steps")
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--out", default="work/retina_o365")
    p.add_argument("--resume", default="")
    return p.parse_args()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_ds(root, split, train):
    tf = [T.ToImage()]
    if train:
        tf += [T.RandomShortestSize((640, 672, 704, 736, 768, 800), 1333), T.RandomHorizontalFlip()]
    tf += [T.ToDtype(torch.float32, scale=True), T.SanitizeBoundingBoxes()]
    ds = torchvision.datasets.CocoDetection(f"{root}/images/{split}", f"{root}/annotations/{split}.json",
                                            transforms=T.Compose(tf))
    if train:
        ds.ids = [i for i in ds.ids if ds.coco.getAnnIds(imgIds=i, iscrowd=False)]
    return torchvision.datasets.wrap_dataset_for_transforms_v2(ds, target_keys=("boxes", "labels", "image_id"))


def collate(batch):
    return tuple(zip(*batch))


@torch.no_grad()
def evaluate(model, loader, coco_gt, device):
    model.eval()
    mine = []
    for imgs, tgts in loader:
        outs = model([im.to(device) for im in imgs])
        for t, o in zip(tgts, outs):
            b = o["boxes"].cpu()
            b[:, 2:] -= b[:, :2]
            mine += [{"image_id": int(t["image_id"]), "category_id": int(c), "bbox": bb, "score": float(s)}
                     for bb, s, c in zip(b.tolist(), o["scores"].tolist(), o["labels"].tolist())]
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, mine)
    if dist.get_rank() != 0:
        return None
    dets = [d for part in everything for d in part]
    E = COCOeval(coco_gt, coco_gt.loadRes(dets), "bbox")
    E.evaluate()
    E.accumulate()
    E.summarize()
    return float(E.stats[0])


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)

    train_ds = make_ds(args.data, "train", True)
    val_ds = make_ds(args.data, "val", False)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                          collate_fn=collate, pin_memory=True, persistent_workers=True, drop_last=True)
    # every val image exactly once: strided shards, a few ranks get one image fewer
    val_shard = Subset(val_ds, range(rank, len(val_ds), world_size))
    val_dl = DataLoader(val_shard, batch_size=4, num_workers=4, collate_fn=collate)

    model = retinanet_resnet50_fpn_v2(weights=None, weights_backbone="IMAGENET1K_V2",
                                      num_classes=args.num_classes + 1).to(device)
    ddp = DDP(model, device_ids=[rank])

    eff_batch = args.batch_size * args.accum * world_size
    lr = args.lr * eff_batch / 16
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    updates_per_epoch = len(train_dl) // args.accum
    milestones = [s * updates_per_epoch for s in args.steps]

    def factor(u):
        w = min(1.0, 0.001 + u / args.warmup)
        return w * 0.1 ** sum(u >= m for m in milestones)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)

    start_epoch, best = 0, 0.0
    if args.resume:
        # checkpoints are written from cuda:0; remap onto this rank's GPU
        ck = torch.load(args.resume, map_location={"cuda:0": f"cuda:{rank}"})
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world {world_size}, effective batch {eff_batch}, lr {lr:.4f}, {updates_per_epoch} updates/epoch")

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.time()
        opt.zero_grad(set_to_none=True)
        usable = updates_per_epoch * args.accum
        for i, (imgs, tgts) in enumerate(train_dl):
            if i >= usable:
                break  # same cut-off on every rank: len(train_dl) is identical with drop_last
            imgs = [im.to(device, non_blocking=True) for im in imgs]
            tgts = [{"boxes": t["boxes"].to(device), "labels": t["labels"].to(device)} for t in tgts]
            sync_now = (i + 1) % args.accum == 0
            with nullcontext() if sync_now else ddp.no_sync():
                losses = ddp(imgs, tgts)
                loss = (losses["classification"] + losses["bbox_regression"]) / args.accum
                loss.backward()
            if sync_now:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            if i % (20 * args.accum) == 0:
                v = torch.stack([losses["classification"].detach(), losses["bbox_regression"].detach()])
                dist.all_reduce(v, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} {i // args.accum}/{updates_per_epoch} cls {v[0]:.4f} reg {v[1]:.4f} "
                          f"lr {sched.get_last_lr()[0]:.5f} {time.time() - t0:.0f}s", flush=True)

        ap = evaluate(model, val_dl, val_ds.coco, device)
        if rank == 0:
            print(f"epoch {epoch}: bbox AP {ap:.4f}", flush=True)
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "best": max(best, ap)}
            torch.save(state, os.path.join(args.out, "last.pth"))
            if ap > best:
                best = ap
                torch.save(state, os.path.join(args.out, "best.pth"))
            with open(os.path.join(args.out, "metrics.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "AP": ap}) + "\n")
        dist.barrier()

    dist.destroy_process_group()


def main():
    args = get_args()
    world_size = torch.cuda.device_count()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(world_size, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
