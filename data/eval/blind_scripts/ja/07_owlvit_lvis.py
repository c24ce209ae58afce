"""Fine-tune OWL-ViT (HF transformers) on LVIS v1 with text queries, evaluate LVIS box AP.

Each training batch gets one shared query list: the categories present in the
batch plus random negatives up to --num-queries.  Evaluation scores every
patch against all 1203 LVIS class embeddings.

    torchrun --nproc_per_node=8 07_owlvit_lvis.py --lvis /datasets/lvis --coco /datasets/coco
"""
import argparse
import json
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lvis import LVIS, LVISEval, LVISResults
from PIL import Image
from scipy.optimize import linear_sum_assignment
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.ops import box_convert, generalized_box_iou, sigmoid_focal_loss
from transformers import OwlViTForObjectDetection, OwlViTProcessor


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--lvis", default="/datasets/lvis")
    p.add_argument("--coco", default="/datasets/coco")
    p.add_argument("--model", default="google/owlvit-base-patch32")
    p.add_argument("--output", default="checkpoints/owlvit_lvis")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-5, help="lr for a global batch of 64")
    p.add_argument("--num-queries", type=int, default=64)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def clean(name):
    return name.replace("_", " ").replace("(", "").replace(")", "").strip()


class LVISBoxes(Dataset):
    def __init__(self, ann_file, coco_root, processor):
        self.api = LVIS(ann_file)
        self.ids = sorted(self.api.get_img_ids())
        self.coco_root = coco_root
        self.proc = processor
        self.cat_ids = sorted(self.api.get_cat_ids())
        self.label_of = {c: i for i, c in enumerate(self.cat_ids)}

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        img_id = self.ids[i]
        info = self.api.load_imgs([img_id])[0]
        split, fname = info["coco_url"].split("/")[-2:]
        img = Image.open(os.path.join(self.coco_root, split, fname)).convert("RGB")
        w, h = img.size
        anns = self.api.load_anns(self.api.get_ann_ids(img_ids=[img_id]))
        # the processor resizes straight to 768x768, so boxes are normalised per axis
        boxes = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        boxes = box_convert(boxes, "xywh", "cxcywh") / torch.tensor([w, h, w, h])
        labels = torch.tensor([self.label_of[a["category_id"]] for a in anns], dtype=torch.long)
        pixel_values = self.proc(images=img, return_tensors="pt").pixel_values[0]
        return pixel_values, {"boxes": boxes, "labels": labels, "image_id": img_id, "size": (w, h)}


def collate(batch):
    px, tgts = zip(*batch)
    return torch.stack(px), list(tgts)


def make_queries(targets, num_classes, k):
    pos = sorted({l for t in targets for l in t["labels"].tolist()})[:k]
    neg = random.sample([c for c in range(num_classes) if c not in set(pos)], k - len(pos))
    return pos + neg


def detection_loss(logits, boxes, targets, query_labels):
    remap = {c: j for j, c in enumerate(query_labels)}
    tgt = torch.zeros_like(logits)
    l_box = logits.new_zeros(())
    n = max(sum(len(t["labels"]) for t in targets), 1)
    for b, t in enumerate(targets):
        keep = [i for i, l in enumerate(t["labels"].tolist()) if l in remap]
        if not keep:
            continue
        tb = t["boxes"][keep].to(logits.device)
        tl = torch.tensor([remap[t["labels"][i].item()] for i in keep], device=logits.device)
        with torch.no_grad():
            C = -logits[b].sigmoid()[:, tl] + 5 * torch.cdist(boxes[b], tb, p=1) - 2 * generalized_box_iou(
                box_convert(boxes[b], "cxcywh", "xyxy"), box_convert(tb, "cxcywh", "xyxy"))
            pi, ti = linear_sum_assignment(C.cpu())
        tgt[b, pi, tl[ti]] = 1.0
        l_box = l_box + F.l1_loss(boxes[b, pi], tb[ti], reduction="sum") + (1 - generalized_box_iou(
            box_convert(boxes[b, pi], "cxcywh", "xyxy"), box_convert(tb[ti], "cxcywh", "xyxy")).diag()).sum()
    return (sigmoid_focal_loss(logits, tgt, reduction="sum") + l_box) / n


