"""Grounded pre-training (GoldG: Flickr30k entities + GQA/VG phrases) with FSDP.

The language tower is bert-large and the fusion stack is deep, so parameters,
gradients and optimizer state are sharded with FULL_SHARD.  Validation is
phrase-grounding Recall@1 on Flickr30k entities val.

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD:29500 \
        04_grounding_pretrain_fsdp.py --out /shared/ckpt/goldg_fsdp
"""
import argparse
import functools
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms.functional as TF
from PIL import Image
from scipy.optimize import linear_sum_assignment
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import swin_b, Swin_B_Weights
from torchvision.ops import box_convert, box_iou, generalized_box_iou, sigmoid_focal_loss
from transformers import AutoModel, AutoTokenizer
from transformers.models.bert.modeling_bert import BertLayer


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-ann", default="/shared/mdetr_annotations/final_mixed_train_no_coco.json")
    p.add_argument("--val-ann", default="/shared/mdetr_annotations/final_flickr_separateGT_val.json")
    p.add_argument("--images", default="/shared/images")
    p.add_argument("--text", default="bert-large-uncased")
    p.add_argument("--out", default="/shared/ckpt/goldg_fsdp")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4, help="per global batch of 64; scaled linearly")
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


class GoldG(Dataset):
    def __init__(self, ann, images, tokenizer, max_len, train):
        with open(ann) as f:
            data = json.load(f)
        by_img = {}
        for a in data["annotations"]:
            by_img.setdefault(a["image_id"], []).append(a)
        self.items = [(im, by_img.get(im["id"], [])) for im in data["images"]]
        self.images, self.tok, self.max_len, self.train = images, tokenizer, max_len, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        info, anns = self.items[idx]
        img = Image.open(os.path.join(self.images, info["file_name"])).convert("RGB")
        w, h = img.size
        s = 800 / min(w, h) if max(w, h) * 800 / min(w, h) <= 1333 else 1333 / max(w, h)
        img = TF.resize(img, [round(h * s), round(w * s)])
        enc = self.tok(info["caption"], max_length=self.max_len, truncation=True, padding="max_length")
        boxes, pos = [], []
        for a in anns:
            m = torch.zeros(self.max_len)
            for cs, ce in a["tokens_positive"]:
                ts, te = enc.char_to_token(cs), enc.char_to_token(ce - 1)
                if ts is not None and te is not None:
                    m[ts: te + 1] = 1
            x, y, bw, bh = a["bbox"]
            boxes.append([(x + bw / 2) / w, (y + bh / 2) / h, bw / w, bh / h])
            pos.append(m)
        tgt = {
            "boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
            "positive_map": torch.stack(pos) if pos else torch.zeros(0, self.max_len),
            "phrase_ids": torch.tensor([a.get("phrase_ids", 0) for a in anns], dtype=torch.long),
            "idx": idx,
        }
        img = TF.normalize(TF.to_tensor(img), [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        return img, torch.tensor(enc["input_ids"]), torch.tensor(enc["attention_mask"]), tgt


def collate(batch):
    imgs, ids, am, tgts = zip(*batch)
    H, W = max(i.shape[1] for i in imgs), max(i.shape[2] for i in imgs)
    x = torch.zeros(len(imgs), 3, H, W)
    for k, im in enumerate(imgs):
        x[k, :, : im.shape[1], : im.shape[2]] = im
    return x, torch.stack(ids), torch.stack(am), list(tgts)


class FusionLayer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.i2t = nn.MultiheadAttention(d, 8, batch_first=True)
        self.t2i = nn.MultiheadAttention(d, 8, batch_first=True)
        self.ni, self.nt = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, v, t, t_pad):
        v2 = self.ni(v + self.i2t(v, t, t, key_padding_mask=t_pad)[0])
        t2 = self.nt(t + self.t2i(t, v, v)[0])
        return v2, t2


class Grounder(nn.Module):
    def __init__(self, text_name, d=256, n_fusion=6, n_queries=900):
        super().__init__()
        self.backbone = swin_b(weights=Swin_B_Weights.IMAGENET1K_V1).features
        self.vproj = nn.Linear(1024, d)
        self.bert = AutoModel.from_pretrained(text_name, add_pooling_layer=False)
        self.tproj = nn.Linear(self.bert.config.hidden_size, d)
        self.fusion = nn.ModuleList(FusionLayer(d) for _ in range(n_fusion))
        self.queries = nn.Embedding(n_queries, d)
        self.decoder = nn.ModuleList(nn.TransformerDecoderLayer(d, 8, 2048, batch_first=True) for _ in range(6))
        self.bbox = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, 4))
        self.bias = nn.Parameter(torch.tensor(-2.0))

    def forward(self, images, input_ids, attn):
        v = self.vproj(self.backbone(images).flatten(1, 2))
        t = self.tproj(self.bert(input_ids=input_ids, attention_mask=attn).last_hidden_state)
        pad = ~attn.bool()
        for layer in self.fusion:
            v, t = layer(v, t, pad)
        q = self.queries.weight.unsqueeze(0).expand(images.shape[0], -1, -1)
        for layer in self.decoder:
            q = layer(q, v)
        logits = (q @ t.transpose(1, 2)) / q.shape[-1] ** 0.5 + self.bias
        return logits.masked_fill(pad[:, None], -1e4), self.bbox(q).sigmoid()


