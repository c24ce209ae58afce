"""Table structure recognition on PubTables-1M (rows / columns / headers / spanning cells).

Fine-tunes microsoft/table-transformer-structure-recognition with plain DDP.

    torchrun --nproc_per_node=8 02_pubtables_structure_detr.py \
        --data_root /datasets/pubtables-1m/PubTables-1M-Structure --out runs/tsr_ft
"""
import argparse
import glob
import logging
import os
import xml.etree.ElementTree as ET

import torch
import torch.distributed as dist
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from torchmetrics.detection import MeanAveragePrecision
from transformers import AutoImageProcessor, TableTransformerForObjectDetection

log = logging.getLogger(__name__)

CLASSES = [
    "table",
    "table column",
    "table row",
    "table column header",
    "table projected row header",
    "table spanning cell",
]
CLS2ID = {c: i for i, c in enumerate(CLASSES)}


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_root", required=True)
    ap.add_argument("--init", default="microsoft/table-transformer-structure-recognition")
    ap.add_argument("--out", default="runs/tsr")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--lr_backbone", type=float, default=1e-5)
    ap.add_argument("--wd", type=float, default=1e-4)
    ap.add_argument("--clip", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--max_val", type=int, default=2000)
    return ap.parse_args()


def parse_voc(xml_path):
    root = ET.parse(xml_path).getroot()
    anns = []
    for obj in root.iter("object"):
        name = obj.find("name").text
        if name not in CLS2ID:
            continue
        bb = obj.find("bndbox")
        x0, y0, x1, y1 = (float(bb.find(k).text) for k in ("xmin", "ymin", "xmax", "ymax"))
        if x1 <= x0 or y1 <= y0:
            continue
        anns.append({
            "bbox": [x0, y0, x1 - x0, y1 - y0],
            "category_id": CLS2ID[name],
            "area": (x1 - x0) * (y1 - y0),
            "iscrowd": 0,
        })
    return anns


class PubTablesStructure(Dataset):
    def __init__(self, root, split, processor, limit=None):
        self.img_dir = os.path.join(root, "images")
        self.xmls = sorted(glob.glob(os.path.join(root, split, "*.xml")))
        if limit:
            self.xmls = self.xmls[:limit]
        self.processor = processor

    def __len__(self):
        return len(self.xmls)

    def __getitem__(self, idx):
        xml = self.xmls[idx]
        stem = os.path.splitext(os.path.basename(xml))[0]
        image = Image.open(os.path.join(self.img_dir, stem + ".jpg")).convert("RGB")
        target = {"image_id": idx, "annotations": parse_voc(xml)}
        enc = self.processor(images=image, annotations=target, return_tensors="pt")
        return {
            "pixel_values": enc["pixel_values"][0],
            "labels": enc["labels"][0],
            "orig_size": torch.tensor([image.height, image.width]),
        }


class ShardSampler(Sampler):
    """Contiguous, non-padded shard for evaluation: every image is scored exactly once."""

    def __init__(self, n, rank, world):
        per = (n + world - 1) // world
        self.indices = list(range(rank * per, min(n, (rank + 1) * per)))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def make_collate(processor):
    def collate(items):
        padded = processor.pad([it["pixel_values"] for it in items], return_tensors="pt")
        return {
            "pixel_values": padded["pixel_values"],
            "pixel_mask": padded["pixel_mask"],
            "labels": [it["labels"] for it in items],
            "orig_size": torch.stack([it["orig_size"] for it in items]),
        }
    return collate


@torch.no_grad()
def evaluate(net, loader, processor, device):
    net.eval()
    metric = MeanAveragePrecision(box_format="xyxy", iou_type="bbox", class_metrics=True).to(device)
    for batch in loader:
        out = net(pixel_values=batch["pixel_values"].to(device), pixel_mask=batch["pixel_mask"].to(device))
        sizes = batch["orig_size"].to(device)
        dets = processor.post_process_object_detection(out, threshold=0.0, target_sizes=sizes)
        preds = [{"boxes": d["boxes"], "scores": d["scores"], "labels": d["labels"]} for d in dets]
        gts = []
        for lab, (h, w) in zip(batch["labels"], sizes.tolist()):
            cx, cy, bw, bh = lab["boxes"].to(device).unbind(-1)
            boxes = torch.stack([(cx - bw / 2) * w, (cy - bh / 2) * h, (cx + bw / 2) * w, (cy + bh / 2) * h], -1)
            gts.append({"boxes": boxes, "labels": lab["class_labels"].to(device)})
        metric.update(preds, gts)
    # compute() all-gathers the states of every rank before scoring
    res = metric.compute()
    net.train()
    return {k: v.item() for k, v in res.items() if v.numel() == 1}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")

    processor = AutoImageProcessor.from_pretrained(args.init)
    train_set = PubTablesStructure(args.data_root, "train", processor)
    val_set = PubTablesStructure(args.data_root, "val", processor, limit=args.max_val)
    collate = make_collate(processor)

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.bs, sampler=train_sampler, num_workers=args.workers,
                              collate_fn=collate, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=args.bs, sampler=ShardSampler(len(val_set), rank, world),
                            num_workers=args.workers, collate_fn=collate)

    model = TableTransformerForObjectDetection.from_pretrained(
        args.init, num_labels=len(CLASSES), ignore_mismatched_sizes=True,
        id2label=dict(enumerate(CLASSES)), label2id=CLS2ID,
    )
    model.to(device)
    ddp_model = DDP(model, device_ids=[local_rank])

    backbone = [p for n, p in model.named_parameters() if "backbone" in n and p.requires_grad]
    rest = [p for n, p in model.named_parameters() if "backbone" not in n and p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": rest, "lr": args.lr}, {"params": backbone, "lr": args.lr_backbone}],
        weight_decay=args.wd,
    )
    lr_sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=max(1, args.epochs * 2 // 3), gamma=0.1)

    log.info("train=%d val=%d world=%d", len(train_set), len(val_set), world)
    best_map = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        ddp_model.train()
        for it, batch in enumerate(train_loader):
            labels = [{k: v.to(device) for k, v in lab.items()} for lab in batch["labels"]]
            out = ddp_model(pixel_values=batch["pixel_values"].to(device, non_blocking=True),
                            pixel_mask=batch["pixel_mask"].to(device, non_blocking=True),
                            labels=labels)
            loss = out.loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), args.clip)
            optimizer.step()
            if it % 100 == 0:
                parts = {k: round(v.item(), 4) for k, v in out.loss_dict.items()}
                log.info("ep %d it %d/%d loss %.4f %s", epoch, it, len(train_loader), loss.item(), parts)
        lr_sched.step()

        # evaluation runs on the bare module: no DDP hooks, so uneven shards are fine here
        stats = evaluate(model, val_loader, processor, device)
        if rank == 0:
            log.info("epoch %d  mAP %.4f  mAP50 %.4f  mAP75 %.4f", epoch, stats["map"], stats["map_50"], stats["map_75"])
            model.save_pretrained(os.path.join(args.out, "last"))
            processor.save_pretrained(os.path.join(args.out, "last"))
            if stats["map"] > best_map:
                best_map = stats["map"]
                model.save_pretrained(os.path.join(args.out, "best"))
                processor.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    if rank == 0:
        log.info("best structure mAP %.4f", best_map)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
