"""Grounding detector trained on a mix of detection data (Objects365, prompt made of
class names) and grounding data (GoldG, free-form captions with phrase spans).

Both sources are converted to the same target format: boxes + a positive map
over the prompt tokens, so one batch can mix them.

    torchrun --nproc_per_node=8 11_grounding_mixed_data.py --o365 /data/o365 --goldg /data/goldg
"""
import argparse
import itertools
import json
import os
import random
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import resnet50, ResNet50_Weights
from torchvision.ops import box_convert, generalized_box_iou, sigmoid_focal_loss
from torchvision.ops.misc import FrozenBatchNorm2d
from transformers import AutoModel, AutoTokenizer

MAX_LEN = 256


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--o365", default="/data/o365")
    p.add_argument("--goldg", default="/data/goldg")
    p.add_argument("--coco", default="/data/coco")
    p.add_argument("--out", default="runs/mixed_r50")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4, help="for 8 GPUs x 4 images")
    p.add_argument("--dec-layers", type=int, default=6)
    p.add_argument("--aux-loss", action="store_true", help="deep supervision on every decoder layer")
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def resize_norm(img, boxes_xyxy):
    w, h = img.size
    s = min(800 / min(w, h), 1333 / max(w, h))
    img = TF.resize(img, [int(h * s), int(w * s)])
    boxes = box_convert(boxes_xyxy, "xyxy", "cxcywh") / torch.tensor([w, h, w, h])
    return TF.normalize(TF.to_tensor(img), [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]), boxes


def positive_map(tok, text, spans_per_box):
    enc = tok(text, truncation=True, max_length=MAX_LEN)
    m = torch.zeros(len(spans_per_box), MAX_LEN)
    for k, spans in enumerate(spans_per_box):
        for s, e in spans:
            a, b = enc.char_to_token(s), enc.char_to_token(e - 1)
            if a is not None and b is not None:
                m[k, a: b + 1] = 1
    return m


class O365AsGrounding(Dataset):
    def __init__(self, root, tok, k=60):
        with open(os.path.join(root, "zhiyuan_objv2_train.json")) as f:
            d = json.load(f)
        self.names = {c["id"]: c["name"] for c in d["categories"]}
        by_img = {}
        for a in d["annotations"]:
            by_img.setdefault(a["image_id"], []).append(a)
        self.items = [(im["file_name"], by_img[im["id"]]) for im in d["images"] if im["id"] in by_img]
        self.root, self.tok, self.k = root, tok, k

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        fname, anns = self.items[i]
        img = Image.open(os.path.join(self.root, "images", fname)).convert("RGB")
        pos = list({a["category_id"] for a in anns})[: self.k]
        cats = pos + random.sample([c for c in self.names if c not in pos], self.k - len(pos))
        random.shuffle(cats)
        text, span = "", {}
        for c in cats:
            span[c] = (len(text), len(text) + len(self.names[c]))
            text += self.names[c] + ". "
        anns = [a for a in anns if a["category_id"] in span]
        boxes = box_convert(torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4), "xywh", "xyxy")
        pmap = positive_map(self.tok, text, [[span[a["category_id"]]] for a in anns])
        img, boxes = resize_norm(img, boxes)
        return img, text, {"boxes": boxes, "positive_map": pmap}


class GoldG(Dataset):
    def __init__(self, root, tok):
        with open(os.path.join(root, "final_mixed_train_no_coco.json")) as f:
            d = json.load(f)
        by_img = {}
        for a in d["annotations"]:
            by_img.setdefault(a["image_id"], []).append(a)
        self.items = [(im, by_img.get(im["id"], [])) for im in d["images"]]
        self.root, self.tok = root, tok

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        im, anns = self.items[i]
        img = Image.open(os.path.join(self.root, "images", im["file_name"])).convert("RGB")
        boxes = box_convert(torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4), "xywh", "xyxy")
        pmap = positive_map(self.tok, im["caption"], [a["tokens_positive"] for a in anns])
        img, boxes = resize_norm(img, boxes)
        return img, im["caption"], {"boxes": boxes, "positive_map": pmap}


