"""Fine-tune a Grounding-DINO style model on LVIS v1 and report LVIS minival box AP.

LVIS has 1203 class names, far more than fit in one 256-token prompt.  Training
samples a prompt of positives + negatives per image; evaluation splits the
vocabulary into chunks and runs one forward per chunk.

    torchrun --nproc_per_node 8 13_gdino_lvis_minival.py --grad-ckpt
"""
import argparse
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
import torchvision.transforms.functional as TF
from lvis import LVIS, LVISEval, LVISResults
from PIL import Image
from scipy.optimize import linear_sum_assignment
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import swin_t, Swin_T_Weights
from torchvision.ops import box_convert, generalized_box_iou, sigmoid_focal_loss
from transformers import AutoModel, AutoTokenizer

MAX_LEN = 256


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--lvis", default="/data/lvis")
    p.add_argument("--coco", default="/data/coco")
    p.add_argument("--minival", default="/data/lvis/lvis_v1_minival_inserted_image_name.json")
    p.add_argument("--init", default="weights/gdino_swint_ogc.pth")
    p.add_argument("--out", default="runs/gdino_lvis")
    p.add_argument("--epochs", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--grad-ckpt", action="store_true")
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


def prompt_from(names):
    text, spans = "", []
    for n in names:
        spans.append((len(text), len(text) + len(n)))
        text += n + " . "
    return text.strip(), spans


def token_map(tok, text, spans):
    enc = tok(text, truncation=True, max_length=MAX_LEN)
    m = torch.zeros(len(spans), MAX_LEN)
    for i, (s, e) in enumerate(spans):
        a, b = enc.char_to_token(s), enc.char_to_token(e - 1)
        if a is not None and b is not None:
            m[i, a: b + 1] = 1
    return m


class LVISGrounding(Dataset):
    def __init__(self, ann, coco_root, tok, train, neg=80):
        self.ann = ann
        self.api = LVIS(ann)
        self.ids = sorted(self.api.get_img_ids())
        self.cat_ids = sorted(self.api.get_cat_ids())
        self.names = {c["id"]: c["name"].replace("_", " ") for c in self.api.load_cats(self.cat_ids)}
        self.coco_root, self.tok, self.train, self.neg = coco_root, tok, train, neg

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        info = self.api.load_imgs([self.ids[i]])[0]
        split, fname = info["coco_url"].split("/")[-2:]
        img = Image.open(os.path.join(self.coco_root, split, fname)).convert("RGB")
        w, h = img.size
        s = min(800 / min(w, h), 1333 / max(w, h))
        img = TF.normalize(TF.to_tensor(TF.resize(img, [int(h * s), int(w * s)])),
                           [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        tgt = {"image_id": info["id"], "size": (w, h)}
        if self.train:
            anns = self.api.load_anns(self.api.get_ann_ids(img_ids=[info["id"]]))
            pos = sorted({a["category_id"] for a in anns})
            negs = random.sample([c for c in self.cat_ids if c not in pos], self.neg)
            cats = pos + negs
            random.shuffle(cats)
            text, spans = prompt_from([self.names[c] for c in cats])
            tmap = token_map(self.tok, text, spans)
            idx = {c: k for k, c in enumerate(cats)}
            boxes = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
            tgt["boxes"] = box_convert(boxes, "xywh", "cxcywh") / torch.tensor([w, h, w, h])
            tgt["positive_map"] = tmap[[idx[a["category_id"]] for a in anns]] if anns else torch.zeros(0, MAX_LEN)
            tgt["text"] = text
        return img, tgt


def collate(batch):
    imgs, tgts = zip(*batch)
    H, W = max(i.shape[1] for i in imgs), max(i.shape[2] for i in imgs)
    x = torch.zeros(len(imgs), 3, H, W)
    for k, im in enumerate(imgs):
        x[k, :, : im.shape[1], : im.shape[2]] = im
    return x, list(tgts)


class FusionBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.img = nn.TransformerDecoderLayer(d, 8, 1024, batch_first=True)
        self.txt = nn.TransformerDecoderLayer(d, 8, 1024, batch_first=True)

    def forward(self, v, t, pad):
        return self.img(v, t, memory_key_padding_mask=pad), self.txt(t, v, tgt_key_padding_mask=pad)


class GDino(nn.Module):
    def __init__(self, d=256, nq=900, grad_ckpt=False):
        super().__init__()
        self.backbone = swin_t(weights=Swin_T_Weights.IMAGENET1K_V1).features
        self.vproj = nn.Linear(768, d)
        self.bert = AutoModel.from_pretrained("bert-base-uncased", add_pooling_layer=False)
        self.tproj = nn.Linear(768, d)
        self.fusion = nn.ModuleList(FusionBlock(d) for _ in range(6))
        self.tgt = nn.Embedding(nq, d)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 8, 2048, batch_first=True), 6)
        self.bbox = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 4))
        self.grad_ckpt = grad_ckpt

    def forward(self, images, ids, am):
        v = self.vproj(self.backbone(images).flatten(1, 2))
        t = self.tproj(self.bert(input_ids=ids, attention_mask=am).last_hidden_state)
        pad = ~am.bool()
        for blk in self.fusion:
            if self.grad_ckpt and self.training:
                v, t = torch.utils.checkpoint.checkpoint(blk, v, t, pad, use_reentrant=False)
            else:
                v, t = blk(v, t, pad)
        hs = self.decoder(self.tgt.weight.expand(images.shape[0], -1, -1), v)
        logits = (hs @ t.transpose(1, 2) / 16.0).masked_fill(pad[:, None], -1e4)
        return logits, self.bbox(hs).sigmoid()


