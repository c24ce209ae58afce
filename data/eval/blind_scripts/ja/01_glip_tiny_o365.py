#!/usr/bin/env python3
"""GLIP-T style grounded pre-training on Objects365.

Detection annotations are turned into grounding prompts ("person. chair. cup. ...")
and the box head is trained with token-level alignment instead of a fixed classifier.
"""
import argparse
import itertools
import json
import os
import random
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms.functional as TF
from PIL import Image
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from scipy.optimize import linear_sum_assignment
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import Swin_T_Weights, swin_t
from torchvision.ops import box_convert, generalized_box_iou, sigmoid_focal_loss
from transformers import AutoModel, AutoTokenizer


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", default="/datasets/objects365")
    p.add_argument("--ann", default="annotations/zhiyuan_objv2_train.json")
    p.add_argument("--text-encoder", default="bert-base-uncased")
    p.add_argument("--coco-root", default="/datasets/coco")
    p.add_argument("--out-dir", default="runs/glip_t_o365")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=4, help="images per GPU")
    p.add_argument("--base-lr", type=float, default=1e-4, help="lr for a global batch of 32")
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--max-query-len", type=int, default=256)
    p.add_argument("--num-queries", type=int, default=300)
    p.add_argument("--cats-per-prompt", type=int, default=40)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args()