class CocoVal(Dataset):
    """COCO val2017 images for zero-shot evaluation with the 80 class names as prompt."""

    def __init__(self, root):
        self.coco = COCO(os.path.join(root, "annotations/instances_val2017.json"))
        self.ids = sorted(self.coco.getImgIds())
        self.root = root
        self.cat_ids = sorted(self.coco.getCatIds())
        names = [self.coco.loadCats(c)[0]["name"] for c in self.cat_ids]
        self.prompt, self.spans = "", []
        for n in names:
            self.spans.append([(len(self.prompt), len(self.prompt) + len(n))])
            self.prompt += n + ". "

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        info = self.coco.loadImgs(self.ids[i])[0]
        img = Image.open(os.path.join(self.root, "val2017", info["file_name"])).convert("RGB")
        img, _ = resize_norm(img, torch.zeros(0, 4))
        return img, self.prompt, {"image_id": info["id"], "size": (info["width"], info["height"])}


def collate(batch):
    imgs, texts, tgts = zip(*batch)
    H, W = max(i.shape[1] for i in imgs), max(i.shape[2] for i in imgs)
    x = torch.zeros(len(imgs), 3, H, W)
    for k, im in enumerate(imgs):
        x[k, :, : im.shape[1], : im.shape[2]] = im
    return x, list(texts), list(tgts)


class MLP(nn.Sequential):
    def __init__(self, d, out, n=3):
        layers = []
        for i in range(n - 1):
            layers += [nn.Linear(d, d), nn.ReLU()]
        super().__init__(*layers, nn.Linear(d, out))


class Grounder(nn.Module):
    def __init__(self, dec_layers=6, aux_loss=False, d=256, nq=300):
        super().__init__()
        r = resnet50(weights=ResNet50_Weights.IMAGENET1K_V2, norm_layer=FrozenBatchNorm2d)
        self.backbone = nn.Sequential(*list(r.children())[:-2])
        self.input_proj = nn.Conv2d(2048, d, 1)
        self.text = AutoModel.from_pretrained("bert-base-uncased", add_pooling_layer=False)
        self.text_proj = nn.Linear(768, d)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 8, 1024, batch_first=True), 6)
        self.query = nn.Embedding(nq, d)
        self.dec = nn.ModuleList(nn.TransformerDecoderLayer(d, 8, 1024, batch_first=True) for _ in range(dec_layers))
        self.bbox_embed = nn.ModuleList(MLP(d, 4) for _ in range(dec_layers))
        self.norm = nn.LayerNorm(d)
        self.aux_loss = aux_loss

    def forward(self, images, ids, am):
        v = self.input_proj(self.backbone(images)).flatten(2).transpose(1, 2)
        t = self.text_proj(self.text(input_ids=ids, attention_mask=am).last_hidden_state)
        pad = ~am.bool()
        mem = self.encoder(torch.cat([v, t], 1), src_key_padding_mask=torch.cat([torch.zeros_like(v[..., 0], dtype=torch.bool), pad], 1))
        v, t = mem[:, : v.shape[1]], mem[:, v.shape[1]:]
        q = self.query.weight.expand(images.shape[0], -1, -1)
        outs = []
        for lid, layer in enumerate(self.dec):
            q = layer(q, v)
            if self.aux_loss or lid == len(self.dec) - 1:
                hq = self.norm(q)
                logits = (hq @ t.transpose(1, 2) / 16.0).masked_fill(pad[:, None], -1e4)
                outs.append((logits, self.bbox_embed[lid](hq).sigmoid()))
        return outs


def match_and_loss(logits, boxes, targets, num_boxes):
    tgt = torch.zeros_like(logits)
    l_box = logits.new_zeros(())
    for b, t in enumerate(targets):
        if len(t["boxes"]) == 0:
            continue
        tb, pm = t["boxes"], t["positive_map"]
        with torch.no_grad():
            C = -(logits[b].sigmoid() @ (pm / pm.sum(-1, keepdim=True).clamp(min=1)).T) + 5 * torch.cdist(boxes[b], tb, p=1) \
                - 2 * generalized_box_iou(box_convert(boxes[b], "cxcywh", "xyxy"), box_convert(tb, "cxcywh", "xyxy"))
            r, c = linear_sum_assignment(C.cpu())
        tgt[b, r] = pm[c]
        l_box = l_box + 5 * F.l1_loss(boxes[b, r], tb[c], reduction="sum") + 2 * (1 - generalized_box_iou(
            box_convert(boxes[b, r], "cxcywh", "xyxy"), box_convert(tb[c], "cxcywh", "xyxy")).diag()).sum()
    return (sigmoid_focal_loss(logits, tgt, reduction="sum") + l_box) / num_boxes


