"""Fine-tune Table Transformer (DETR) for table detection on our scanned-report pages.

Annotations are COCO json (categories: 0=table, 1=table rotated, as in PubTables-1M).

    torchrun --nproc_per_node=4 05_table_transformer_detection.py \
        --img_dir /data/tables/images --train_json /data/tables/train.json --val_json /data/tables/val.json
"""
import argparse
import contextlib
import io
import json
import logging
import os

import torch
import torch.distributed as dist
from PIL import Image
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoImageProcessor, TableTransformerForObjectDetection

log = logging.getLogger("tatr")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--img_dir", required=True)
    p.add_argument("--train_json", required=True)
    p.add_argument("--val_json", required=True)
    p.add_argument("--checkpoint", default="microsoft/table-transformer-detection")
    p.add_argument("--output_dir", default="work_dirs/tatr_det")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--lr_backbone", type=float, default=1e-5)
    p.add_argument("--weight_decay", type=float, default=1e-4)
    p.add_argument("--lr_drop", type=int, default=20)
    p.add_argument("--clip_max_norm", type=float, default=0.1)
    p.add_argument("--num_workers", type=int, default=4)
    p.add_argument("--eval_every", type=int, default=2)
    return p.parse_args()


class CocoPages(Dataset):
    def __init__(self, img_dir, ann_file, processor):
        self.img_dir = img_dir
        with contextlib.redirect_stdout(io.StringIO()):
            self.coco = COCO(ann_file)
        self.ids = sorted(self.coco.getImgIds())
        self.processor = processor

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        image_id = self.ids[i]
        info = self.coco.loadImgs(image_id)[0]
        img = Image.open(os.path.join(self.img_dir, info["file_name"])).convert("RGB")
        anns = self.coco.loadAnns(self.coco.getAnnIds(imgIds=image_id, iscrowd=False))
        target = {"image_id": image_id, "annotations": anns}
        enc = self.processor(images=img, annotations=target, return_tensors="pt")
        return enc["pixel_values"][0], enc["labels"][0]


def make_collate(processor):
    def collate(batch):
        pixel_values = [b[0] for b in batch]
        padded = processor.pad(pixel_values, return_tensors="pt")
        return {
            "pixel_values": padded["pixel_values"],
            "pixel_mask": padded["pixel_mask"],
            "labels": [b[1] for b in batch],
        }
    return collate


@torch.no_grad()
def evaluate(model, loader, processor, coco_gt, device):
    model.eval()
    results = []
    for batch in loader:
        out = model(pixel_values=batch["pixel_values"].to(device), pixel_mask=batch["pixel_mask"].to(device))
        orig_sizes = torch.stack([t["orig_size"] for t in batch["labels"]]).to(device)
        dets = processor.post_process_object_detection(out, threshold=0.0, target_sizes=orig_sizes)
        for t, d in zip(batch["labels"], dets):
            image_id = int(t["image_id"])
            for score, label, box in zip(d["scores"].tolist(), d["labels"].tolist(), d["boxes"].tolist()):
                x0, y0, x1, y1 = box
                results.append({"image_id": image_id, "category_id": label,
                                "bbox": [x0, y0, x1 - x0, y1 - y0], "score": score})
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    model.train()
    if dist.get_rank() != 0:
        return None
    # padded samples of the sampler show up twice, keep one copy
    uniq = {(r["image_id"], r["category_id"], tuple(round(v, 2) for v in r["bbox"])): r
            for part in gathered for r in part}
    dets = list(uniq.values())
    if not dets:
        return 0.0
    coco_dt = coco_gt.loadRes(dets)
    ev = COCOeval(coco_gt, coco_dt, "bbox")
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return ev.stats[0]


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN, format="%(asctime)s %(message)s")

    processor = AutoImageProcessor.from_pretrained(args.checkpoint)
    processor.size = {"shortest_edge": 800, "longest_edge": 1000}

    train_ds = CocoPages(args.img_dir, args.train_json, processor)
    val_ds = CocoPages(args.img_dir, args.val_json, processor)
    collate = make_collate(processor)
    train_sampler = DistributedSampler(train_ds)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=2, sampler=DistributedSampler(val_ds, shuffle=False),
                            collate_fn=collate, num_workers=args.num_workers)

    cats = train_ds.coco.loadCats(train_ds.coco.getCatIds())
    id2label = {c["id"]: c["name"] for c in cats}
    model = TableTransformerForObjectDetection.from_pretrained(
        args.checkpoint, id2label=id2label, label2id={v: k for k, v in id2label.items()},
        ignore_mismatched_sizes=True,
    ).to(device)

    param_groups = [
        {"params": [p for n, p in model.named_parameters() if "backbone" not in n and p.requires_grad]},
        {"params": [p for n, p in model.named_parameters() if "backbone" in n and p.requires_grad],
         "lr": args.lr_backbone},
    ]
    optimizer = torch.optim.AdamW(param_groups, lr=args.lr, weight_decay=args.weight_decay)
    lr_sched = torch.optim.lr_scheduler.StepLR(optimizer, args.lr_drop)
    model = DDP(model, device_ids=[local_rank])

    os.makedirs(args.output_dir, exist_ok=True)
    best_ap = 0.0
    for epoch in range(args.epochs):
        model.train()
        for it, batch in enumerate(train_loader):
            labels = [{k: v.to(device) for k, v in t.items()} for t in batch["labels"]]
            out = model(pixel_values=batch["pixel_values"].to(device),
                        pixel_mask=batch["pixel_mask"].to(device), labels=labels)
            loss = out.loss
            optimizer.zero_grad()
            loss.backward()
            if args.clip_max_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_max_norm)
            optimizer.step()
            if rank == 0 and it % 50 == 0:
                parts = {k: round(v.item(), 4) for k, v in out.loss_dict.items()}
                log.info("epoch %d iter %d/%d loss %.4f %s", epoch, it, len(train_loader), loss.item(), parts)
        lr_sched.step()

        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "lr_sched": lr_sched.state_dict(), "epoch": epoch},
                       os.path.join(args.output_dir, "last.pth"))
        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            ap = evaluate(model, val_loader, processor, val_ds.coco, device)
            if rank == 0:
                log.info("epoch %d AP@[.5:.95] %.4f", epoch, ap)
                if ap > best_ap:
                    best_ap = ap
                    model.module.save_pretrained(os.path.join(args.output_dir, "best"))
                    with open(os.path.join(args.output_dir, "best", "ap.json"), "w") as f:
                        json.dump({"epoch": epoch, "AP": ap}, f)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
