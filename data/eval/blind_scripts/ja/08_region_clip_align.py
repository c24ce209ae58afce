"""Open-vocabulary COCO (48 base / 17 novel) with region-word alignment on captions.

Iterations alternate between
  * detection batches (COCO base-class boxes, classifier = frozen CLIP text embeddings), and
  * caption batches (COCO Captions, no boxes): every caption word is matched to its best
    region, and image-caption pairs are contrasted against the captions of all GPUs.

    torchrun --nproc_per_node=8 08_region_clip_align.py --wandb
"""
import argparse
import itertools
import json
import os

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
import wandb
from PIL import Image
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from scipy.optimize import linear_sum_assignment
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import resnet50, ResNet50_Weights
from torchvision.ops import box_convert, generalized_box_iou, sigmoid_focal_loss
from torchvision.ops.misc import FrozenBatchNorm2d
from transformers import CLIPTextModelWithProjection, CLIPTokenizer

NORM = T.Compose([T.Resize(640, max_size=1024), T.ToTensor(),
                  T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--coco", default="/data/coco")
    p.add_argument("--ovd-ann", default="/data/coco/zero-shot")
    p.add_argument("--clip", default="openai/clip-vit-base-patch16")
    p.add_argument("--out", default="output/ovd_coco_caption")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--cap-batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--resume", default="")
    p.add_argument("--wandb", action="store_true")
    return p.parse_args()


class CocoDet(Dataset):
    def __init__(self, img_dir, ann_file):
        self.coco, self.img_dir = COCO(ann_file), img_dir
        self.ids = sorted(self.coco.getImgIds())
        self.cat_ids = sorted(self.coco.getCatIds())

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        info = self.coco.loadImgs(self.ids[i])[0]
        img = Image.open(os.path.join(self.img_dir, info["file_name"])).convert("RGB")
        anns = self.coco.loadAnns(self.coco.getAnnIds(imgIds=info["id"], iscrowd=False))
        boxes = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        boxes = box_convert(boxes, "xywh", "cxcywh") / torch.tensor([info["width"], info["height"]] * 2)
        labels = torch.tensor([self.cat_ids.index(a["category_id"]) for a in anns], dtype=torch.long)
        return NORM(img), {"boxes": boxes, "labels": labels, "image_id": info["id"],
                           "size": (info["width"], info["height"])}


class CocoCaptions(Dataset):
    def __init__(self, img_dir, ann_file):
        with open(ann_file) as f:
            d = json.load(f)
        files = {im["id"]: im["file_name"] for im in d["images"]}
        self.items = [(files[a["image_id"]], a["caption"]) for a in d["annotations"]]
        self.img_dir = img_dir

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        f, cap = self.items[i]
        return NORM(Image.open(os.path.join(self.img_dir, f)).convert("RGB")), cap


def pad_images(imgs):
    H, W = max(i.shape[1] for i in imgs), max(i.shape[2] for i in imgs)
    x = torch.zeros(len(imgs), 3, H, W)
    for k, im in enumerate(imgs):
        x[k, :, : im.shape[1], : im.shape[2]] = im
    return x


def det_collate(b):
    imgs, t = zip(*b)
    return pad_images(imgs), list(t)


def cap_collate(b):
    imgs, c = zip(*b)
    return pad_images(imgs), list(c)


class RegionDetector(nn.Module):
    def __init__(self, clip_dim=512, d=256, nq=100):
        super().__init__()
        r = resnet50(weights=ResNet50_Weights.IMAGENET1K_V2, norm_layer=FrozenBatchNorm2d)
        self.backbone = nn.Sequential(*list(r.children())[:-2])
        self.proj = nn.Conv2d(2048, d, 1)
        self.transformer = nn.Transformer(d, 8, 4, 6, 1024, batch_first=True)
        self.queries = nn.Embedding(nq, d)
        self.box_head = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 4))
        self.region_embed = nn.Linear(d, clip_dim)
        self.temperature = nn.Parameter(torch.tensor(50.0).log())

    def forward(self, images, with_boxes=True):
        f = self.proj(self.backbone(images)).flatten(2).transpose(1, 2)
        hs = self.transformer(f, self.queries.weight.expand(images.shape[0], -1, -1))
        regions = F.normalize(self.region_embed(hs), dim=-1)
        boxes = self.box_head(hs).sigmoid() if with_boxes else None
        return regions, boxes, self.temperature.exp()


@torch.no_grad()
def encode_text(clip, tok, texts, device):
    # fixed length so that word tensors have the same shape on every rank
    enc = tok(texts, padding="max_length", truncation=True, max_length=77, return_tensors="pt").to(device)
    out = clip(**enc)
    words = F.normalize(clip.text_projection(out.last_hidden_state), dim=-1)
    return F.normalize(out.text_embeds, dim=-1), words, enc.attention_mask.bool()


def detection_loss(regions, boxes, targets, classifier, scale):
    logits = regions @ classifier.T * scale
    tgt = torch.zeros_like(logits)
    n = torch.tensor(float(sum(len(t["labels"]) for t in targets)), device=logits.device)
    dist.all_reduce(n)
    n = (n / dist.get_world_size()).clamp(min=1)
    l_box = logits.new_zeros(())
    for b, t in enumerate(targets):
        if len(t["labels"]) == 0:
            continue
        tb, tl = t["boxes"], t["labels"]
        with torch.no_grad():
            C = -logits[b].sigmoid()[:, tl] + 5 * torch.cdist(boxes[b], tb, p=1) - 2 * generalized_box_iou(
                box_convert(boxes[b], "cxcywh", "xyxy"), box_convert(tb, "cxcywh", "xyxy"))
            qi, ti = linear_sum_assignment(C.cpu())
        tgt[b, qi, tl[ti]] = 1
        l_box = l_box + 5 * F.l1_loss(boxes[b, qi], tb[ti], reduction="sum") + 2 * (1 - generalized_box_iou(
            box_convert(boxes[b, qi], "cxcywh", "xyxy"), box_convert(tb[ti], "cxcywh", "xyxy")).diag()).sum()
    return (sigmoid_focal_loss(logits, tgt, reduction="sum") + l_box) / n


