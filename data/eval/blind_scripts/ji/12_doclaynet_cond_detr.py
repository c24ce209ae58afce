"""DocLayNet layout detection (11 classes) with Conditional DETR, multi-GPU.

    torchrun --nproc_per_node=8 12_doclaynet_cond_detr.py --coco_dir /data/DocLayNet_core --epochs 50
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import wandb
from PIL import Image
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from transformers import AutoImageProcessor, ConditionalDetrForObjectDetection

DOCLAYNET = ["Caption", "Footnote", "Formula", "List-item", "Page-footer", "Page-header",
             "Picture", "Section-header", "Table", "Text", "Title"]


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--coco_dir", required=True, help="folder with COCO/{train,val}.json and PNG/")
    ap.add_argument("--ckpt", default="microsoft/conditional-detr-resnet-50")
    ap.add_argument("--out_dir", default="work/doclaynet_cdetr")
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--lr_backbone", type=float, default=1e-5)
    ap.add_argument("--num_workers", type=int, default=8)
    ap.add_argument("--eval_interval", type=int, default=5)
    ap.add_argument("--wandb_project", default="doclaynet")
    return ap.parse_args()


class CocoLayout(Dataset):
    def __init__(self, root, split, processor):
        self.coco = COCO(os.path.join(root, "COCO", f"{split}.json"))
        self.ids = sorted(self.coco.getImgIds())
        self.img_dir = os.path.join(root, "PNG")
        self.processor = processor
        cats = sorted(self.coco.getCatIds())
        self.cat2label = {c: i for i, c in enumerate(cats)}
        self.label2cat = {i: c for c, i in self.cat2label.items()}

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, idx):
        img_id = self.ids[idx]
        info = self.coco.loadImgs(img_id)[0]
        image = Image.open(os.path.join(self.img_dir, info["file_name"])).convert("RGB")
        anns = []
        for a in self.coco.loadAnns(self.coco.getAnnIds(imgIds=img_id)):
            a = dict(a)
            a["category_id"] = self.cat2label[a["category_id"]]
            anns.append(a)
        enc = self.processor(images=image, annotations={"image_id": img_id, "annotations": anns},
                             return_tensors="pt")
        return enc["pixel_values"][0], enc["labels"][0], img_id, (info["height"], info["width"])


def make_collate(processor):
    def collate(batch):
        pix, labels, ids, sizes = zip(*batch)
        padded = processor.pad(list(pix), return_tensors="pt")
        return padded["pixel_values"], padded["pixel_mask"], list(labels), list(ids), torch.tensor(sizes)
    return collate


@torch.no_grad()
def coco_eval(model, loader, processor, dataset, device, rank, world):
    model.eval()
    results = []
    for pix, mask, _, ids, sizes in loader:
        out = model(pixel_values=pix.to(device), pixel_mask=mask.to(device))
        dets = processor.post_process_object_detection(out, threshold=0.01, target_sizes=sizes.to(device))
        for img_id, d in zip(ids, dets):
            for box, score, lab in zip(d["boxes"].tolist(), d["scores"].tolist(), d["labels"].tolist()):
                x0, y0, x1, y1 = box
                results.append({"image_id": img_id, "category_id": dataset.label2cat[lab],
                                "bbox": [x0, y0, x1 - x0, y1 - y0], "score": score})
    parts = [None] * world
    dist.all_gather_object(parts, results)
    model.train()
    if rank != 0:
        return None
    results = [r for p in parts for r in p]
    if not results:
        return 0.0
    ev = COCOeval(dataset.coco, dataset.coco.loadRes(results), "bbox")
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return float(ev.stats[0])


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    processor = AutoImageProcessor.from_pretrained(args.ckpt)
    train_set = CocoLayout(args.coco_dir, "train", processor)
    val_set = CocoLayout(args.coco_dir, "val", processor)
    collate = make_collate(processor)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=args.num_workers,
                              collate_fn=collate, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, list(range(rank, len(val_set), world))), batch_size=args.batch_size,
                            num_workers=args.num_workers, collate_fn=collate)

    model = ConditionalDetrForObjectDetection.from_pretrained(
        args.ckpt, num_labels=len(DOCLAYNET), id2label=dict(enumerate(DOCLAYNET)),
        label2id={n: i for i, n in enumerate(DOCLAYNET)}, ignore_mismatched_sizes=True,
    ).to(device)
    model = DDP(model, device_ids=[local_rank])

    param_groups = [
        {"params": [p for n, p in model.module.named_parameters() if "backbone" not in n and p.requires_grad]},
        {"params": [p for n, p in model.module.named_parameters() if "backbone" in n and p.requires_grad],
         "lr": args.lr_backbone},
    ]
    optimizer = torch.optim.AdamW(param_groups, lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[int(args.epochs * 0.8)], gamma=0.1)

    if rank == 0:
        wandb.init(project=args.wandb_project, config=vars(args), name=f"cdetr-{world}gpu")
        os.makedirs(args.out_dir, exist_ok=True)

    best_map, step = 0.0, 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for pix, mask, labels, _, _ in train_loader:
            labels = [{k: v.to(device) for k, v in t.items()} for t in labels]
            out = model(pixel_values=pix.to(device, non_blocking=True),
                        pixel_mask=mask.to(device, non_blocking=True), labels=labels)
            optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            optimizer.step()
            step += 1
            if rank == 0 and step % 50 == 0:
                wandb.log({"train/loss": out.loss.item(),
                           **{f"train/{k}": v.item() for k, v in out.loss_dict.items()},
                           "lr": optimizer.param_groups[0]["lr"]}, step=step)
        scheduler.step()
        if rank == 0:
            print(f"epoch {epoch} done in {(time.time() - t0) / 60:.1f} min", flush=True)

        if (epoch + 1) % args.eval_interval == 0 or epoch + 1 == args.epochs:
            m = coco_eval(model.module, val_loader, processor, val_set, device, rank, world)
            if rank == 0:
                wandb.log({"val/mAP": m, "epoch": epoch}, step=step)
                model.module.save_pretrained(os.path.join(args.out_dir, "last"))
                if m > best_map:
                    best_map = m
                    model.module.save_pretrained(os.path.join(args.out_dir, "best"))
                    processor.save_pretrained(os.path.join(args.out_dir, "best"))
            dist.barrier()

    if rank == 0:
        wandb.summary["best_mAP"] = best_map
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
