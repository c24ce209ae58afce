"""Full-model fine-tuning of a GLIP-style grounding detector on one ODinW dataset.

The class names of the target dataset become the text prompt, so the same
model can be fine-tuned on any COCO-format detection set without a new head.

    torchrun --nproc_per_node 4 06_glip_odinw_finetune.py --dataset Aquarium \
        --odinw-root /data/odinw --init ckpts/glip_tiny_o365_goldg.pth
"""
import argparse
import contextlib
import io
import itertools
import os

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
from torch.utils.tensorboard import SummaryWriter
from torchvision.models import swin_t, Swin_T_Weights
from torchvision.ops import box_convert, generalized_box_iou, sigmoid_focal_loss
from transformers import AutoModel, AutoTokenizer

ODINW_SPLITS = {"train": "train/annotations_without_background.json", "valid": "valid/annotations_without_background.json"}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="Aquarium")
    p.add_argument("--odinw-root", default="/data/odinw")
    p.add_argument("--init", default="ckpts/glip_tiny_o365_goldg.pth")
    p.add_argument("--out", default="runs/odinw")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--num-workers", type=int, default=4)
    return p.parse_args()


class CocoPrompted(Dataset):
    def __init__(self, root, split, train):
        ann = os.path.join(root, ODINW_SPLITS[split])
        with contextlib.redirect_stdout(io.StringIO()):
            self.coco = COCO(ann)
        self.img_dir = os.path.dirname(ann)
        self.ids = sorted(self.coco.getImgIds())
        self.cat_ids = sorted(self.coco.getCatIds())
        self.names = [self.coco.loadCats(c)[0]["name"] for c in self.cat_ids]
        # "fish. jellyfish. penguin. ..." with the char span of each class
        self.prompt, self.spans, pos = "", [], 0
        for n in self.names:
            self.spans.append((len(self.prompt), len(self.prompt) + len(n)))
            self.prompt += n + ". "
        self.prompt = self.prompt.strip()
        self.train = train

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        img_id = self.ids[i]
        info = self.coco.loadImgs(img_id)[0]
        img = Image.open(os.path.join(self.img_dir, info["file_name"])).convert("RGB")
        w, h = img.size
        anns = [a for a in self.coco.loadAnns(self.coco.getAnnIds(img_id, iscrowd=False)) if a["bbox"][2] > 0]
        boxes = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        labels = torch.tensor([self.cat_ids.index(a["category_id"]) for a in anns], dtype=torch.long)
        if self.train and torch.rand(()) < 0.5:
            img = TF.hflip(img)
            boxes[:, 0] = w - boxes[:, 0] - boxes[:, 2]
        s = min(800 / min(w, h), 1333 / max(w, h))
        img = TF.resize(img, [int(h * s), int(w * s)])
        boxes = box_convert(boxes, "xywh", "cxcywh") / torch.tensor([w, h, w, h])
        img = TF.normalize(TF.to_tensor(img), [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        return img, {"boxes": boxes, "labels": labels, "image_id": img_id, "size": (w, h)}


def collate(batch):
    imgs, tgts = zip(*batch)
    H, W = max(x.shape[1] for x in imgs), max(x.shape[2] for x in imgs)
    out = torch.zeros(len(imgs), 3, H, W)
    for k, x in enumerate(imgs):
        out[k, :, : x.shape[1], : x.shape[2]] = x
    return out, list(tgts)


class GLIP(nn.Module):
    def __init__(self, text_name="bert-base-uncased", d=256, max_len=256):
        super().__init__()
        self.tokenizer = AutoTokenizer.from_pretrained(text_name)
        self.max_len = max_len
        self.backbone = swin_t(weights=Swin_T_Weights.IMAGENET1K_V1).features
        self.vproj = nn.Linear(768, d)
        self.language_backbone = AutoModel.from_pretrained(text_name, add_pooling_layer=False)
        self.lproj = nn.Linear(768, d)
        self.fuse = nn.ModuleList(nn.MultiheadAttention(d, 8, batch_first=True) for _ in range(4))
        self.queries = nn.Embedding(300, d)
        self.head = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 8, 1024, batch_first=True), 6)
        self.box = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 4))
        self.bias0 = nn.Parameter(torch.tensor(-4.6))

    def tokenize(self, captions, device):
        return self.tokenizer(captions, padding="max_length", truncation=True, max_length=self.max_len,
                              return_tensors="pt").to(device)

    def forward(self, images, input_ids, attention_mask):
        v = self.vproj(self.backbone(images).flatten(1, 2))
        t = self.lproj(self.language_backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state)
        for attn in self.fuse:
            v = v + attn(v, t, t, key_padding_mask=~attention_mask.bool())[0]
        hs = self.head(self.queries.weight.expand(images.shape[0], -1, -1), v)
        logits = hs @ t.transpose(1, 2) / 16.0 + self.bias0
        return logits.masked_fill(~attention_mask.bool()[:, None], -1e4), self.box(hs).sigmoid()


def class_token_map(tokens, spans, max_len):
    """C x T matrix: which prompt tokens belong to which class name."""
    m = torch.zeros(len(spans), max_len)
    for c, (s, e) in enumerate(spans):
        ts, te = tokens.char_to_token(0, s), tokens.char_to_token(0, e - 1)
        m[c, ts: te + 1] = 1
    return m