def caption_loss(regions, words, word_mask, scale):
    # image-caption score = mean over words of the best region for that word
    all_regions = torch.cat(dist_nn.all_gather(regions), 0)  # keeps gradients of every rank's part
    all_words = torch.cat([w for w in dist_nn.all_gather(words)], 0)
    all_mask = torch.cat(dist_nn.all_gather(word_mask.float()), 0)
    sim = torch.einsum("ird,jtd->ijrt", all_regions, all_words).max(2).values  # I x J x T
    score = (sim * all_mask[None]).sum(-1) / all_mask.sum(-1)[None]
    labels = torch.arange(score.shape[0], device=score.device)
    return (F.cross_entropy(score * scale, labels) + F.cross_entropy(score.T * scale, labels)) / 2


@torch.no_grad()
def evaluate(model, loader, classifier, cat_ids, device, coco_gt):
    model.eval()
    dets = []
    for images, tgts in loader:
        regions, boxes, scale = model(images.to(device))
        prob = (regions @ classifier.T * scale).sigmoid()
        for b, t in enumerate(tgts):
            s, idx = prob[b].flatten().topk(100)
            q, c = idx // prob.shape[-1], idx % prob.shape[-1]
            w, h = t["size"]
            xywh = box_convert(boxes[b, q], "cxcywh", "xywh") * torch.tensor([w, h, w, h], device=device)
            dets += [{"image_id": t["image_id"], "category_id": cat_ids[ci], "bbox": bb, "score": sc}
                     for sc, ci, bb in zip(s.tolist(), c.tolist(), xywh.tolist())]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dets)
    model.train()
    if dist.get_rank() != 0:
        return None
    seen, merged = set(), []
    for d in itertools.chain(*gathered):  # DistributedSampler repeats a few images to even out the shards
        key = (d["image_id"], d["category_id"], tuple(d["bbox"]))
        if key not in seen:
            seen.add(key)
            merged.append(d)
    ev = COCOeval(coco_gt, coco_gt.loadRes(merged), "bbox")
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return ev.stats[1]  # AP50, the usual OVD-COCO number


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    det_set = CocoDet(os.path.join(args.coco, "train2017"), os.path.join(args.ovd_ann, "instances_train2017_seen_2.json"))
    cap_set = CocoCaptions(os.path.join(args.coco, "train2017"), os.path.join(args.coco, "annotations/captions_train2017.json"))
    val_set = CocoDet(os.path.join(args.coco, "val2017"), os.path.join(args.ovd_ann, "instances_val2017_all_2.json"))
    det_sampler, cap_sampler = DistributedSampler(det_set), DistributedSampler(cap_set)
    det_loader = DataLoader(det_set, args.batch_size, sampler=det_sampler, collate_fn=det_collate, num_workers=6,
                            drop_last=True, pin_memory=True)
    cap_loader = DataLoader(cap_set, args.cap_batch_size, sampler=cap_sampler, collate_fn=cap_collate,
                            num_workers=6, drop_last=True, pin_memory=True)
    val_loader = DataLoader(val_set, 8, sampler=DistributedSampler(val_set, shuffle=False), collate_fn=det_collate,
                            num_workers=4)

    tok = CLIPTokenizer.from_pretrained(args.clip)
    clip = CLIPTextModelWithProjection.from_pretrained(args.clip).to(device).eval().requires_grad_(False)
    names = lambda ds: [ds.coco.loadCats(c)[0]["name"] for c in ds.cat_ids]
    base_cls = encode_text(clip, tok, [f"a photo of a {n}" for n in names(det_set)], device)[0]
    all_cls = encode_text(clip, tok, [f"a photo of a {n}" for n in names(val_set)], device)[0]

    model = RegionDetector().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * args.batch_size * world / 32, weight_decay=1e-4)
    start = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start = ck["epoch"] + 1
    # caption iterations do not use box_head
    ddp = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    run = wandb.init(project="ovd-coco", config=vars(args)) if (args.wandb and rank == 0) else None

    iters = 2 * min(len(det_loader), len(cap_loader))
    for epoch in range(start, args.epochs):
        det_sampler.set_epoch(epoch)
        cap_sampler.set_epoch(epoch)
        ddp.train()
        det_it, cap_it = iter(det_loader), iter(cap_loader)
        for it in range(iters):
            if it % 2 == 0:
                images, tgts = next(det_it)
                tgts = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in t.items()} for t in tgts]
                regions, boxes, scale = ddp(images.to(device, non_blocking=True))
                loss = detection_loss(regions, boxes, tgts, base_cls, scale)
            else:
                images, caps = next(cap_it)
                _, words, wmask = encode_text(clip, tok, caps, device)
                regions, _, scale = ddp(images.to(device, non_blocking=True), with_boxes=False)
                loss = 0.1 * caption_loss(regions, words, wmask, scale)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if it % 100 < 2:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if run is not None:
                    run.log({"loss/det" if it % 2 == 0 else "loss/cap": l.item(), "epoch": epoch})

        ap50 = evaluate(model, val_loader, all_cls, val_set.cat_ids, device, val_set.coco)
        if rank == 0:
            print(f"epoch {epoch} AP50 {ap50:.4f}", flush=True)
            if run is not None:
                run.log({"val/AP50": ap50, "epoch": epoch})
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pth"))
        dist.barrier()
    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