def criterion(logits, boxes, targets):
    logits, boxes = logits.float(), boxes.float()
    n = torch.tensor([sum(len(t["boxes"]) for t in targets)], dtype=torch.float32, device=logits.device)
    dist.all_reduce(n)
    n = (n / dist.get_world_size()).clamp(min=1)
    tmap = torch.zeros_like(logits)
    l_box = logits.new_zeros(())
    for b, t in enumerate(targets):
        if len(t["boxes"]) == 0:
            continue
        tb, pm = t["boxes"], t["positive_map"]
        with torch.no_grad():
            cost = -(logits[b].sigmoid() @ (pm / pm.sum(-1, keepdim=True).clamp(min=1)).T) \
                + 5 * torch.cdist(boxes[b], tb, p=1) \
                - 2 * generalized_box_iou(box_convert(boxes[b], "cxcywh", "xyxy"), box_convert(tb, "cxcywh", "xyxy"))
            r, c = linear_sum_assignment(cost.cpu())
        tmap[b, r] = pm[c]
        pb, gb = boxes[b, r], tb[c]
        l_box = l_box + 5 * F.l1_loss(pb, gb, reduction="sum") + 2 * (1 - generalized_box_iou(
            box_convert(pb, "cxcywh", "xyxy"), box_convert(gb, "cxcywh", "xyxy")).diag()).sum()
    return (sigmoid_focal_loss(logits, tmap, reduction="sum") + l_box) / n


@torch.no_grad()
def recall_at_1(model, loader, device):
    model.eval()
    hits = {}
    for images, ids, am, tgts in loader:
        logits, boxes = model(images.to(device), ids.to(device), am.to(device))
        for b, t in enumerate(tgts):
            pm = t["positive_map"].to(device)
            if len(pm) == 0:
                continue
            scores = logits[b].float().sigmoid() @ (pm / pm.sum(-1, keepdim=True).clamp(min=1)).T  # Q x P
            top = boxes[b, scores.argmax(0)].float()
            iou = box_iou(box_convert(top, "cxcywh", "xyxy"), box_convert(t["boxes"].to(device), "cxcywh", "xyxy"))
            # a phrase may have several GT boxes: any overlap >= 0.5 with a box of the same phrase counts
            same = t["phrase_ids"][:, None] == t["phrase_ids"][None, :]
            ok = ((iou >= 0.5) & same.to(device)).any(1)
            hits[t["idx"]] = (ok.sum().item(), len(ok))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, hits)
    merged = {}
    for p in parts:
        merged.update(p)  # padded duplicates collapse on the sample index
    model.train()
    c = sum(v[0] for v in merged.values())
    n = sum(v[1] for v in merged.values())
    return c / max(n, 1)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    tok = AutoTokenizer.from_pretrained(args.text)
    train_set = GoldG(args.train_ann, args.images, tok, args.max_len, train=True)
    val_set = GoldG(args.val_ann, args.images, tok, args.max_len, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                              collate_fn=collate, pin_memory=True)
    val_loader = DataLoader(val_set, args.batch_size, sampler=val_sampler, num_workers=args.workers,
                            collate_fn=collate)

    wrap = functools.partial(transformer_auto_wrap_policy,
                             transformer_layer_cls={BertLayer, FusionLayer, nn.TransformerDecoderLayer})
    model = FSDP(Grounder(args.text), auto_wrap_policy=wrap, sharding_strategy=ShardingStrategy.FULL_SHARD,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.bfloat16),
                 device_id=local_rank, use_orig_params=True, limit_all_gathers=True)
    lr = args.lr * args.batch_size * world / 64
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and "bert" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1 and "bert" not in n]
    text = [p for n, p in model.named_parameters() if "bert" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0},
                             {"params": text, "lr": lr * 0.1, "weight_decay": 0.01}], lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[lr, lr, lr * 0.1], pct_start=0.05,
                                                total_steps=args.epochs * len(train_loader))

    ckpt_path = os.path.join(args.out, "last.pt")
    save_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    optim_cfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    start_epoch = 0
    if os.path.exists(ckpt_path):
        full = torch.load(ckpt_path, map_location="cpu")
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=False),
                                  FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=False)):
            model.load_state_dict(full["model"])
            opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, full["optim"]))
        sched.load_state_dict(full["sched"])
        start_epoch = full["epoch"] + 1
        del full

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (images, ids, am, tgts) in enumerate(train_loader):
            tgts = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in t.items()} for t in tgts]
            logits, boxes = model(images.to(device), ids.to(device), am.to(device))
            loss = criterion(logits, boxes, tgts)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(0.1)  # FSDP-aware: norm over all shards
            opt.step()
            sched.step()
            if step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{len(train_loader)} loss {l.item():.4f} "
                          f"{(time.time() - t0) / (step + 1):.2f}s/it", flush=True)

        r1 = recall_at_1(model, val_loader, device)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_cfg, optim_cfg):
            model_sd = model.state_dict()
            optim_sd = FSDP.optim_state_dict(model, opt)
        if rank == 0:
            print(f"epoch {epoch} flickr val R@1 {r1 * 100:.2f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model_sd, "optim": optim_sd, "sched": sched.state_dict(), "epoch": epoch},
                       ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        del model_sd, optim_sd
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
