"""Grounding-DINO variant with a large language tower (roberta-large), trained with
FSDP on Objects365 + GoldG and evaluated zero-shot on COCO val2017.

    torchrun --nproc_per_node=8 17_gdino_fsdp_textenc.py --save-dir /mnt/shared/gdino_rl
"""
import argparse
import functools
import itertools
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms.functional as TF
from PIL import Image
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from scipy.optimize import linear_sum_assignment
from torch.distributed.fsdp import (FullStateDictConfig, FullyShardedDataParallel as FSDP, MixedPrecision,
                                    ShardingStrategy, StateDictType)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import convnext_base, ConvNeXt_Base_Weights
from torchvision.ops import box_convert, generalized_box_iou, sigmoid_focal_loss
from transformers import AutoModel, AutoTokenizer
from transformers.models.roberta.modeling_roberta import RobertaLayer

MAX_LEN = 256


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-json", default="/mnt/shared/data/o365_goldg_grounding.json")
    p.add_argument("--image-root", default="/mnt/shared/data/images")
    p.add_argument("--coco", default="/mnt/shared/data/coco")
    p.add_argument("--save-dir", default="/mnt/shared/gdino_rl")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-4, help="per 64 images")
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class GroundingJson(Dataset):
    """One record per image: file, caption, boxes (xywh px), tokens_positive (char spans per box)."""

    def __init__(self, path, root, tok):
        with open(path) as f:
            self.recs = json.load(f)
        self.root, self.tok = root, tok

    def __len__(self):
        return len(self.recs)

    def __getitem__(self, i):
        r = self.recs[i]
        img = Image.open(os.path.join(self.root, r["file"])).convert("RGB")
        w, h = img.size
        s = min(800 / min(w, h), 1333 / max(w, h))
        img = TF.normalize(TF.to_tensor(TF.resize(img, [int(h * s), int(w * s)])),
                           [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        enc = self.tok(r["caption"], max_length=MAX_LEN, truncation=True, padding="max_length")
        pm = torch.zeros(len(r["boxes"]), MAX_LEN)
        for k, spans in enumerate(r["tokens_positive"]):
            for cs, ce in spans:
                a, b = enc.char_to_token(cs), enc.char_to_token(ce - 1)
                if a is not None and b is not None:
                    pm[k, a: b + 1] = 1
        boxes = box_convert(torch.tensor(r["boxes"], dtype=torch.float32).reshape(-1, 4), "xywh", "cxcywh")
        return img, torch.tensor(enc["input_ids"]), torch.tensor(enc["attention_mask"]), {
            "boxes": boxes / torch.tensor([w, h, w, h]), "positive_map": pm}


class CocoVal(Dataset):
    def __init__(self, root):
        self.coco = COCO(os.path.join(root, "annotations/instances_val2017.json"))
        self.ids = sorted(self.coco.getImgIds())
        self.root = root

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        info = self.coco.loadImgs(self.ids[i])[0]
        img = Image.open(os.path.join(self.root, "val2017", info["file_name"])).convert("RGB")
        w, h = img.size
        s = min(800 / min(w, h), 1333 / max(w, h))
        img = TF.normalize(TF.to_tensor(TF.resize(img, [int(h * s), int(w * s)])),
                           [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        return img, info["id"], (w, h)


def pad(imgs):
    H, W = max(i.shape[1] for i in imgs), max(i.shape[2] for i in imgs)
    x = torch.zeros(len(imgs), 3, H, W)
    for k, im in enumerate(imgs):
        x[k, :, : im.shape[1], : im.shape[2]] = im
    return x


def train_collate(b):
    imgs, ids, am, t = zip(*b)
    return pad(imgs), torch.stack(ids), torch.stack(am), list(t)


def val_collate(b):
    imgs, ids, sizes = zip(*b)
    return pad(imgs), list(ids), list(sizes)


class CrossLayer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.v = nn.TransformerDecoderLayer(d, 8, 1024, batch_first=True, norm_first=True)
        self.t = nn.TransformerDecoderLayer(d, 8, 1024, batch_first=True, norm_first=True)

    def forward(self, v, t, pad_mask):
        return self.v(v, t, memory_key_padding_mask=pad_mask), self.t(t, v, tgt_key_padding_mask=pad_mask)


class GDinoRL(nn.Module):
    def __init__(self, d=256, nq=900):
        super().__init__()
        self.backbone = convnext_base(weights=ConvNeXt_Base_Weights.IMAGENET1K_V1).features
        self.vproj = nn.Conv2d(1024, d, 1)
        self.text = AutoModel.from_pretrained("roberta-large", add_pooling_layer=False)
        self.tproj = nn.Linear(1024, d)
        self.cross = nn.ModuleList(CrossLayer(d) for _ in range(6))
        self.queries = nn.Embedding(nq, d)
        self.decoder = nn.ModuleList(nn.TransformerDecoderLayer(d, 8, 2048, batch_first=True) for _ in range(6))
        self.bbox = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 4))

    def forward(self, x, ids, am):
        v = self.vproj(self.backbone(x)).flatten(2).transpose(1, 2)
        t = self.tproj(self.text(input_ids=ids, attention_mask=am).last_hidden_state)
        pad_mask = ~am.bool()
        for layer in self.cross:
            v, t = layer(v, t, pad_mask)
        q = self.queries.weight.unsqueeze(0).expand(x.shape[0], -1, -1)
        for layer in self.decoder:
            q = layer(q, v)
        logits = (q @ t.transpose(1, 2) / 16.0).masked_fill(pad_mask[:, None], -1e4)
        return logits, self.bbox(q).sigmoid()


def compute_loss(logits, boxes, tgts):
    logits, boxes = logits.float(), boxes.float()
    n = torch.tensor(float(sum(len(t["boxes"]) for t in tgts)), device=logits.device)
    dist.all_reduce(n)
    n = (n / dist.get_world_size()).clamp(min=1)
    tmap, lb = torch.zeros_like(logits), logits.new_zeros(())
    for b, t in enumerate(tgts):
        if len(t["boxes"]) == 0:
            continue
        tb, pm = t["boxes"], t["positive_map"]
        with torch.no_grad():
            C = -(logits[b].sigmoid() @ (pm / pm.sum(-1, keepdim=True).clamp(min=1)).T) + 5 * torch.cdist(boxes[b], tb, p=1) \
                - 2 * generalized_box_iou(box_convert(boxes[b], "cxcywh", "xyxy"), box_convert(tb, "cxcywh", "xyxy"))
            r, c = linear_sum_assignment(C.cpu())
        tmap[b, r] = pm[c]
        lb = lb + 5 * F.l1_loss(boxes[b, r], tb[c], reduction="sum") + 2 * (1 - generalized_box_iou(
            box_convert(boxes[b, r], "cxcywh", "xyxy"), box_convert(tb[c], "cxcywh", "xyxy")).diag()).sum()
    return (sigmoid_focal_loss(logits, tmap, reduction="sum") + lb) / n


@torch.no_grad()
def coco_zero_shot(model, loader, coco, tok, device):
    model.eval()
    cat_ids = sorted(coco.getCatIds())
    names = [coco.loadCats(c)[0]["name"] for c in cat_ids]
    caption = " . ".join(names) + " ."
    enc = tok(caption, max_length=MAX_LEN, padding="max_length", truncation=True, return_tensors="pt")
    cmap, pos = torch.zeros(len(names), MAX_LEN), 0
    for i, n in enumerate(names):
        s = caption.index(n, pos)
        pos = s + len(n)
        cmap[i, enc.char_to_token(s): enc.char_to_token(pos - 1) + 1] = 1
    cmap = (cmap / cmap.sum(-1, keepdim=True)).to(device)
    ids, am = enc.input_ids.to(device), enc.attention_mask.to(device)
    dets = []
    for x, img_ids, sizes in loader:
        B = x.shape[0]
        logits, boxes = model(x.to(device), ids.expand(B, -1), am.expand(B, -1))
        prob = logits.float().sigmoid() @ cmap.T
        for b in range(B):
            s, idx = prob[b].flatten().topk(100)
            q, c = idx // prob.shape[-1], idx % prob.shape[-1]
            w, h = sizes[b]
            xywh = box_convert(boxes[b, q].float(), "cxcywh", "xywh") * torch.tensor([w, h, w, h], device=device)
            dets += [{"image_id": img_ids[b], "category_id": cat_ids[ci], "bbox": bb, "score": sc}
                     for sc, ci, bb in zip(s.tolist(), c.tolist(), xywh.tolist())]
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, dets)
    model.train()
    if dist.get_rank() != 0:
        return None
    uniq = list({(d["image_id"], d["category_id"], tuple(d["bbox"])): d for d in itertools.chain(*parts)}.values())
    ev = COCOeval(coco, coco.loadRes(uniq), "bbox")
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return ev.stats[0]


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained("roberta-large")
    train_set = GroundingJson(args.train_json, args.image_root, tok)
    val_set = CocoVal(args.coco)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, collate_fn=train_collate,
                        num_workers=args.workers, pin_memory=True)
    val_loader = DataLoader(val_set, 4, sampler=DistributedSampler(val_set, shuffle=False), collate_fn=val_collate,
                            num_workers=args.workers)

    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={RobertaLayer, CrossLayer, nn.TransformerDecoderLayer})
    model = FSDP(GDinoRL(), auto_wrap_policy=policy, device_id=local_rank,
                 sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
                 use_orig_params=True)
    lr = args.lr * args.batch_size * world / 64
    opt = torch.optim.AdamW([
        {"params": [p for n, p in model.named_parameters() if "text." in n], "lr": lr * 0.05},
        {"params": [p for n, p in model.named_parameters() if "text." not in n]},
    ], lr=lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs * len(loader))

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, ids, am, tgts) in enumerate(loader):
            tgts = [{k: v.to(device) for k, v in t.items()} for t in tgts]
            logits, boxes = model(x.to(device, non_blocking=True), ids.to(device), am.to(device))
            loss = compute_loss(logits, boxes, tgts)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(0.1)
            opt.step()
            sched.step()
            if it % 50 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} it {it}/{len(loader)} loss {l.item():.4f} "
                          f"{(time.time() - t0) / (it + 1):.2f}s/it", flush=True)

        ap = coco_zero_shot(model, val_loader, val_set.coco, tok, device)
        if rank == 0:
            print(f"epoch {epoch}: COCO zero-shot AP {ap:.4f}", flush=True)
            os.makedirs(args.save_dir, exist_ok=True)
            cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
                state = model.state_dict()
            torch.save({"model": state, "epoch": epoch, "ap": ap}, os.path.join(args.save_dir, f"epoch{epoch}.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