class O365Grounding(Dataset):
    def __init__(self, root, ann_file, tokenizer, cats_per_prompt, max_len, size=800):
        with open(os.path.join(root, ann_file)) as f:
            coco = json.load(f)
        self.root = root
        self.images = coco["images"]
        self.cat_names = {c["id"]: c["name"].lower() for c in coco["categories"]}
        self.anns = defaultdict(list)
        for a in coco["annotations"]:
            if a.get("iscrowd", 0) == 0:
                self.anns[a["image_id"]].append(a)
        self.tok = tokenizer
        self.k = cats_per_prompt
        self.max_len = max_len
        self.size = size

    def __len__(self):
        return len(self.images)

    def build_prompt(self, pos_cats):
        negs = [c for c in self.cat_names if c not in pos_cats]
        cats = list(pos_cats)[: self.k]
        cats += random.sample(negs, max(0, self.k - len(cats)))
        random.shuffle(cats)
        caption, spans = "", {}
        for c in cats:
            start = len(caption)
            caption += self.cat_names[c]
            spans[c] = (start, len(caption))
            caption += ". "
        return caption.strip(), spans

    def __getitem__(self, idx):
        info = self.images[idx]
        img = Image.open(os.path.join(self.root, "train", info["file_name"])).convert("RGB")
        w, h = img.size
        anns = [a for a in self.anns[info["id"]] if a["bbox"][2] > 1 and a["bbox"][3] > 1]
        caption, spans = self.build_prompt({a["category_id"] for a in anns})
        anns = [a for a in anns if a["category_id"] in spans]
        boxes = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        boxes = box_convert(boxes, "xywh", "xyxy")
        # random horizontal flip + resize of the short side
        if random.random() < 0.5:
            img = TF.hflip(img)
            boxes[:, [0, 2]] = w - boxes[:, [2, 0]]
        scale = self.size / min(w, h)
        img = TF.resize(img, [int(h * scale), int(w * scale)])
        boxes = boxes * scale
        nh, nw = img.height, img.width
        boxes[:, 0::2].clamp_(0, nw)
        boxes[:, 1::2].clamp_(0, nh)
        keep = (boxes[:, 2] - boxes[:, 0] > 2) & (boxes[:, 3] - boxes[:, 1] > 2)
        boxes = boxes[keep]
        anns = [a for a, k in zip(anns, keep.tolist()) if k]
        enc = self.tok(caption, max_length=self.max_len, truncation=True, return_offsets_mapping=False)
        pos_map = torch.zeros(len(anns), self.max_len)
        for i, a in enumerate(anns):
            s, e = spans[a["category_id"]]
            ts, te = enc.char_to_token(s), enc.char_to_token(e - 1)
            if ts is not None and te is not None:
                pos_map[i, ts: te + 1] = 1.0
        pos_map = pos_map / pos_map.sum(-1, keepdim=True).clamp(min=1)
        boxes_cxcywh = box_convert(boxes, "xyxy", "cxcywh") / torch.tensor([nw, nh, nw, nh])
        img = TF.normalize(TF.to_tensor(img), [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        return img, caption, {"boxes": boxes_cxcywh, "positive_map": pos_map, "image_id": info["id"]}


class CocoZeroShot(Dataset):
    def __init__(self, root, size=800):
        self.coco = COCO(os.path.join(root, "annotations", "instances_val2017.json"))
        self.ids = sorted(self.coco.getImgIds())
        self.root, self.size = root, size

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        info = self.coco.loadImgs(self.ids[i])[0]
        img = Image.open(os.path.join(self.root, "val2017", info["file_name"])).convert("RGB")
        w, h = img.size
        scale = self.size / min(w, h)
        img = TF.resize(img, [int(h * scale), int(w * scale)])
        img = TF.normalize(TF.to_tensor(img), [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        return img, "", {"image_id": info["id"], "size": (w, h)}


def collate(batch):
    imgs, caps, targets = zip(*batch)
    H = max(i.shape[1] for i in imgs)
    W = max(i.shape[2] for i in imgs)
    out = torch.zeros(len(imgs), 3, H, W)
    mask = torch.ones(len(imgs), H, W, dtype=torch.bool)
    for k, im in enumerate(imgs):
        out[k, :, : im.shape[1], : im.shape[2]] = im
        mask[k, : im.shape[1], : im.shape[2]] = False
    return out, mask, list(caps), list(targets)


class GLIPTiny(nn.Module):
    def __init__(self, text_encoder, num_queries=300, d=256, max_len=256):
        super().__init__()
        self.backbone = swin_t(weights=Swin_T_Weights.IMAGENET1K_V1).features
        self.img_proj = nn.Linear(768, d)
        self.text = AutoModel.from_pretrained(text_encoder, add_pooling_layer=False)
        self.text_proj = nn.Linear(self.text.config.hidden_size, d)
        self.fusion = nn.ModuleList([nn.MultiheadAttention(d, 8, batch_first=True) for _ in range(2)])
        self.query = nn.Embedding(num_queries, d)
        layer = nn.TransformerDecoderLayer(d, 8, 1024, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, 6)
        self.box_head = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 4))
        self.logit_scale = nn.Parameter(torch.tensor(2.3))
        self.max_len = max_len

    def forward(self, images, input_ids, attn_mask):
        feats = self.backbone(images)  # B, h, w, 768
        mem = self.img_proj(feats.flatten(1, 2))
        txt = self.text_proj(self.text(input_ids=input_ids, attention_mask=attn_mask).last_hidden_state)
        for attn in self.fusion:
            mem = mem + attn(mem, txt, txt, key_padding_mask=~attn_mask.bool())[0]
        q = self.query.weight.unsqueeze(0).expand(images.shape[0], -1, -1)
        hs = self.decoder(q, mem)
        boxes = self.box_head(hs).sigmoid()
        logits = torch.einsum("bqd,btd->bqt", F.normalize(hs, dim=-1), F.normalize(txt, dim=-1))
        logits = logits * self.logit_scale.exp()
        logits = logits.masked_fill(~attn_mask.bool()[:, None, :], -1e4)
        return logits, boxes


@torch.no_grad()
def hungarian(logits, boxes, targets):
    idx = []
    for b, t in enumerate(targets):
        if len(t["boxes"]) == 0:
            idx.append((torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)))
            continue
        prob = logits[b].sigmoid()
        cost_cls = -(prob @ t["positive_map"].T)
        cost_l1 = torch.cdist(boxes[b], t["boxes"], p=1)
        cost_giou = -generalized_box_iou(box_convert(boxes[b], "cxcywh", "xyxy"),
                                         box_convert(t["boxes"], "cxcywh", "xyxy"))
        C = (2 * cost_cls + 5 * cost_l1 + 2 * cost_giou).float().cpu()
        r, c = linear_sum_assignment(C)
        idx.append((torch.as_tensor(r, dtype=torch.long), torch.as_tensor(c, dtype=torch.long)))
    return idx


def grounding_loss(logits, boxes, targets, world_size):
    idx = hungarian(logits, boxes, targets)
    num_boxes = torch.tensor([sum(len(t["boxes"]) for t in targets)], dtype=torch.float, device=logits.device)
    dist.all_reduce(num_boxes)
    num_boxes = (num_boxes / world_size).clamp(min=1).item()
    tgt_map = torch.zeros_like(logits)
    src_boxes, tgt_boxes = [], []
    for b, (r, c) in enumerate(idx):
        tgt_map[b, r] = (targets[b]["positive_map"][c] > 0).float()
        src_boxes.append(boxes[b, r])
        tgt_boxes.append(targets[b]["boxes"][c])
    loss_cls = sigmoid_focal_loss(logits, tgt_map, reduction="sum") / num_boxes
    src_boxes, tgt_boxes = torch.cat(src_boxes), torch.cat(tgt_boxes)
    loss_l1 = F.l1_loss(src_boxes, tgt_boxes, reduction="sum") / num_boxes
    loss_giou = (1 - torch.diag(generalized_box_iou(box_convert(src_boxes, "cxcywh", "xyxy"),
                                                    box_convert(tgt_boxes, "cxcywh", "xyxy")))).sum() / num_boxes
    return {"cls": loss_cls, "l1": 5 * loss_l1, "giou": 2 * loss_giou}


@torch.no_grad()
def coco_zero_shot(model, loader, coco, tokenizer, max_len, device):
    model.eval()
    cat_ids = sorted(coco.getCatIds())
    names = [coco.loadCats(c)[0]["name"] for c in cat_ids]
    caption = ". ".join(names) + "."
    enc = tokenizer(caption, padding="max_length", max_length=max_len, truncation=True, return_tensors="pt")
    cmap, pos = torch.zeros(len(names), max_len), 0
    for i, n in enumerate(names):
        s = caption.index(n, pos)
        pos = s + len(n)
        cmap[i, enc.char_to_token(s): enc.char_to_token(pos - 1) + 1] = 1
    cmap = (cmap / cmap.sum(-1, keepdim=True)).to(device)
    ids, am = enc.input_ids.to(device), enc.attention_mask.to(device)
    dets = []
    for images, _, _, metas in loader:
        B = images.shape[0]
        logits, boxes = model(images.to(device), ids.expand(B, -1), am.expand(B, -1))
        prob = logits.sigmoid() @ cmap.T
        for b, m in enumerate(metas):
            sc, idx = prob[b].flatten().topk(100)
            q, c = idx // prob.shape[-1], idx % prob.shape[-1]
            w, h = m["size"]
            xywh = box_convert(boxes[b, q], "cxcywh", "xywh") * torch.tensor([w, h, w, h], device=device)
            dets += [{"image_id": m["image_id"], "category_id": cat_ids[ci], "bbox": bb, "score": s_}
                     for s_, ci, bb in zip(sc.tolist(), c.tolist(), xywh.tolist())]
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, dets)
    model.train()
    if dist.get_rank() != 0:
        return None
    uniq = {(d["image_id"], d["category_id"], tuple(d["bbox"])): d for d in itertools.chain(*parts)}
    ev = COCOeval(coco, coco.loadRes(list(uniq.values())), "bbox")
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return ev.stats[0]


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    tokenizer = AutoTokenizer.from_pretrained(args.text_encoder)
    dataset = O365Grounding(args.data_root, args.ann, tokenizer, args.cats_per_prompt, args.max_query_len)
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        collate_fn=collate, pin_memory=True, persistent_workers=True)
    val_set = CocoZeroShot(args.coco_root)
    val_loader = DataLoader(val_set, batch_size=4, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.workers, collate_fn=collate)

    model = GLIPTiny(args.text_encoder, args.num_queries, max_len=args.max_query_len).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.base_lr * args.batch_size * world_size / 32
    params = [
        {"params": [p for n, p in model.named_parameters() if "module.text." not in n]},
        {"params": [p for n, p in model.named_parameters() if "module.text." in n], "lr": lr * 0.1},
    ]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=args.weight_decay)
    total_steps = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [int(0.67 * total_steps), int(0.89 * total_steps)])
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for images, masks, captions, targets in loader:
            if sum(len(t["boxes"]) for t in targets) == 0:
                continue
            images = images.to(device, non_blocking=True)
            enc = tokenizer(captions, padding="max_length", max_length=args.max_query_len,
                            truncation=True, return_tensors="pt").to(device)
            targets = [{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in t.items()} for t in targets]
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                logits, boxes = model(images, enc.input_ids, enc.attention_mask)
            losses = grounding_loss(logits.float(), boxes.float(), targets, world_size)
            loss = sum(losses.values())
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            if step % args.log_every == 0:
                logged = torch.stack([v.detach() for v in losses.values()])
                dist.all_reduce(logged)
                logged /= world_size
                if rank == 0:
                    msg = " ".join(f"{k}={v:.4f}" for k, v in zip(losses, logged.tolist()))
                    print(f"ep {epoch} step {step} {msg} lr={scheduler.get_last_lr()[0]:.2e} "
                          f"{(time.time() - t0) / args.log_every:.2f}s/it", flush=True)
                    t0 = time.time()
        ap = coco_zero_shot(model.module, val_loader, val_set.coco, tokenizer, args.max_query_len, device)
        if rank == 0:
            print(f"epoch {epoch} COCO zero-shot AP {ap:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(args.out_dir, f"checkpoint_{epoch:02d}.pth"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
