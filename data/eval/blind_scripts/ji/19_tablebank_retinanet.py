"""Table detection on TableBank (Word + LaTeX splits, COCO format) with torchvision RetinaNet.

Trains with DDP, keeps the best checkpoint by val mAP@0.5 and finally scores it on the test split.

    torchrun --nproc_per_node=4 19_tablebank_retinanet.py --root /data/TableBank/Detection
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchmetrics.detection import MeanAveragePrecision
from torchvision.models.detection import retinanet_resnet50_fpn_v2
from torchvision.models.detection.retinanet import RetinaNetClassificationHead
from torchvision.transforms import functional as TF


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--splits", nargs="+", default=["word", "latex"])
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default="output/tablebank_retina")
    return ap.parse_args()


class TableBankCOCO(Dataset):
    def __init__(self, root, splits, part, train):
        self.items = []
        for s in splits:
            with open(os.path.join(root, "annotations", f"tablebank_{s}_{part}.json")) as f:
                coco = json.load(f)
            anns = {}
            for a in coco["annotations"]:
                anns.setdefault(a["image_id"], []).append(a["bbox"])
            for im in coco["images"]:
                self.items.append((os.path.join(root, "images", im["file_name"]), anns.get(im["id"], [])))
        self.train = train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, bbs = self.items[i]
        img = Image.open(path).convert("RGB")
        boxes = torch.tensor([[x, y, x + w, y + h] for x, y, w, h in bbs], dtype=torch.float32).reshape(-1, 4)
        if self.train:
            img = TF.adjust_contrast(img, 0.8 + 0.4 * torch.rand(()).item())
        return TF.to_tensor(img), {"boxes": boxes, "labels": torch.ones(len(boxes), dtype=torch.int64)}


def collate(batch):
    return tuple(zip(*batch))


def build_model():
    model = retinanet_resnet50_fpn_v2(weights="COCO_V1", min_size=800, max_size=1333)
    anchors = model.head.classification_head.num_anchors
    model.head.classification_head = RetinaNetClassificationHead(256, anchors, num_classes=2)
    return model


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    metric = MeanAveragePrecision(iou_thresholds=[0.5, 0.75]).to(device)
    for imgs, targets in loader:
        outs = model([im.to(device) for im in imgs])
        metric.update(outs, [{k: v.to(device) for k, v in t.items()} for t in targets])
    res = metric.compute()  # synchronised across ranks
    model.train()
    return res["map_50"].item(), res["map_75"].item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set = TableBankCOCO(args.root, args.splits, "train", train=True)
    val_set = TableBankCOCO(args.root, args.splits, "val", train=False)
    test_set = TableBankCOCO(args.root, args.splits, "test", train=False)
    sampler = DistributedSampler(train_set, shuffle=True)
    train_dl = DataLoader(train_set, batch_size=args.bs, sampler=sampler, num_workers=args.workers,
                          collate_fn=collate, pin_memory=True, drop_last=True)

    def shard_loader(ds):
        return DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=4, num_workers=args.workers,
                          collate_fn=collate)

    val_dl, test_dl = shard_loader(val_set), shard_loader(test_set)

    model = build_model().to(device)
    model = DDP(model, device_ids=[local_rank])
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=1e-4)
    total_iters = args.epochs * len(train_dl)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda it: min(1.0, (it + 1) / 500) * (0.1 if it > 0.75 * total_iters else 1.0))

    best_path = os.path.join(args.out, "model_best.pth")
    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (imgs, targets) in enumerate(train_dl):
            imgs = [im.to(device, non_blocking=True) for im in imgs]
            targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
            loss_dict = model(imgs, targets)
            loss = loss_dict["classification"] + loss_dict["bbox_regression"]
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 10.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and it % 100 == 0:
                print(f"[{epoch}][{it}/{len(train_dl)}] cls {loss_dict['classification'].item():.4f} "
                      f"box {loss_dict['bbox_regression'].item():.4f}", flush=True)

        ap50, ap75 = evaluate(model.module, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} ({(time.time() - t0) / 60:.1f} min) val AP50 {ap50:.4f} AP75 {ap75:.4f}", flush=True)
            if ap50 > best:
                best = ap50
                os.makedirs(args.out, exist_ok=True)
                torch.save(model.state_dict(), best_path)
        dist.barrier()

    # score the best checkpoint on the held-out test split
    test_model = build_model().to(device)
    test_model.load_state_dict(torch.load(best_path, map_location=device))
    ap50, ap75 = evaluate(test_model, test_dl, device)
    if rank == 0:
        print(f"TEST  AP50 {ap50:.4f}  AP75 {ap75:.4f}")
        with open(os.path.join(args.out, "test_metrics.json"), "w") as f:
            json.dump({"ap50": ap50, "ap75": ap75, "best_val_ap50": best}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
