"""Faster R-CNN R50-FPN fine-tuned on an Open Images V7 subset (COCO-format export, 60 classes).

    torchrun --nproc_per_node=8 frcnn_openimages.py --root /data/oi_subset --epochs 12
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torchvision
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torchvision.models.detection import fasterrcnn_resnet50_fpn
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
from torchvision.transforms import v2 as T


def build_argparser():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/oi_subset")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--ims-per-gpu", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.02, help="for 16 images per step")
    ap.add_argument("--lr-steps", type=int, nargs="+", default=[8, 11])
    ap.add_argument("--warmup-iters", type=int, default=500)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--out-dir", default="work_dirs/oi_frcnn")
    ap.add_argument("--resume", default="")
    return ap


def dataset(root, split, train):
    ops = [T.ToImage()]
    if train:
        ops += [T.RandomShortestSize((600, 700, 800), max_size=1333), T.RandomHorizontalFlip()]
    ops += [T.ToDtype(torch.float32, scale=True), T.SanitizeBoundingBoxes()]
    ds = torchvision.datasets.CocoDetection(f"{root}/{split}", f"{root}/annotations/{split}.json",
                                            transforms=T.Compose(ops))
    if train:
        ds.ids = [i for i in ds.ids if ds.coco.getAnnIds(imgIds=i)]
    return torchvision.datasets.wrap_dataset_for_transforms_v2(ds, target_keys=["boxes", "labels", "image_id"])


def collate(batch):
    return tuple(zip(*batch))


@torch.no_grad()
def evaluate(model, loader, coco_gt, device):
    """Each rank runs its shard; detections are gathered as one float tensor to rank 0."""
    model.eval()
    rows = []
    for imgs, tgts in loader:
        outs = model([im.to(device, non_blocking=True) for im in imgs])
        for t, o in zip(tgts, outs):
            b = o["boxes"]
            xywh = torch.cat([b[:, :2], b[:, 2:] - b[:, :2]], 1)
            iid = torch.full((len(b), 1), float(t["image_id"]), device=device)
            rows.append(torch.cat([iid, xywh, o["scores"][:, None], o["labels"][:, None].float()], 1))
    dets = torch.cat(rows) if rows else torch.zeros((0, 7), device=device)

    world = dist.get_world_size()
    gathered = [torch.zeros_like(dets) for _ in range(world)]
    dist.all_gather(gathered, dets)
    if dist.get_rank() != 0:
        return None

    all_dets = torch.cat(gathered).cpu().numpy()
    # DistributedSampler pads the last shard with repeated images; the repeats give identical rows
    uniq = {}
    for r in all_dets:
        key = (int(r[0]), tuple(np.round(r[1:5], 2)), int(r[6]))
        if key not in uniq:
            uniq[key] = {"image_id": key[0], "bbox": r[1:5].tolist(), "score": float(r[5]), "category_id": key[2]}
    results = list(uniq.values())
    if not results:
        return 0.0
    E = COCOeval(coco_gt, coco_gt.loadRes(results), "bbox")
    E.evaluate()
    E.accumulate()
    E.summarize()
    return float(E.stats[0])


def main():
    args = build_argparser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = dataset(args.root, "train", True)
    val_ds = dataset(args.root, "validation", False)
    num_classes = len(train_ds.coco.getCatIds()) + 1
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.ims_per_gpu, sampler=sampler, collate_fn=collate,
                          num_workers=args.workers, pin_memory=True)
    val_dl = DataLoader(val_ds, batch_size=2, sampler=DistributedSampler(val_ds, shuffle=False),
                        collate_fn=collate, num_workers=args.workers)

    model = fasterrcnn_resnet50_fpn(weights="COCO_V1")
    model.roi_heads.box_predictor = FastRCNNPredictor(model.roi_heads.box_predictor.cls_score.in_features,
                                                      num_classes)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.ims_per_gpu * world / 16
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4)
    iters = len(train_dl)

    def lr_lambda(it):
        warm = min(1.0, 0.001 + (1 - 0.001) * it / args.warmup_iters)
        return warm * 0.1 ** sum(it >= s * iters for s in args.lr_steps)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (imgs, tgts) in enumerate(train_dl):
            imgs = [im.to(device, non_blocking=True) for im in imgs]
            tgts = [{"boxes": t["boxes"].to(device), "labels": t["labels"].to(device)} for t in tgts]
            loss_dict = model(imgs, tgts)
            loss = sum(loss_dict.values())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            if i % 50 == 0:
                red = torch.stack(list(loss_dict.values())).detach()
                dist.all_reduce(red, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} iter {i}/{iters} lr {scheduler.get_last_lr()[0]:.5f} "
                          f"loss {red.sum():.4f} " + " ".join(f"{k}:{v:.3f}" for k, v in zip(loss_dict, red.tolist()))
                          + f" [{time.time() - t0:.0f}s]", flush=True)

        ap = evaluate(model.module, val_dl, val_ds.coco, device)
        if rank == 0:
            print(f"epoch {epoch}: bbox AP {ap:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(args.out_dir, f"epoch_{epoch}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
