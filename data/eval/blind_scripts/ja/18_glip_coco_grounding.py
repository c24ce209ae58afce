"""GLIP-style grounding detector on COCO, organised like the DETR / MDETR code base
(main(args) + small distributed utils + train_one_epoch / evaluate).

    torchrun --nproc_per_node=8 18_glip_coco_grounding.py --coco_path /data/coco --output_dir out/glip_coco
    torchrun --nproc_per_node=8 18_glip_coco_grounding.py --resume out/glip_coco/checkpoint.pth --eval
"""
import argparse
import datetime
import json
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms.v2 as T
from pycocotools.cocoeval import COCOeval
from scipy.optimize import linear_sum_assignment
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import CocoDetection, wrap_dataset_for_transforms_v2
from torchvision.models import resnet50, ResNet50_Weights
from torchvision.ops import box_convert, generalized_box_iou, sigmoid_focal_loss
from torchvision.ops.misc import FrozenBatchNorm2d
from transformers import AutoModel, AutoTokenizer


# ----------------------------------------------------------------------------- dist utils
def init_distributed_mode(args):
    args.rank = int(os.environ["RANK"])
    args.world_size = int(os.environ["WORLD_SIZE"])
    args.gpu = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(args.gpu)
    dist.init_process_group("nccl", init_method="env://", world_size=args.world_size, rank=args.rank)
    dist.barrier()


def is_main_process():
    return dist.get_rank() == 0


def save_on_master(*a, **kw):
    if is_main_process():
        torch.save(*a, **kw)


def get_args_parser():
    p = argparse.ArgumentParser("GLIP COCO", add_help=False)
    p.add_argument("--coco_path", default="/data/coco")
    p.add_argument("--output_dir", default="out/glip_coco")
    p.add_argument("--lr", default=1e-4, type=float)
    p.add_argument("--lr_backbone", default=1e-5, type=float)
    p.add_argument("--batch_size", default=2, type=int)
    p.add_argument("--weight_decay", default=1e-4, type=float)
    p.add_argument("--epochs", default=24, type=int)
    p.add_argument("--lr_drop", default=20, type=int)
    p.add_argument("--clip_max_norm", default=0.1, type=float)
    p.add_argument("--resume", default="")
    p.add_argument("--start_epoch", default=0, type=int)
    p.add_argument("--eval", action="store_true")
    p.add_argument("--num_workers", default=4, type=int)
    p.add_argument("--seed", default=42, type=int)
    return p


# ----------------------------------------------------------------------------- data
def build_dataset(root, image_set):
    tf = [T.RandomHorizontalFlip(), T.RandomChoice([T.Resize(s, max_size=1333) for s in range(480, 801, 32)])] \
        if image_set == "train" else [T.Resize(800, max_size=1333)]
    tf += [T.ToImage(), T.ToDtype(torch.float32, scale=True), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
           T.SanitizeBoundingBoxes()]
    ds = CocoDetection(f"{root}/{image_set}2017", f"{root}/annotations/instances_{image_set}2017.json",
                       transforms=T.Compose(tf))
    return wrap_dataset_for_transforms_v2(ds, target_keys=["image_id", "boxes", "labels"])


def collate_fn(batch):
    imgs, tgts = zip(*batch)
    H, W = max(i.shape[-2] for i in imgs), max(i.shape[-1] for i in imgs)
    x = torch.zeros(len(imgs), 3, H, W)
    out = []
    for k, (im, t) in enumerate(zip(imgs, tgts)):
        x[k, :, : im.shape[-2], : im.shape[-1]] = im
        h, w = im.shape[-2:]
        b = torch.as_tensor(t.get("boxes", torch.zeros(0, 4)), dtype=torch.float32)
        out.append({"image_id": t["image_id"], "boxes": box_convert(b, "xyxy", "cxcywh") / torch.tensor([w, h, w, h]),
                    "cats": torch.as_tensor(t.get("labels", torch.zeros(0)), dtype=torch.long)})
    return x, out