def loss_fn(logits, boxes, targets, cls_map):
    n = torch.tensor(float(sum(len(t["labels"]) for t in targets)), device=logits.device)
    dist.all_reduce(n)
    n = (n / dist.get_world_size()).clamp(min=1)
    tgt_tok = torch.zeros_like(logits)
    l_box = logits.new_zeros(())
    cls_prob_map = cls_map / cls_map.sum(-1, keepdim=True)
    for b, t in enumerate(targets):
        if len(t["labels"]) == 0:
            continue
        tb, tl = t["boxes"], t["labels"]
        with torch.no_grad():
            cls_score = logits[b].sigmoid() @ cls_prob_map.T  # Q x C
            C = -2 * cls_score[:, tl] + 5 * torch.cdist(boxes[b], tb, p=1) - 2 * generalized_box_iou(
                box_convert(boxes[b], "cxcywh", "xyxy"), box_convert(tb, "cxcywh", "xyxy"))
            qi, ti = linear_sum_assignment(C.cpu())
        tgt_tok[b, qi] = cls_map[tl[ti]]
        pb, gb = boxes[b, qi], tb[ti]
        l_box = l_box + 5 * F.l1_loss(pb, gb, reduction="sum") + 2 * (1 - generalized_box_iou(
            box_convert(pb, "cxcywh", "xyxy"), box_convert(gb, "cxcywh", "xyxy")).diag()).sum()
    return (sigmoid_focal_loss(logits, tgt_tok, reduction="sum") + l_box) / n


@torch.no_grad()
def evaluate(net, loader, dataset, cls_map, device):
    net.eval()
    tokens = net.tokenize([dataset.prompt] * loader.batch_size, device)
    dets = []
    for images, tgts in loader:
        bs = images.shape[0]
        logits, boxes = net(images.to(device), tokens.input_ids[:bs], tokens.attention_mask[:bs])
        scores = logits.sigmoid() @ (cls_map / cls_map.sum(-1, keepdim=True)).T  # B x Q x C
        for b, t in enumerate(tgts):
            s, idx = scores[b].flatten().topk(100)
            q, c = idx // scores.shape[-1], idx % scores.shape[-1]
            w, h = t["size"]
            xywh = box_convert(boxes[b, q], "cxcywh", "xywh") * torch.tensor([w, h, w, h], device=device)
            dets += [{"image_id": t["image_id"], "category_id": dataset.cat_ids[ci], "bbox": bb, "score": sc}
                     for sc, ci, bb in zip(s.tolist(), c.tolist(), xywh.tolist())]
    all_dets = [None] * dist.get_world_size()
    dist.all_gather_object(all_dets, dets)
    net.train()
    if dist.get_rank() != 0:
        return 0.0
    seen, merged = set(), []
    for d in itertools.chain(*all_dets):
        key = (d["image_id"], d["category_id"], tuple(d["bbox"]))
        if key not in seen:
            seen.add(key)
            merged.append(d)
    if not merged:
        return 0.0
    ev = COCOeval(dataset.coco, dataset.coco.loadRes(merged), "bbox")
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

    root = os.path.join(args.odinw_root, args.dataset)
    train_set, val_set = CocoPrompted(root, "train", True), CocoPrompted(root, "valid", False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, collate_fn=collate,
                              num_workers=args.num_workers, drop_last=True, pin_memory=True)
    val_loader = DataLoader(val_set, args.batch_size, sampler=DistributedSampler(val_set, shuffle=False),
                            collate_fn=collate, num_workers=args.num_workers)

    net = GLIP().to(device)
    if os.path.exists(args.init):
        state = torch.load(args.init, map_location="cpu")
        net.load_state_dict(state["model"], strict=False)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW([
        {"params": [p for n, p in net.named_parameters() if "language_backbone" not in n]},
        {"params": net.language_backbone.parameters(), "lr": args.lr * 0.1},
    ], lr=args.lr * args.batch_size * world / 8, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs)

    enc = net.tokenize([train_set.prompt], device)
    cls_map = class_token_map(enc, train_set.spans, net.max_len).to(device)
    writer = SummaryWriter(os.path.join(args.out, args.dataset)) if rank == 0 else None
    best_ap = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for it, (images, tgts) in enumerate(train_loader):
            tokens = model.tokenize([train_set.prompt] * images.shape[0], device)
            tgts = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in t.items()} for t in tgts]
            logits, boxes = model(images.to(device), tokens.input_ids, tokens.attention_mask)
            loss = loss_fn(logits, boxes, tgts, cls_map)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if it % 20 == 0:
                avg = loss.detach().clone()
                dist.all_reduce(avg, op=dist.ReduceOp.AVG)
                if writer is not None:
                    writer.add_scalar("train/loss", avg.item(), epoch * len(train_loader) + it)
        sched.step()
        ap = evaluate(net, val_loader, val_set, cls_map, device)
        if rank == 0:
            writer.add_scalar("val/AP", ap, epoch)
            print(f"[{args.dataset}] epoch {epoch} AP {ap:.4f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": net.state_dict(), "epoch": epoch}, os.path.join(args.out, f"{args.dataset}_last.pth"))
            if ap > best_ap:
                best_ap = ap
                torch.save({"model": net.state_dict(), "epoch": epoch, "ap": ap},
                           os.path.join(args.out, f"{args.dataset}_best.pth"))
        dist.barrier()
    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