@torch.no_grad()
def class_embeddings(model, processor, names, device):
    out = []
    for i in range(0, len(names), 256):
        enc = processor(text=[f"a photo of a {n}" for n in names[i: i + 256]], return_tensors="pt",
                        padding="max_length", truncation=True).to(device)
        out.append(model.owlvit.get_text_features(**enc))
    return torch.cat(out)


@torch.no_grad()
def run_inference(model, processor, loader, dataset, device, names, topk=300):
    model.eval()
    query = class_embeddings(model, processor, names, device)
    results = []
    for px, tgts in loader:
        px = px.to(device)
        fmap = model.image_embedder(pixel_values=px)[0]
        B, h, w, D = fmap.shape
        feats = fmap.reshape(B, h * w, D)
        logits, _ = model.class_predictor(feats, query[None].expand(B, -1, -1))
        boxes = model.box_predictor(feats, fmap)
        scores = logits.sigmoid()
        for b, t in enumerate(tgts):
            s, idx = scores[b].flatten().topk(topk)
            p, c = idx // scores.shape[-1], idx % scores.shape[-1]
            w, h = t["size"]
            xywh = box_convert(boxes[b, p], "cxcywh", "xywh") * torch.tensor([w, h, w, h], device=device)
            for sc, cl, bb in zip(s.tolist(), c.tolist(), xywh.tolist()):
                results.append({"image_id": t["image_id"], "category_id": dataset.cat_ids[cl],
                                "bbox": bb, "score": sc})
    model.train()
    return results


def lvis_eval(results, ann_file):
    gt = LVIS(ann_file)
    ev = LVISEval(gt, LVISResults(gt, results, max_dets=300), iou_type="bbox")
    ev.run()
    ev.print_results()
    return ev.get_results()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    processor = OwlViTProcessor.from_pretrained(args.model)
    train_ann = os.path.join(args.lvis, "lvis_v1_train.json")
    val_ann = os.path.join(args.lvis, "lvis_v1_val.json")
    train_set = LVISBoxes(train_ann, args.coco, processor)
    val_set = LVISBoxes(val_ann, args.coco, processor)
    names = [clean(c["name"]) for c in train_set.api.load_cats(train_set.cat_ids)]

    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers,
                              collate_fn=collate, drop_last=True, pin_memory=True)
    val_loader = DataLoader(val_set, 16, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.workers, collate_fn=collate)

    model = OwlViTForObjectDetection.from_pretrained(args.model).to(device)
    # the CLIP image-level projection and logit_scale are not on the detection path
    ddp = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    lr = args.lr * args.batch_size * world / 64
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    steps = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 1000) * max(0.0, 1 - s / steps))
    scaler = torch.cuda.amp.GradScaler()

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.time()
        for it, (px, tgts) in enumerate(train_loader):
            qlabels = make_queries(tgts, len(names), args.num_queries)
            enc = processor(text=[[f"a photo of a {names[c]}" for c in qlabels]] * px.shape[0],
                            return_tensors="pt", padding="max_length", truncation=True).to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                out = ddp(pixel_values=px.to(device, non_blocking=True), input_ids=enc.input_ids,
                          attention_mask=enc.attention_mask)
            loss = detection_loss(out.logits.float(), out.pred_boxes.float(), tgts, qlabels)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            if it % 100 == 0:
                avg = loss.detach().clone()
                dist.all_reduce(avg, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} iter {it}/{len(train_loader)} loss {avg.item():.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)

        results = run_inference(model, processor, val_loader, val_set, device, names)
        if rank == 0:
            stats = lvis_eval(results, val_ann)
            print(f"epoch {epoch}: AP {stats['AP']:.4f} APr {stats['APr']:.4f} "
                  f"APc {stats['APc']:.4f} APf {stats['APf']:.4f}", flush=True)
            os.makedirs(args.output, exist_ok=True)
            model.save_pretrained(os.path.join(args.output, f"epoch_{epoch}"))
            with open(os.path.join(args.output, "metrics.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, **{k: float(v) for k, v in stats.items()}}) + "\n")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