class Prompt:
    def __init__(self, coco, tok, max_len=256):
        self.cat_ids = sorted(coco.getCatIds())
        names = [coco.loadCats(c)[0]["name"] for c in self.cat_ids]
        self.text = ". ".join(names) + "."
        enc = tok(self.text, padding="max_length", max_length=max_len, return_tensors="pt")
        self.input_ids, self.attention_mask = enc.input_ids, enc.attention_mask
        self.token_map = torch.zeros(len(names), max_len)
        pos = 0
        for i, n in enumerate(names):
            s = self.text.index(n, pos)
            pos = s + len(n)
            self.token_map[i, enc.char_to_token(s): enc.char_to_token(pos - 1) + 1] = 1
        self.cat_to_label = torch.zeros(max(self.cat_ids) + 1, dtype=torch.long)
        for i, c in enumerate(self.cat_ids):
            self.cat_to_label[c] = i


# ----------------------------------------------------------------------------- model
class GLIP(nn.Module):
    def __init__(self, d=256, nq=300):
        super().__init__()
        r = resnet50(weights=ResNet50_Weights.IMAGENET1K_V2, norm_layer=FrozenBatchNorm2d)
        self.backbone = nn.Sequential(*list(r.children())[:-2])
        self.input_proj = nn.Conv2d(2048, d, 1)
        self.lang = AutoModel.from_pretrained("bert-base-uncased", add_pooling_layer=False)
        self.lang_proj = nn.Linear(768, d)
        self.vl_fuse = nn.ModuleList(nn.MultiheadAttention(d, 8, batch_first=True) for _ in range(4))
        self.query = nn.Embedding(nq, d)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 8, 1024, batch_first=True), 6)
        self.bbox_embed = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 4))

    def forward(self, x, ids, am):
        v = self.input_proj(self.backbone(x)).flatten(2).transpose(1, 2)
        t = self.lang_proj(self.lang(input_ids=ids, attention_mask=am).last_hidden_state)
        for attn in self.vl_fuse:
            v = v + attn(v, t, t, key_padding_mask=~am.bool())[0]
        hs = self.decoder(self.query.weight.expand(x.shape[0], -1, -1), v)
        logits = (hs @ t.transpose(1, 2) / 16.0).masked_fill(~am.bool()[:, None], -1e4)
        return logits, self.bbox_embed(hs).sigmoid()


def criterion(logits, boxes, targets, token_map):
    n = torch.tensor(float(sum(len(t["labels"]) for t in targets)), device=logits.device)
    dist.all_reduce(n)
    n = (n / dist.get_world_size()).clamp(min=1)
    norm = token_map / token_map.sum(-1, keepdim=True)
    tmap, lb = torch.zeros_like(logits), logits.new_zeros(())
    for b, t in enumerate(targets):
        if len(t["labels"]) == 0:
            continue
        tb, tl = t["boxes"], t["labels"]
        with torch.no_grad():
            C = -2 * (logits[b].sigmoid() @ norm.T)[:, tl] + 5 * torch.cdist(boxes[b], tb, p=1) - 2 * generalized_box_iou(
                box_convert(boxes[b], "cxcywh", "xyxy"), box_convert(tb, "cxcywh", "xyxy"))
            r, c = linear_sum_assignment(C.cpu())
        tmap[b, r] = token_map[tl[c]]
        lb = lb + 5 * F.l1_loss(boxes[b, r], tb[c], reduction="sum") + 2 * (1 - generalized_box_iou(
            box_convert(boxes[b, r], "cxcywh", "xyxy"), box_convert(tb[c], "cxcywh", "xyxy")).diag()).sum()
    return (sigmoid_focal_loss(logits, tmap, reduction="sum") + lb) / n


# ----------------------------------------------------------------------------- engine
def train_one_epoch(model, loader, optimizer, prompt, device, epoch, max_norm):
    model.train()
    ids, am = prompt.input_ids.to(device), prompt.attention_mask.to(device)
    token_map = prompt.token_map.to(device)
    running = torch.zeros(2, device=device)
    for x, tgts in loader:
        tgts = [{"boxes": t["boxes"].to(device), "labels": prompt.cat_to_label[t["cats"]].to(device)} for t in tgts]
        B = x.shape[0]
        logits, boxes = model(x.to(device, non_blocking=True), ids.expand(B, -1), am.expand(B, -1))
        loss = criterion(logits, boxes, tgts, token_map)
        optimizer.zero_grad()
        loss.backward()
        if max_norm > 0:
            nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        running += torch.stack([loss.detach(), torch.ones((), device=device)])
    dist.all_reduce(running)
    return {"loss": (running[0] / running[1]).item()}


