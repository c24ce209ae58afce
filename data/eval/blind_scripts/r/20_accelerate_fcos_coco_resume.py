"""FCOS-ResNet50-FPN on a COCO-format shelf-product dataset, custom Accelerate loop.

    accelerate launch --multi_gpu --num_processes 4 20_accelerate_fcos_coco_resume.py \
        --train-json ann/train.json --val-json ann/val.json --images images/ --resume ckpt/last.pth
"""
import argparse
import os
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from pycocotools.coco import COCO
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Subset
from torchmetrics.detection import MeanAveragePrecision
from torchvision.models.detection import fcos_resnet50_fpn
from torchvision.transforms import v2 as T
from torchvision import tv_tensors


class CocoDet(Dataset):
    def __init__(self, ann, img_dir, transforms):
        self.coco = COCO(ann)
        self.ids = sorted(i for i in self.coco.getImgIds() if self.coco.getAnnIds(imgIds=i, iscrowd=False))
        self.cat2label = {c: i + 1 for i, c in enumerate(sorted(self.coco.getCatIds()))}
        self.img_dir, self.transforms = img_dir, transforms

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, idx):
        iid = self.ids[idx]
        info = self.coco.loadImgs(iid)[0]
        img = Image.open(os.path.join(self.img_dir, info["file_name"])).convert("RGB")
        anns = self.coco.loadAnns(self.coco.getAnnIds(imgIds=iid, iscrowd=False))
        boxes = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        target = {"boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(info["height"], info["width"])),
                  "labels": torch.tensor([self.cat2label[a["category_id"]] for a in anns], dtype=torch.int64)}
        return self.transforms(tv_tensors.Image(T.functional.pil_to_tensor(img)), target)


def collate(batch):
    return tuple(zip(*batch))


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-json", default="ann/train.json")
    p.add_argument("--val-json", default="ann/val.json")
    p.add_argument("--images", default="images/")
    p.add_argument("--epochs", type=int, default=24)
    p.add_argument("--bs", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--ckpt-dir", default="ckpt")
    p.add_argument("--resume", default="")
    return p.parse_args()


@torch.no_grad()
def evaluate(accelerator, model, loader):
    model.eval()
    metric = MeanAveragePrecision(iou_type="bbox").to(accelerator.device)
    for images, targets in loader:
        images = [im.to(accelerator.device) for im in images]
        preds = model(images)
        metric.update(preds, [{"boxes": t["boxes"].as_subclass(torch.Tensor).to(accelerator.device),
                               "labels": t["labels"].to(accelerator.device)} for t in targets])
    res = metric.compute()
    model.train()
    return {k: float(res[k]) for k in ("map", "map_50", "map_75")}


def main():
    args = get_args()
    accelerator = Accelerator(mixed_precision="fp16")
    set_seed(0)

    train_tf = T.Compose([T.RandomHorizontalFlip(), T.RandomShortestSize([640, 672, 704, 736, 768, 800], 1333),
                          T.ToDtype(torch.float32, scale=True), T.SanitizeBoundingBoxes()])
    val_tf = T.Compose([T.ToDtype(torch.float32, scale=True)])
    train_ds = CocoDet(args.train_json, args.images, train_tf)
    val_full = CocoDet(args.val_json, args.images, val_tf)
    val_ds = Subset(val_full, range(accelerator.process_index, len(val_full), accelerator.num_processes))
    num_classes = len(train_ds.cat2label) + 1

    train_dl = DataLoader(train_ds, batch_size=args.bs, shuffle=True, num_workers=6, collate_fn=collate,
                          drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=4, num_workers=4, collate_fn=collate)

    with accelerator.main_process_first():
        model = fcos_resnet50_fpn(weights=None, weights_backbone="IMAGENET1K_V1", num_classes=num_classes)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=1e-4)

    start_epoch = 0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch = ckpt["epoch"] + 1
        accelerator.print(f"resumed from {args.resume} at epoch {start_epoch}")

    model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)
    iters_per_epoch = len(train_dl)
    warmup = 500

    def lr_at(it):
        e = it / iters_per_epoch
        f = 0.01 if e >= 22 else (0.1 if e >= 16 else 1.0)
        return f * min(1.0, (it + 1) / warmup)

    it = start_epoch * iters_per_epoch
    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        for images, targets in train_dl:
            for g in optimizer.param_groups:
                g["lr"] = args.lr * lr_at(it)
            losses = model(list(images), [dict(t) for t in targets])
            loss = sum(losses.values())
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(params, 10.0)
            optimizer.step()
            optimizer.zero_grad()
            it += 1
            if it % 50 == 0:
                accelerator.print(f"[{epoch}] it {it} loss {loss.item():.3f} "
                                  + " ".join(f"{k}={v.item():.3f}" for k, v in losses.items()))

        stats = evaluate(accelerator, model, val_dl)
        accelerator.print(f"epoch {epoch} done in {time.time() - t0:.0f}s, val {stats}")

        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            os.makedirs(args.ckpt_dir, exist_ok=True)
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
                     "val": stats}
            torch.save(state, os.path.join(args.ckpt_dir, "last.pth"))
            if epoch % 4 == 3:
                torch.save(state, os.path.join(args.ckpt_dir, f"epoch_{epoch:02d}.pth"))


if __name__ == "__main__":
    main()
