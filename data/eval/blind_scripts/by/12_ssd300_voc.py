"""SSD300-VGG16 on Pascal VOC 07+12, evaluated on VOC2007 test.

Launch on one node:
    torchrun --nproc_per_node=4 ssd300_voc.py --voc-root /data/VOCdevkit --epochs 120
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchmetrics.detection import MeanAveragePrecision
from torchvision import datasets
from torchvision.models.detection import ssd300_vgg16
from torchvision.models import VGG16_Weights
from torchvision.transforms import v2 as T


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--voc-root", default="/data/VOCdevkit")
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=8, help="per process")
    p.add_argument("--lr", type=float, default=0.002, help="for the total batch of 32")
    p.add_argument("--milestones", type=int, nargs="+", default=[80, 110])
    p.add_argument("--warmup-epochs", type=int, default=1)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--eval-interval", type=int, default=10)
    p.add_argument("--output-dir", default="output/ssd300_voc")
    p.add_argument("--resume", default="")
    return p.parse_args()


def train_transforms():
    return T.Compose([
        T.ToImage(),
        T.RandomPhotometricDistort(p=0.5),
        T.RandomZoomOut(fill=(123, 117, 104), side_range=(1.0, 4.0), p=0.5),
        T.RandomIoUCrop(),
        T.RandomHorizontalFlip(p=0.5),
        T.ToDtype(torch.float32, scale=True),
        T.SanitizeBoundingBoxes(),
    ])


def test_transforms():
    return T.Compose([T.ToImage(), T.ToDtype(torch.float32, scale=True)])


def voc(root, year, image_set, tfm):
    ds = datasets.VOCDetection(root, year=year, image_set=image_set, download=False, transforms=tfm)
    return datasets.wrap_dataset_for_transforms_v2(ds, target_keys=["boxes", "labels"])


def collate(batch):
    return tuple(zip(*batch))


def build_model():
    model = ssd300_vgg16(weights=None, weights_backbone=VGG16_Weights.IMAGENET1K_FEATURES, num_classes=21)
    return model


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    metric = MeanAveragePrecision(iou_type="bbox", iou_thresholds=[0.5])
    metric.to(device)
    for images, targets in loader:
        outputs = model([im.to(device) for im in images])
        metric.update(outputs, [{k: v.to(device) for k, v in t.items()} for t in targets])
    result = metric.compute()  # syncs the states of all ranks
    return result["map_50"].item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set = ConcatDataset([voc(args.voc_root, "2007", "trainval", train_transforms()),
                               voc(args.voc_root, "2012", "trainval", train_transforms())])
    test_set = voc(args.voc_root, "2007", "test", test_transforms())
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, collate_fn=collate, pin_memory=True,
                              persistent_workers=True)
    # strided shard without padding, so no image is counted twice by the metric
    test_shard = Subset(test_set, list(range(rank, len(test_set), world)))
    test_loader = DataLoader(test_shard, batch_size=16, num_workers=args.workers, collate_fn=collate)

    model = build_model().to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world / 32
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    iters = len(train_loader)
    warmup_iters = args.warmup_epochs * iters

    def schedule(it):
        factor = 0.1 ** sum(it >= m * iters for m in args.milestones)
        if it < warmup_iters:
            factor *= 0.01 + 0.99 * it / warmup_iters
        return factor

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

    start_epoch = 0
    if args.resume:
        state = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch = state["epoch"] + 1

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"{len(train_set)} train images, {world} processes, lr {lr:.5f}, {iters} iters/epoch")

    best = 0.0
    for epoch in range(start_epoch, args.epochs):
        model.train()
        tic = time.time()
        meter = torch.zeros(3, device=device)
        for images, targets in train_loader:
            images = [im.to(device, non_blocking=True) for im in images]
            targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
            loss_dict = model(images, targets)
            loss = loss_dict["bbox_regression"] + loss_dict["classification"]
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            meter += torch.stack([loss.detach(), loss_dict["bbox_regression"].detach(),
                                  loss_dict["classification"].detach()])
        dist.all_reduce(meter)
        meter /= world * iters
        if rank == 0:
            print(f"epoch {epoch}: loss {meter[0]:.4f} (reg {meter[1]:.4f}, cls {meter[2]:.4f}) "
                  f"lr {scheduler.get_last_lr()[0]:.5f} {time.time() - tic:.0f}s", flush=True)

        if (epoch + 1) % args.eval_interval == 0 or epoch + 1 == args.epochs:
            map50 = evaluate(model.module, test_loader, device)
            if rank == 0:
                print(f"epoch {epoch}: VOC07 test mAP@0.5 = {map50:.4f}", flush=True)
                if map50 > best:
                    best = map50
                    torch.save(model.module.state_dict(), os.path.join(args.output_dir, "best.pth"))

        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(args.output_dir, "last.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
