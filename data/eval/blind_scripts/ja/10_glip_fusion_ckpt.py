"""GLIP-L style training with deep vision-language fusion (X-attention in every
fusion layer).  The fusion layers are activation-checkpointed so that Swin-L
at 1333px fits with 2 images per GPU.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
        10_glip_fusion_ckpt.py --config configs/glip_l.yaml
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
import torch.utils.checkpoint as cp
import torchvision.transforms.functional as TF
import yaml
from PIL import Image
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from scipy.optimize import linear_sum_assignment
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import swin_v2_b, Swin_V2_B_Weights
from torchvision.ops import box_convert, generalized_box_iou, sigmoid_focal_loss
from transformers import BertModel, BertTokenizerFast

DEFAULTS = dict(
    train_ann="/shared/glip/mixed_o365_goldg.json", image_root="/shared/glip/images", out="/shared/glip/runs/glip_l",
    epochs=10, batch_size=2, base_lr=1e-4, text_lr_mult=0.1, weight_decay=0.05, warmup_iters=2000,
    fusion_layers=8, d_model=256, num_queries=900, max_query_len=256, use_checkpoint=True, workers=4,
    coco_root="/shared/datasets/coco", eval_every=2,
)


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--opts", nargs="*", default=[], help="key=value overrides")
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    if a.config:
        with open(a.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    for kv in a.opts:
        k, v = kv.split("=", 1)
        cfg[k] = type(DEFAULTS[k])(v) if not isinstance(DEFAULTS[k], bool) else v.lower() == "true"
    return argparse.Namespace(**cfg)


class MixedGrounding(Dataset):
    """Records: {"file_name", "caption", "boxes": [[x,y,w,h]...], "tokens_positive": [[[s,e],...], ...]}"""

    def __init__(self, ann, root, tok, max_len):
        with open(ann) as f:
            self.recs = json.load(f)
        self.root, self.tok, self.max_len = root, tok, max_len

    def __len__(self):
        return len(self.recs)

    def __getitem__(self, i):
        r = self.recs[i]
        img = Image.open(os.path.join(self.root, r["file_name"])).convert("RGB")
        w, h = img.size
        boxes = torch.tensor(r["boxes"], dtype=torch.float32).reshape(-1, 4)
        if random.random() < 0.5 and "left" not in r["caption"] and "right" not in r["caption"]:
            img = TF.hflip(img)
            boxes[:, 0] = w - boxes[:, 0] - boxes[:, 2]
        s = min(random.choice([800, 864, 928, 992, 1056]) / min(w, h), 1333 / max(w, h))
        img = TF.resize(img, [int(h * s), int(w * s)])
        enc = self.tok(r["caption"], truncation=True, max_length=self.max_len, padding="max_length")
        pmap = torch.zeros(len(boxes), self.max_len)
        for k, spans in enumerate(r["tokens_positive"]):
            for cs, ce in spans:
                a, b = enc.char_to_token(cs), enc.char_to_token(ce - 1)
                if a is not None and b is not None:
                    pmap[k, a: b + 1] = 1
        tgt = {"boxes": box_convert(boxes, "xywh", "cxcywh") / torch.tensor([w, h, w, h]), "positive_map": pmap}
        img = TF.normalize(TF.to_tensor(img), [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        return img, torch.tensor(enc["input_ids"]), torch.tensor(enc["attention_mask"]), tgt


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


def val_collate(batch):
    imgs, ids, sizes = zip(*batch)
    H = (max(i.shape[1] for i in imgs) + 31) // 32 * 32
    W = (max(i.shape[2] for i in imgs) + 31) // 32 * 32
    x = torch.zeros(len(imgs), 3, H, W)
    for k, im in enumerate(imgs):
        x[k, :, : im.shape[1], : im.shape[2]] = im
    return x, list(ids), list(sizes)


def collate(batch):
    imgs, ids, am, tgts = zip(*batch)
    H, W = max(i.shape[1] for i in imgs), max(i.shape[2] for i in imgs)
    H, W = (H + 31) // 32 * 32, (W + 31) // 32 * 32
    x = torch.zeros(len(imgs), 3, H, W)
    for k, im in enumerate(imgs):
        x[k, :, : im.shape[1], : im.shape[2]] = im
    return x, torch.stack(ids), torch.stack(am), list(tgts)


class BiAttentionBlock(nn.Module):
    def __init__(self, d, heads=8):
        super().__init__()
        self.v2l = nn.MultiheadAttention(d, heads, batch_first=True)
        self.l2v = nn.MultiheadAttention(d, heads, batch_first=True)
        self.nv, self.nl = nn.LayerNorm(d), nn.LayerNorm(d)
        self.gamma_v = nn.Parameter(torch.full((d,), 1e-4))
        self.gamma_l = nn.Parameter(torch.full((d,), 1e-4))
        self.ffn_v = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, v, l, l_pad):
        dv = self.l2v(self.nv(v), self.nl(l), self.nl(l), key_padding_mask=l_pad)[0]
        dl = self.v2l(self.nl(l), self.nv(v), self.nv(v))[0]
        v = v + self.gamma_v * dv
        v = v + self.ffn_v(v)
        return v, l + self.gamma_l * dl


class GLIPL(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg.d_model
        self.backbone = swin_v2_b(weights=Swin_V2_B_Weights.IMAGENET1K_V1).features
        self.vproj = nn.Linear(1024, d)
        self.bert = BertModel.from_pretrained("bert-base-uncased")
        self.lproj = nn.Linear(768, d)
        self.fusion = nn.ModuleList(BiAttentionBlock(d) for _ in range(cfg.fusion_layers))
        self.query = nn.Embedding(cfg.num_queries, d)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 8, 2048, batch_first=True), 6)
        self.bbox = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 4))
        self.bias_lang = nn.Parameter(torch.zeros(d))
        self.bias0 = nn.Parameter(torch.tensor(-4.6))
        self.use_checkpoint = cfg.use_checkpoint

    def forward(self, images, input_ids, attention_mask):
        v = self.vproj(self.backbone(images).flatten(1, 2))
        l = self.lproj(self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state)
        pad = ~attention_mask.bool()
        for blk in self.fusion:
            if self.use_checkpoint and self.training:
                v, l = cp.checkpoint(blk, v, l, pad, use_reentrant=True)
            else:
                v, l = blk(v, l, pad)
        hs = self.decoder(self.query.weight.expand(images.shape[0], -1, -1), v)
        token_bias = (l @ self.bias_lang)[:, None, :] + self.bias0  # B x 1 x T
        logits = hs @ l.transpose(1, 2) / hs.shape[-1] ** 0.5 + token_bias
        return logits.masked_fill(pad[:, None], -1e4), self.bbox(hs).sigmoid()


def criterion(logits, boxes, targets):
    n = torch.tensor(float(sum(len(t["boxes"]) for t in targets)), device=logits.device)
    dist.all_reduce(n)
    n = (n / dist.get_world_size()).clamp(min=1)
    tgt = torch.zeros_like(logits)
    l_box = logits.new_zeros(())
    for b, t in enumerate(targets):
        if len(t["boxes"]) == 0:
            continue
        tb, pm = t["boxes"], t["positive_map"]
        with torch.no_grad():
            cost = -(logits[b].sigmoid() @ (pm / pm.sum(-1, keepdim=True).clamp(min=1)).T) \
                + 5 * torch.cdist(boxes[b], tb, p=1) \
                - 2 * generalized_box_iou(box_convert(boxes[b], "cxcywh", "xyxy"), box_convert(tb, "cxcywh", "xyxy"))
            r, c = linear_sum_assignment(cost.float().cpu())
        tgt[b, r] = pm[c]
        l_box = l_box + 5 * F.l1_loss(boxes[b, r], tb[c], reduction="sum") + 2 * (1 - generalized_box_iou(
            box_convert(boxes[b, r], "cxcywh", "xyxy"), box_convert(tb[c], "cxcywh", "xyxy")).diag()).sum()
    return (sigmoid_focal_loss(logits, tgt, reduction="sum") + l_box) / n


@torch.no_grad()
def evaluate_coco(model, loader, coco, tok, max_len, device):
    model.eval()
    cat_ids = sorted(coco.getCatIds())
    names = [coco.loadCats(c)[0]["name"] for c in cat_ids]
    caption = ". ".join(names) + "."
    enc = tok(caption, padding="max_length", max_length=max_len, truncation=True, return_tensors="pt")
    cmap, pos = torch.zeros(len(names), max_len), 0
    for i, n in enumerate(names):
        st = caption.index(n, pos)
        pos = st + len(n)
        cmap[i, enc.char_to_token(st): enc.char_to_token(pos - 1) + 1] = 1
    cmap = (cmap / cmap.sum(-1, keepdim=True)).to(device)
    ids, am = enc.input_ids.to(device), enc.attention_mask.to(device)
    dets = []
    for x, img_ids, sizes in loader:
        B = x.shape[0]
        with torch.autocast("cuda", dtype=torch.float16):
            logits, boxes = model(x.to(device), ids.expand(B, -1), am.expand(B, -1))
        prob = logits.float().sigmoid() @ cmap.T
        for b in range(B):
            sc, idx = prob[b].flatten().topk(100)
            q, c = idx // prob.shape[-1], idx % prob.shape[-1]
            w, h = sizes[b]
            xywh = box_convert(boxes[b, q].float(), "cxcywh", "xywh") * torch.tensor([w, h, w, h], device=device)
            dets += [{"image_id": img_ids[b], "category_id": cat_ids[ci], "bbox": bb, "score": v}
                     for v, ci, bb in zip(sc.tolist(), c.tolist(), xywh.tolist())]
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
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tok = BertTokenizerFast.from_pretrained("bert-base-uncased")
    ds = MixedGrounding(cfg.train_ann, cfg.image_root, tok, cfg.max_query_len)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, cfg.batch_size, sampler=sampler, num_workers=cfg.workers, collate_fn=collate,
                        pin_memory=True, persistent_workers=True)
    val_set = CocoVal(cfg.coco_root)
    val_loader = DataLoader(val_set, 2, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=cfg.workers, collate_fn=val_collate)

    model = GLIPL(cfg).to(device)
    # BERT's pooler output is never used
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    lr = cfg.base_lr * cfg.batch_size * world / 64
    text_params = [p for n, p in model.named_parameters() if ".bert." in n]
    other = [p for n, p in model.named_parameters() if ".bert." not in n]
    opt = torch.optim.AdamW([{"params": other}, {"params": text_params, "lr": lr * cfg.text_lr_mult}],
                            lr=lr, weight_decay=cfg.weight_decay)
    total = cfg.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / cfg.warmup_iters) * (0.1 if s > 0.9 * total else 1.0))
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    ckpt_file = os.path.join(cfg.out, "model_last.pth")
    if os.path.exists(ckpt_file):
        ck = torch.load(ckpt_file, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch = ck["epoch"] + 1

    for epoch in range(start_epoch, cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for it, (images, ids, am, tgts) in enumerate(loader):
            tgts = [{k: v.to(device) for k, v in t.items()} for t in tgts]
            with torch.autocast("cuda", dtype=torch.float16):
                logits, boxes = model(images.to(device, non_blocking=True), ids.to(device), am.to(device))
            loss = criterion(logits.float(), boxes.float(), tgts)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            scaler.step(opt)
            scaler.update()
            sched.step()
            if it % 20 == 0:
                rl = loss.detach().clone()
                dist.all_reduce(rl, op=dist.ReduceOp.AVG)
                if rank == 0:
                    eta = (time.time() - tic) / (it + 1) * (len(loader) - it - 1)
                    print(f"ep {epoch} it {it}/{len(loader)} loss {rl.item():.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e} eta {eta / 60:.0f}min "
                          f"mem {torch.cuda.max_memory_allocated() / 2**30:.1f}G", flush=True)
        if (epoch + 1) % cfg.eval_every == 0 or epoch + 1 == cfg.epochs:
            ap = evaluate_coco(model.module, val_loader, val_set.coco, tok, cfg.max_query_len, device)
            if rank == 0:
                print(f"epoch {epoch} COCO zero-shot AP {ap:.4f}", flush=True)
        if rank == 0:
            os.makedirs(cfg.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch},
                       ckpt_file + ".tmp")
            os.replace(ckpt_file + ".tmp", ckpt_file)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
