"""Open-vocabulary detector pre-training on Objects365 v2.

Region queries are classified by similarity to text embeddings of the 365 class
names (computed once by a frozen CLIP text tower).  Evaluation: COCO-style AP on
the Objects365 val subset.

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint node01:29500 \
        19_ovd_objects365.py --data /fsx/objects365 --out /fsx/runs/ovd_o365
"""
import argparse
import itertools
import logging
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import regnet_y_8gf, RegNet_Y_8GF_Weights
from torchvision.ops import box_convert, generalized_box_iou, sigmoid_focal_loss
from transformers import CLIPTextModelWithProjection, CLIPTokenizer

logger = logging.getLogger("ovd_o365")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/fsx/objects365")
    p.add_argument("--out", default="/fsx/runs/ovd_o365")
    p.add_argument("--clip", default="openai/clip-vit-large-patch14")
    p.add_argument("--epochs", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-4, help="for a global batch of 64")
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--val-images", type=int, default=5000)
    return p.parse_args()


class O365(Dataset):
    def __init__(self, root, split, max_images=None, train=True):
        ann = os.path.join(root, "annotations", f"zhiyuan_objv2_{split}.json")
        self.coco = COCO(ann)
        self.ids = sorted(self.coco.getImgIds())[:max_images]
        self.cat_ids = sorted(self.coco.getCatIds())
        self.label = {c: i for i, c in enumerate(self.cat_ids)}
        self.img_dir = os.path.join(root, "images", split)
        self.train = train

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        info = self.coco.loadImgs(self.ids[i])[0]
        img = Image.open(os.path.join(self.img_dir, info["file_name"])).convert("RGB")
        w, h = img.size
        anns = [a for a in self.coco.loadAnns(self.coco.getAnnIds(info["id"], iscrowd=False)) if a["bbox"][2] > 1]
        b = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        b = box_convert(b, "xywh", "cxcywh") / torch.tensor([w, h, w, h])
        if self.train and torch.rand(()) < 0.5:
            img = TF.hflip(img)
            b[:, 0] = 1 - b[:, 0]
        s = min(800 / min(w, h), 1333 / max(w, h))
        img = TF.normalize(TF.to_tensor(TF.resize(img, [int(h * s), int(w * s)])),
                           [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        return img, {"boxes": b, "labels": torch.tensor([self.label[a["category_id"]] for a in anns], dtype=torch.long),
                     "image_id": info["id"], "size": (w, h)}


def collate(batch):
    imgs, tgts = zip(*batch)
    H, W = max(i.shape[1] for i in imgs), max(i.shape[2] for i in imgs)
    x = torch.zeros(len(imgs), 3, H, W)
    for k, im in enumerate(imgs):
        x[k, :, : im.shape[1], : im.shape[2]] = im
    return x, list(tgts)


class OVD(nn.Module):
    def __init__(self, text_dim, d=256, nq=300):
        super().__init__()
        r = regnet_y_8gf(weights=RegNet_Y_8GF_Weights.IMAGENET1K_V2)
        self.feat = nn.Sequential(r.stem, r.trunk_output)
        self.proj = nn.Conv2d(2016, d, 1)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 8, 1024, batch_first=True), 6)
        self.query = nn.Embedding(nq, d)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 8, 1024, batch_first=True), 6)
        self.bbox = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 4))
        self.embed = nn.Linear(d, text_dim)
        self.logit_scale = nn.Parameter(torch.tensor(3.0))
        self.logit_bias = nn.Parameter(torch.tensor(-5.0))

    def forward(self, x, text_emb):
        f = self.proj(self.feat(x)).flatten(2).transpose(1, 2)
        hs = self.decoder(self.query.weight.expand(x.shape[0], -1, -1), self.encoder(f))
        logits = F.normalize(self.embed(hs), dim=-1) @ text_emb.T * self.logit_scale.exp() + self.logit_bias
        return logits, self.bbox(hs).sigmoid()


@torch.no_grad()
def text_embeddings(names, clip_name, device):
    tok = CLIPTokenizer.from_pretrained(clip_name)
    model = CLIPTextModelWithProjection.from_pretrained(clip_name).to(device).eval()
    emb = model(**tok([f"a photo of a {n}" for n in names], padding=True, return_tensors="pt").to(device)).text_embeds
    del model
    torch.cuda.empty_cache()
    return F.normalize(emb, dim=-1)


