#!/usr/bin/env python3
"""Job wrapper for Faster R-CNN fine-tuning on our VOC-format datasets.

    python 14_detection_job_wrapper.py --gpus 0,1,2,3 --data /data/det/shelves_voc --out /mnt/exp/frcnn_shelves

Writes <out>/status (running / done / failed / cancelled) for the dashboard,
one log per rank under <out>/logs, and a pid file per worker.
"""
import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import torch
import torch.distributed as dist
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchmetrics.detection import MeanAveragePrecision
from torchvision.models.detection import fasterrcnn_resnet50_fpn_v2
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
from torchvision.transforms import functional as TF

log = logging.getLogger("det")


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", default="launcher", choices=["launcher", "worker"])
    ap.add_argument("--gpus", default="0")
    ap.add_argument("--port", type=int, default=29710)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--classes", default="product,price_tag,gap")
    ap.add_argument("--epochs", type=int, default=24)
    ap.add_argument("--imgs-per-gpu", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.02, help="for 16 images per step")
    return ap.parse_args()


def write_status(out, status, **extra):
    with open(os.path.join(out, "status"), "w") as f:
        json.dump({"status": status, "time": time.time(), **extra}, f)


# ---------------------------------------------------------------- launcher
def launcher(args):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [launcher] %(message)s")
    gpus = args.gpus.split(",")
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    write_status(args.out, "running", gpus=gpus)

    def _handle_signal(signum, frame):
        log.warning("received %s, shutting down", signal.Signals(signum).name)
        write_status(args.out, "cancelled")
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, _handle_signal)
    signal.signal(signal.SIGINT, _handle_signal)
    signal.signal(signal.SIGHUP, _handle_signal)

    procs, files = [], []
    for rank, gpu in enumerate(gpus):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu, RANK=str(rank), LOCAL_RANK="0",
                   WORLD_SIZE=str(len(gpus)), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
        f = open(os.path.join(args.out, "logs", f"rank{rank}.log"), "w")
        files.append(f)
        argv = [a for a in sys.argv[1:]] + ["--role", "worker"]
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], env=env,
                             stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        with open(os.path.join(args.out, "logs", f"rank{rank}.pid"), "w") as pf:
            pf.write(str(p.pid))
        procs.append(p)
    log.info("started %d workers: %s", len(procs), [p.pid for p in procs])

    try:
        while True:
            rcs = [p.poll() for p in procs]
            if all(rc == 0 for rc in rcs):
                write_status(args.out, "done")
                return 0
            failed = [(i, rc) for i, rc in enumerate(rcs) if rc not in (None, 0)]
            if failed:
                log.error("rank(s) failed: %s; stopping the others", failed)
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
                for p in procs:
                    try:
                        p.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        p.kill()
                write_status(args.out, "failed", ranks=failed)
                return 1
            time.sleep(5)
    finally:
        for f in files:
            f.close()


# ---------------------------------------------------------------- worker
class VOCDet(Dataset):
    def __init__(self, root, split, classes, train):
        with open(os.path.join(root, "ImageSets", "Main", f"{split}.txt")) as f:
            self.ids = [l.strip() for l in f if l.strip()]
        self.root, self.train = root, train
        self.cls = {c: i + 1 for i, c in enumerate(classes)}

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        iid = self.ids[i]
        img = Image.open(os.path.join(self.root, "JPEGImages", iid + ".jpg")).convert("RGB")
        tree = ET.parse(os.path.join(self.root, "Annotations", iid + ".xml"))
        boxes, labels = [], []
        for obj in tree.findall("object"):
            bb = obj.find("bndbox")
            boxes.append([float(bb.find(k).text) for k in ("xmin", "ymin", "xmax", "ymax")])
            labels.append(self.cls[obj.find("name").text])
        boxes = torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4)
        img = TF.to_tensor(img)
        if self.train and torch.rand(1).item() < 0.5:
            img = img.flip(-1)
            w = img.shape[-1]
            boxes[:, [0, 2]] = w - boxes[:, [2, 0]]
        return img, {"boxes": boxes, "labels": torch.tensor(labels, dtype=torch.int64)}


def collate(batch):
    return tuple(zip(*batch))


def worker(args):
    torch.cuda.set_device(0)   # CUDA_VISIBLE_DEVICES holds exactly one GPU
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", 0)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank{rank}] %(message)s")
    classes = args.classes.split(",")

    train_ds = VOCDet(args.data, "train", classes, train=True)
    val_ds = VOCDet(args.data, "val", classes, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    dl = DataLoader(train_ds, batch_size=args.imgs_per_gpu, sampler=sampler, num_workers=4,
                    collate_fn=collate, drop_last=True)
    vdl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)), batch_size=4,
                     num_workers=2, collate_fn=collate)

    model = fasterrcnn_resnet50_fpn_v2(weights="DEFAULT")
    in_f = model.roi_heads.box_predictor.cls_score.in_features
    model.roi_heads.box_predictor = FastRCNNPredictor(in_f, len(classes) + 1)
    model = DDP(model.to(device), device_ids=[0])

    lr = args.lr * args.imgs_per_gpu * world / 16
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[16, 22], gamma=0.1)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.001, total_iters=min(500, len(dl) - 1))

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (imgs, tgts) in enumerate(dl):
            imgs = [i.to(device, non_blocking=True) for i in imgs]
            tgts = [{k: v.to(device) for k, v in t.items()} for t in tgts]
            losses = model(imgs, tgts)
            loss = sum(losses.values())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if epoch == 0:
                warm.step()
            if rank == 0 and it % 50 == 0:
                log.info("ep %d it %d/%d loss %.3f %s", epoch, it, len(dl), loss.item(),
                         {k: round(v.item(), 3) for k, v in losses.items()})
        sched.step()

        model.eval()
        metric = MeanAveragePrecision(iou_type="bbox").to(device)
        with torch.no_grad():
            for imgs, tgts in vdl:
                preds = model.module([i.to(device) for i in imgs])
                metric.update(preds, [{k: v.to(device) for k, v in t.items()} for t in tgts])
        res = metric.compute()   # torchmetrics syncs the states across ranks here
        if rank == 0:
            log.info("epoch %d mAP %.4f mAP50 %.4f (%.0fs)", epoch, res["map"].item(), res["map_50"].item(),
                     time.time() - t0)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "map": res["map"].item()},
                       os.path.join(args.out, f"frcnn_ep{epoch:02d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    a = cli()
    if a.role == "worker":
        worker(a)
    else:
        sys.exit(launcher(a))