def criterion(logits, boxes, tgts):
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


def gather_variable(t):
    """all_gather for tensors whose first dim differs between ranks."""
    world = dist.get_world_size()
    n = torch.tensor([t.shape[0]], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    sizes = [int(s.item()) for s in sizes]
    padded = t.new_zeros((max(sizes),) + tuple(t.shape[1:]))
    padded[: t.shape[0]] = t
    out = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return torch.cat([o[:s] for o, s in zip(out, sizes)])


@torch.no_grad()
def evaluate(model, loader, ds, tok, device, chunk=200, per_image=300):
    model.eval()
    chunks = []
    for i in range(0, len(ds.cat_ids), chunk):
        cats = ds.cat_ids[i: i + chunk]
        text, spans = prompt_from([ds.names[c] for c in cats])
        enc = tok(text, padding="max_length", truncation=True, max_length=MAX_LEN, return_tensors="pt").to(device)
        m = token_map(tok, text, spans).to(device)
        chunks.append((enc, m / m.sum(-1, keepdim=True).clamp(min=1), torch.tensor(cats, device=device)))
    rows = []
    for images, tgts in loader:
        images = images.to(device)
        B = images.shape[0]
        scores, labels, boxes_all = [], [], []
        for enc, m, cats in chunks:
            logits, boxes = model(images, enc.input_ids.expand(B, -1), enc.attention_mask.expand(B, -1))
            p = logits.sigmoid() @ m.T  # B x Q x C_chunk
            s, c = p.max(-1)
            scores.append(s), labels.append(cats[c]), boxes_all.append(boxes)
        scores, labels, boxes = torch.cat(scores, 1), torch.cat(labels, 1), torch.cat(boxes_all, 1)
        for b, t in enumerate(tgts):
            s, k = scores[b].topk(per_image)
            w, h = t["size"]
            xywh = box_convert(boxes[b, k], "cxcywh", "xywh") * torch.tensor([w, h, w, h], device=device)
            img_id = torch.full_like(s, t["image_id"], dtype=torch.float64)
            rows.append(torch.stack([img_id, *xywh.double().unbind(1), s.double(), labels[b, k].double()], 1))
    local = torch.cat(rows) if rows else torch.zeros(0, 7, dtype=torch.float64, device=device)
    dets = gather_variable(local)
    model.train()
    if dist.get_rank() != 0:
        return None
    dets = torch.unique(dets, dim=0).cpu().tolist()  # padded duplicates from DistributedSampler
    results = [{"image_id": int(d[0]), "bbox": d[1:5], "score": d[5], "category_id": int(d[6])} for d in dets]
    gt = LVIS(ds.ann)
    ev = LVISEval(gt, LVISResults(gt, results, max_dets=300), "bbox")
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

    tok = AutoTokenizer.from_pretrained("bert-base-uncased")
    train_set = LVISGrounding(os.path.join(args.lvis, "lvis_v1_train.json"), args.coco, tok, train=True)
    val_set = LVISGrounding(args.minival, args.coco, tok, train=False)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, collate_fn=collate, num_workers=args.workers,
                        drop_last=True, pin_memory=True)
    val_loader = DataLoader(val_set, 2, sampler=DistributedSampler(val_set, shuffle=False), collate_fn=collate,
                            num_workers=args.workers)

    model = GDino(grad_ckpt=args.grad_ckpt).to(device)
    if os.path.exists(args.init):
        missing, _ = model.load_state_dict(torch.load(args.init, map_location="cpu")["model"], strict=False)
        if rank == 0:
            print(f"init from {args.init}, {len(missing)} missing keys")
    # the only buffers are constant index tables (BERT position ids, Swin relative position index)
    ddp = DDP(model, device_ids=[local_rank], broadcast_buffers=False)
    lr = args.lr * args.batch_size * world / 16
    opt = torch.optim.AdamW([
        {"params": [p for n, p in model.named_parameters() if n.startswith(("backbone", "bert"))], "lr": lr * 0.1},
        {"params": [p for n, p in model.named_parameters() if not n.startswith(("backbone", "bert"))]},
    ], lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [int(args.epochs * 0.8)])

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.time()
        for it, (images, tgts) in enumerate(loader):
            enc = tok([t["text"] for t in tgts], padding="max_length", truncation=True, max_length=MAX_LEN,
                      return_tensors="pt").to(device)
            tgts = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in t.items()} for t in tgts]
            logits, boxes = ddp(images.to(device, non_blocking=True), enc.input_ids, enc.attention_mask)
            loss = criterion(logits, boxes, tgts)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(ddp.parameters(), 0.1)
            opt.step()
            if it % 50 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"[{epoch}/{args.epochs}][{it}/{len(loader)}] loss {l.item():.4f} "
                          f"{(time.time() - t0) / (it + 1):.2f}s/it", flush=True)
        sched.step()
        if (epoch + 1) % 4 == 0 or epoch + 1 == args.epochs:
            res = evaluate(model, val_loader, val_set, tok, device)
            if rank == 0:
                print(f"epoch {epoch} minival AP {res['AP']:.4f} APr {res['APr']:.4f} APc {res['APc']:.4f} "
                      f"APf {res['APf']:.4f}", flush=True)
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(args.out, "last.pth"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