@torch.no_grad()
def evaluate(model, loader, val_set, tok, device):
    model.eval()
    cmap = positive_map(tok, val_set.prompt, val_set.spans).to(device)
    cmap = cmap / cmap.sum(-1, keepdim=True).clamp(min=1)
    dets = []
    for images, texts, metas in loader:
        enc = tok(texts, padding="max_length", truncation=True, max_length=MAX_LEN, return_tensors="pt").to(device)
        logits, boxes = model(images.to(device), enc.input_ids, enc.attention_mask)[-1]
        prob = logits.sigmoid() @ cmap.T
        for b, m in enumerate(metas):
            sc, idx = prob[b].flatten().topk(100)
            q, c = idx // prob.shape[-1], idx % prob.shape[-1]
            w, h = m["size"]
            xywh = box_convert(boxes[b, q], "cxcywh", "xywh") * torch.tensor([w, h, w, h], device=device)
            dets += [{"image_id": m["image_id"], "category_id": val_set.cat_ids[ci], "bbox": bb, "score": v}
                     for v, ci, bb in zip(sc.tolist(), c.tolist(), xywh.tolist())]
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, dets)
    model.train()
    if dist.get_rank() != 0:
        return None
    uniq = {(d["image_id"], d["category_id"], tuple(d["bbox"])): d for d in itertools.chain(*parts)}
    ev = COCOeval(val_set.coco, val_set.coco.loadRes(list(uniq.values())), "bbox")
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return ev.stats[0]


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained("bert-base-uncased")
    train_set = ConcatDataset([O365AsGrounding(args.o365, tok), GoldG(args.goldg, tok)])
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers,
                        collate_fn=collate, pin_memory=True)
    val_set = CocoVal(args.coco)
    val_loader = DataLoader(val_set, 4, sampler=DistributedSampler(val_set, shuffle=False), collate_fn=collate,
                            num_workers=args.workers)

    model = Grounder(args.dec_layers, args.aux_loss).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    lr = args.lr * (args.batch_size * world) / 32
    opt = torch.optim.AdamW([
        {"params": [p for n, p in model.named_parameters() if not n.startswith(("backbone", "text"))]},
        {"params": [p for n, p in model.named_parameters() if n.startswith(("backbone", "text"))], "lr": lr * 0.1},
    ], lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [int(args.epochs * 0.75) * len(loader)])

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.time()
        for it, (images, texts, tgts) in enumerate(loader):
            enc = tok(texts, padding="max_length", truncation=True, max_length=MAX_LEN, return_tensors="pt").to(device)
            tgts = [{k: v.to(device) for k, v in t.items()} for t in tgts]
            outs = ddp(images.to(device, non_blocking=True), enc.input_ids, enc.attention_mask)
            nb = torch.tensor(float(sum(len(t["boxes"]) for t in tgts)), device=device)
            dist.all_reduce(nb)
            nb = (nb / world).clamp(min=1)
            loss = sum(match_and_loss(lg, bx, tgts, nb) for lg, bx in outs)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(ddp.parameters(), 0.1)
            opt.step()
            sched.step()
            if it % 50 == 0:
                ls = loss.detach().clone()
                dist.all_reduce(ls, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"{epoch}:{it}/{len(loader)} loss={ls.item():.4f} "
                          f"{(time.time() - t0) / (it + 1):.2f}s/it", flush=True)
        ap = evaluate(model, val_loader, val_set, tok, device)
        if rank == 0:
            print(f"epoch {epoch} COCO zero-shot AP {ap:.4f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "args": vars(args)}, os.path.join(args.out, f"ep{epoch}.pth"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