def criterion(logits, boxes, tgts):
    n = torch.tensor(float(sum(len(t["labels"]) for t in tgts)), device=logits.device)
    dist.all_reduce(n)
    n = (n / dist.get_world_size()).clamp(min=1)
    tc, lb = torch.zeros_like(logits), logits.new_zeros(())
    for b, t in enumerate(tgts):
        if len(t["labels"]) == 0:
            continue
        tb, tl = t["boxes"], t["labels"]
        with torch.no_grad():
            C = -2 * logits[b].sigmoid()[:, tl] + 5 * torch.cdist(boxes[b], tb, p=1) - 2 * generalized_box_iou(
                box_convert(boxes[b], "cxcywh", "xyxy"), box_convert(tb, "cxcywh", "xyxy"))
            r, c = linear_sum_assignment(C.cpu())
        tc[b, r, tl[c]] = 1
        lb = lb + 5 * F.l1_loss(boxes[b, r], tb[c], reduction="sum") + 2 * (1 - generalized_box_iou(
            box_convert(boxes[b, r], "cxcywh", "xyxy"), box_convert(tb[c], "cxcywh", "xyxy")).diag()).sum()
    return (sigmoid_focal_loss(logits, tc, reduction="sum") + lb) / n


def train_epoch(model, loader, opt, sched, text_emb, device, epoch, log_every=50):
    model.train()
    t0 = time.time()
    for it, (x, tgts) in enumerate(loader):
        tgts = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in t.items()} for t in tgts]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, boxes = model(x.to(device, non_blocking=True), text_emb)
        loss = criterion(logits.float(), boxes.float(), tgts)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        opt.step()
        sched.step()
        if it % log_every == 0:
            l = loss.detach().clone()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            logger.info("epoch %d [%d/%d] loss %.4f lr %.2e %.2fs/it", epoch, it, len(loader), l.item(),
                        sched.get_last_lr()[0], (time.time() - t0) / (it + 1))


@torch.no_grad()
def evaluate(model, loader, text_emb, dataset, device):
    model.eval()
    dets = []
    for x, tgts in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, boxes = model(x.to(device), text_emb)
        prob = logits.float().sigmoid()
        for b, t in enumerate(tgts):
            s, idx = prob[b].flatten().topk(100)
            q, c = idx // prob.shape[-1], idx % prob.shape[-1]
            w, h = t["size"]
            xywh = box_convert(boxes[b, q].float(), "cxcywh", "xywh") * torch.tensor([w, h, w, h], device=device)
            dets += [{"image_id": t["image_id"], "category_id": dataset.cat_ids[ci], "bbox": bb, "score": sc}
                     for sc, ci, bb in zip(s.tolist(), c.tolist(), xywh.tolist())]
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, dets)
    model.train()
    if dist.get_rank() != 0:
        return None
    merged = list({(d["image_id"], d["category_id"], tuple(d["bbox"])): d for d in itertools.chain(*parts)}.values())
    ev = COCOeval(dataset.coco, dataset.coco.loadRes(merged), "bbox")
    ev.params.imgIds = dataset.ids
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
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="%(asctime)s %(message)s")

    train_set = O365(args.data, "train")
    val_set = O365(args.data, "val", max_images=args.val_images, train=False)
    names = [train_set.coco.loadCats(c)[0]["name"] for c in train_set.cat_ids]
    text_emb = text_embeddings(names, args.clip, device)

    train_loader = DataLoader(train_set, args.batch_size, sampler=DistributedSampler(train_set, shuffle=True),
                              collate_fn=collate, num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, 4, sampler=DistributedSampler(val_set, shuffle=False), collate_fn=collate,
                            num_workers=args.workers)

    model = OVD(text_emb.shape[1]).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 64
    opt = torch.optim.AdamW([
        {"params": [p for n, p in model.named_parameters() if n.startswith("feat.")], "lr": lr * 0.1},
        {"params": [p for n, p in model.named_parameters() if not n.startswith("feat.")]},
    ], lr=lr, weight_decay=0.05)
    total = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * (0.1 if s >= int(0.9 * total) else 1.0))

    for epoch in range(args.epochs):
        train_epoch(ddp, train_loader, opt, sched, text_emb, device, epoch)
        ap = evaluate(model, val_loader, text_emb, val_set, device)
        if rank == 0:
            logger.info("epoch %d Objects365 val AP %.4f", epoch, ap)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "text_emb": text_emb.cpu()}, os.path.join(args.out, "last.pth"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