@torch.no_grad()
def evaluate(model, loader, prompt, coco, device):
    model.eval()
    ids, am = prompt.input_ids.to(device), prompt.attention_mask.to(device)
    norm = (prompt.token_map / prompt.token_map.sum(-1, keepdim=True)).to(device)
    results = []
    for x, tgts in loader:
        B = x.shape[0]
        logits, boxes = model(x.to(device), ids.expand(B, -1), am.expand(B, -1))
        prob = logits.sigmoid() @ norm.T
        for b, t in enumerate(tgts):
            info = coco.loadImgs(t["image_id"])[0]
            s, idx = prob[b].flatten().topk(100)
            q, c = idx // prob.shape[-1], idx % prob.shape[-1]
            wh = torch.tensor([info["width"], info["height"]] * 2, device=device)
            xywh = box_convert(boxes[b, q], "cxcywh", "xywh") * wh
            results += [{"image_id": t["image_id"], "category_id": prompt.cat_ids[ci], "bbox": bb, "score": sc}
                        for sc, ci, bb in zip(s.tolist(), c.tolist(), xywh.tolist())]
    all_res = [None] * dist.get_world_size()
    dist.all_gather_object(all_res, results)
    if not is_main_process():
        return None
    merged = {(r["image_id"], r["category_id"], tuple(r["bbox"])): r for part in all_res for r in part}
    ev = COCOeval(coco, coco.loadRes(list(merged.values())), "bbox")
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return ev.stats.tolist()


def main(args):
    init_distributed_mode(args)
    device = torch.device("cuda", args.gpu)
    seed = args.seed + args.rank
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)

    tok = AutoTokenizer.from_pretrained("bert-base-uncased")
    dataset_train = build_dataset(args.coco_path, "train")
    dataset_val = build_dataset(args.coco_path, "val")
    prompt = Prompt(dataset_val.coco, tok)
    sampler_train = DistributedSampler(dataset_train)
    sampler_val = DistributedSampler(dataset_val, shuffle=False)
    data_loader_train = DataLoader(dataset_train, args.batch_size, sampler=sampler_train, drop_last=True,
                                   collate_fn=collate_fn, num_workers=args.num_workers)
    data_loader_val = DataLoader(dataset_val, args.batch_size, sampler=sampler_val, drop_last=False,
                                 collate_fn=collate_fn, num_workers=args.num_workers)

    model = GLIP().to(device)
    model_without_ddp = model
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
    n_parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    param_dicts = [
        {"params": [p for n, p in model_without_ddp.named_parameters() if not n.startswith(("backbone", "lang."))]},
        {"params": [p for n, p in model_without_ddp.named_parameters() if n.startswith(("backbone", "lang."))],
         "lr": args.lr_backbone},
    ]
    optimizer = torch.optim.AdamW(param_dicts, lr=args.lr, weight_decay=args.weight_decay)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, args.lr_drop)

    output_dir = Path(args.output_dir)
    if args.resume:
        checkpoint = torch.load(args.resume, map_location="cpu")
        model_without_ddp.load_state_dict(checkpoint["model"])
        if not args.eval and "optimizer" in checkpoint:
            optimizer.load_state_dict(checkpoint["optimizer"])
            lr_scheduler.load_state_dict(checkpoint["lr_scheduler"])
            args.start_epoch = checkpoint["epoch"] + 1

    if args.eval:
        evaluate(model_without_ddp, data_loader_val, prompt, dataset_val.coco, device)
        dist.destroy_process_group()
        return

    if is_main_process():
        print(f"number of params: {n_parameters}")
        output_dir.mkdir(parents=True, exist_ok=True)
    start_time = time.time()
    for epoch in range(args.start_epoch, args.epochs):
        sampler_train.set_epoch(epoch)
        train_stats = train_one_epoch(model, data_loader_train, optimizer, prompt, device, epoch, args.clip_max_norm)
        lr_scheduler.step()
        save_on_master({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "lr_scheduler": lr_scheduler.state_dict(), "epoch": epoch, "args": args},
                       output_dir / "checkpoint.pth")
        stats = evaluate(model_without_ddp, data_loader_val, prompt, dataset_val.coco, device)
        if is_main_process():
            log = {"epoch": epoch, "train_loss": train_stats["loss"], "coco_eval_bbox": stats}
            with (output_dir / "log.txt").open("a") as f:
                f.write(json.dumps(log) + "\n")
        dist.barrier()
    if is_main_process():
        print("Training time", str(datetime.timedelta(seconds=int(time.time() - start_time))))
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser("GLIP COCO training", parents=[get_args_parser()])
    main(parser.parse_args())
