"""Faster R-CNN R50-FPN v2 for small-object detection (traffic signs, COCO-format annotations).

Progressive multi-scale training: the short side range grows over the schedule,
so early epochs are cheap and late epochs see full resolution.

    torchrun --nproc_per_node=4 frcnn_multiscale.py --config configs/tt100k.yaml
"""
import argparse
import os
import time
from copy import deepcopy

import torch
import torch.distributed as dist
import torchvision
import yaml
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torchvision.models.detection import fasterrcnn_resnet50_fpn_v2
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.transforms import v2 as T

DEFAULTS = {
    "data_root": "data/tt100k",
    "num_classes": 46,
    "epochs": 24,
    "imgs_per_gpu": 2,
    "base_lr": 0.02,
    "lr_steps": [16, 22],
    "warmup_iters": 1000,
    "scale_stages": [  # (first epoch, allowed short sides)
        [0, [800, 864, 928]],
        [8, [960, 1024, 1088]],
        [16, [1152, 1216, 1280, 1344]],
    ],
    "max_size": 2048,
    "ema_decay": 0.9998,
    "out_dir": "runs/tt100k_frcnn",
}


def load_config(path):
    cfg = dict(DEFAULTS)
    if path:
        with open(path) as f:
            cfg.update(yaml.safe_load(f) or {})
    return cfg


def make_dataset(root, split, train):
    tfm = T.Compose([T.ToImage(), T.RandomHorizontalFlip(0.5) if train else T.Identity(),
                     T.ToDtype(torch.float32, scale=True), T.SanitizeBoundingBoxes()])
    ds = torchvision.datasets.CocoDetection(os.path.join(root, split), os.path.join(root, f"annotations/{split}.json"),
                                            transforms=tfm)
    if train:
        ds.ids = [i for i in ds.ids if ds.coco.getAnnIds(imgIds=i, iscrowd=False)]
    return torchvision.datasets.wrap_dataset_for_transforms_v2(ds, target_keys=["boxes", "labels", "image_id"])


def collate(batch):
    return tuple(zip(*batch))


def build_model(cfg):
    # smaller anchors than the COCO default, most signs are under 32 px
    anchor_gen = AnchorGenerator(sizes=((16,), (32,), (64,), (128,), (256,)), aspect_ratios=((0.5, 1.0, 2.0),) * 5)
    model = fasterrcnn_resnet50_fpn_v2(weights="COCO_V1", min_size=cfg["scale_stages"][0][1],
                                       max_size=cfg["max_size"])
    model.rpn.anchor_generator = anchor_gen
    in_features = model.roi_heads.box_predictor.cls_score.in_features
    model.roi_heads.box_predictor = FastRCNNPredictor(in_features, cfg["num_classes"] + 1)
    return model


class EMA:
    def __init__(self, model, decay):
        self.module = deepcopy(model).eval()
        self.decay = decay
        self.num_updates = 0
        for p in self.module.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        self.num_updates += 1
        d = min(self.decay, (1 + self.num_updates) / (10 + self.num_updates))
        for e, m in zip(self.module.state_dict().values(), model.state_dict().values()):
            if e.dtype.is_floating_point:
                e.mul_(d).add_(m.detach(), alpha=1.0 - d)
            else:
                e.copy_(m)


def scales_for_epoch(stages, epoch):
    current = stages[0][1]
    for start, sizes in stages:
        if epoch >= start:
            current = sizes
    return tuple(current)


@torch.no_grad()
def evaluate(model, loader, coco_gt, device):
    model.eval()
    res = {}
    for imgs, tgts in loader:
        outs = model([im.to(device) for im in imgs])
        for t, o in zip(tgts, outs):
            bx = o["boxes"].cpu()
            bx[:, 2:] -= bx[:, :2]
            res[int(t["image_id"])] = [
                {"image_id": int(t["image_id"]), "category_id": int(l), "bbox": b, "score": float(s)}
                for b, s, l in zip(bx.tolist(), o["scores"].tolist(), o["labels"].tolist())]
    world = [None] * dist.get_world_size()
    dist.all_gather_object(world, res)
    if dist.get_rank() != 0:
        return None
    merged = {}
    for r in world:
        merged.update(r)
    dets = [d for ds in merged.values() for d in ds]
    if not dets:
        return 0.0
    E = COCOeval(coco_gt, coco_gt.loadRes(dets), "bbox")
    E.params.imgIds = sorted(merged)
    E.evaluate()
    E.accumulate()
    E.summarize()
    return float(E.stats[0])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="")
    parser.add_argument("--resume", default="")
    args = parser.parse_args()
    cfg = load_config(args.config)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = make_dataset(cfg["data_root"], "train", True)
    val_ds = make_dataset(cfg["data_root"], "test", False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=cfg["imgs_per_gpu"], sampler=train_sampler, num_workers=6,
                          collate_fn=collate, pin_memory=True)
    val_dl = DataLoader(val_ds, batch_size=1, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=4,
                        collate_fn=collate)

    model = build_model(cfg).to(device)
    model = DDP(model, device_ids=[local_rank])
    model_without_ddp = model.module
    ema = EMA(model_without_ddp, cfg["ema_decay"])

    lr = cfg["base_lr"] * cfg["imgs_per_gpu"] * world_size / 16
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4)
    steps_per_epoch = len(train_dl)
    milestones = [e * steps_per_epoch for e in cfg["lr_steps"]]

    def lr_lambda(it):
        warm = min(1.0, 0.001 + it / cfg["warmup_iters"])
        return warm * 0.1 ** sum(it >= m for m in milestones)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model_without_ddp.load_state_dict(ckpt["model"])
        ema.module.load_state_dict(ckpt["ema"])
        ema.num_updates = ckpt["ema_updates"]
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1

    os.makedirs(cfg["out_dir"], exist_ok=True)
    best = -1.0
    for epoch in range(start_epoch, cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        sizes = scales_for_epoch(cfg["scale_stages"], epoch)
        model.transform.min_size = sizes
        model.train()
        t0 = time.time()
        for i, (imgs, tgts) in enumerate(train_dl):
            imgs = [im.to(device, non_blocking=True) for im in imgs]
            tgts = [{"boxes": t["boxes"].to(device), "labels": t["labels"].to(device)} for t in tgts]
            loss_dict = model(imgs, tgts)
            loss = sum(loss_dict.values())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            ema.update(model_without_ddp)
            if i % 50 == 0:
                logged = torch.stack([loss.detach()] + [v.detach() for v in loss_dict.values()])
                dist.all_reduce(logged, op=dist.ReduceOp.AVG)
                if rank == 0:
                    parts = " ".join(f"{k}={v:.3f}" for k, v in zip(loss_dict, logged[1:].tolist()))
                    print(f"[{epoch}][{i}/{steps_per_epoch}] sizes={sizes} lr={scheduler.get_last_lr()[0]:.5f} "
                          f"loss={logged[0]:.3f} {parts} ({time.time() - t0:.0f}s)", flush=True)

        # evaluate the EMA weights at the largest scale
        ema.module.transform.min_size = (cfg["scale_stages"][-1][1][-1],)
        ap = evaluate(ema.module, val_dl, val_ds.coco, device)
        if rank == 0:
            print(f"epoch {epoch}: EMA bbox AP = {ap:.4f}", flush=True)
            state = {"model": model_without_ddp.state_dict(), "ema": ema.module.state_dict(),
                     "ema_updates": ema.num_updates, "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "cfg": cfg}
            torch.save(state, os.path.join(cfg["out_dir"], "last.pth"))
            if ap > best:
                best = ap
                torch.save(state, os.path.join(cfg["out_dir"], "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
