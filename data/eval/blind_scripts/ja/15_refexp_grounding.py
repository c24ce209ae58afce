# TransVG-style visual grounding: a [REG] token attends over visual and linguistic
# tokens and regresses the single box that the referring expression describes.
# Datasets: RefCOCO / RefCOCO+ / RefCOCOg (umd) in the standard .pth split files.
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import resnet101, ResNet101_Weights
from torchvision.ops import box_convert, box_iou, generalized_box_iou
from torchvision.ops.misc import FrozenBatchNorm2d
from transformers import BertModel, BertTokenizerFast


def get_args_parser():
    parser = argparse.ArgumentParser("TransVG training", add_help=True)
    parser.add_argument("--dataset", default="refcocog", choices=["refcoco", "refcoco+", "refcocog"])
    parser.add_argument("--split-root", default="./data/splits")
    parser.add_argument("--image-root", default="./data/coco/train2014")
    parser.add_argument("--output-dir", default="./outputs/transvg")
    parser.add_argument("--epochs", type=int, default=90)
    parser.add_argument("--lr-drop", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--lr-bert", type=float, default=1e-5)
    parser.add_argument("--lr-visu", type=float, default=1e-5)
    parser.add_argument("--imsize", type=int, default=640)
    parser.add_argument("--max-query-len", type=int, default=40)
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--num-workers", type=int, default=4)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser


class RefSplit(Dataset):
    """Each entry of {dataset}_{split}.pth: (file_name, ann_id, [x, y, w, h], phrase, ...)"""

    def __init__(self, args, split, tokenizer, train):
        self.items = torch.load(os.path.join(args.split_root, args.dataset, f"{args.dataset}_{split}.pth"))
        self.root, self.size, self.train = args.image_root, args.imsize, train
        self.tok, self.max_len = tokenizer, args.max_query_len
        self.norm = T.Compose([T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        fname, _, bbox, phrase = self.items[i][:4]
        img = Image.open(os.path.join(self.root, fname)).convert("RGB")
        x, y, w, h = bbox
        box = torch.tensor([x, y, x + w, y + h], dtype=torch.float32)
        if self.train and random.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
            W = img.width
            box = torch.tensor([W - box[2], box[1], W - box[0], box[3]])
            phrase = phrase.replace("right", "*&^").replace("left", "right").replace("*&^", "left")
        # letterbox to imsize x imsize
        W, H = img.size
        s = self.size / max(W, H)
        img = img.resize((round(W * s), round(H * s)))
        canvas = Image.new("RGB", (self.size, self.size), (124, 116, 104))
        dx, dy = (self.size - img.width) // 2, (self.size - img.height) // 2
        canvas.paste(img, (dx, dy))
        box = box * s + torch.tensor([dx, dy, dx, dy])
        mask = torch.ones(self.size, self.size, dtype=torch.bool)
        mask[dy: dy + img.height, dx: dx + img.width] = False
        enc = self.tok(phrase.lower(), max_length=self.max_len, truncation=True, padding="max_length")
        return (self.norm(canvas), mask, torch.tensor(enc["input_ids"]), torch.tensor(enc["attention_mask"]),
                box_convert(box, "xyxy", "cxcywh") / self.size)


class TransVG(nn.Module):
    def __init__(self, d=256, imsize=640):
        super().__init__()
        r = resnet101(weights=ResNet101_Weights.IMAGENET1K_V2, norm_layer=FrozenBatchNorm2d)
        self.visu = nn.Sequential(*list(r.children())[:-2])
        self.visu_proj = nn.Conv2d(2048, d, 1)
        self.visu_enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 8, 2048, 0.1, batch_first=True), 6)
        self.bert = BertModel.from_pretrained("bert-base-uncased", add_pooling_layer=False)
        self.text_proj = nn.Linear(768, d)
        self.reg_token = nn.Embedding(1, d)
        n_vis = (imsize // 32) ** 2
        self.vl_pos = nn.Embedding(1 + n_vis + 40, d)
        self.vl_transformer = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 8, 2048, 0.1, batch_first=True), 6)
        self.bbox_embed = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 4))

    def forward(self, img, mask, ids, am):
        f = self.visu_proj(self.visu(img))
        m = F.interpolate(mask[:, None].float(), size=f.shape[-2:]).bool()[:, 0].flatten(1)
        v = self.visu_enc(f.flatten(2).transpose(1, 2), src_key_padding_mask=m)
        t = self.text_proj(self.bert(input_ids=ids, attention_mask=am).last_hidden_state)
        B = img.shape[0]
        reg = self.reg_token.weight.expand(B, -1, -1)
        x = torch.cat([reg, v, t], 1) + self.vl_pos.weight[None, : 1 + v.shape[1] + t.shape[1]]
        pad = torch.cat([torch.zeros(B, 1, dtype=torch.bool, device=img.device), m, ~am.bool()], 1)
        h = self.vl_transformer(x, src_key_padding_mask=pad)
        return self.bbox_embed(h[:, 0]).sigmoid()


def grounding_loss(pred, gt):
    l1 = F.l1_loss(pred, gt)
    giou = (1 - torch.diag(generalized_box_iou(box_convert(pred, "cxcywh", "xyxy"), box_convert(gt, "cxcywh", "xyxy")))).mean()
    return l1 * 5 + giou * 2


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for img, mask, ids, am, gt in loader:
        pred = model(img.to(device), mask.to(device), ids.to(device), am.to(device))
        iou = box_iou(box_convert(pred, "cxcywh", "xyxy"), box_convert(gt.to(device), "cxcywh", "xyxy")).diag()
        acc += torch.stack([(iou >= 0.5).sum().float(), torch.tensor(float(len(iou)), device=device)])
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main(args):
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    device = torch.device("cuda", args.local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    seed = args.seed + rank
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)

    tok = BertTokenizerFast.from_pretrained("bert-base-uncased")
    train_set = RefSplit(args, "train", tok, train=True)
    val_set = RefSplit(args, "val", tok, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=args.num_workers,
                              drop_last=True, pin_memory=True)
    # val: exact shards so the accuracy counts every expression once
    val_idx = list(range(rank, len(val_set), world))
    val_loader = DataLoader(torch.utils.data.Subset(val_set, val_idx), args.batch_size,
                            num_workers=args.num_workers)

    model = TransVG(imsize=args.imsize).to(device)
    model_without_ddp = model
    model = DDP(model, device_ids=[args.local_rank])
    groups = [
        {"params": [p for n, p in model_without_ddp.named_parameters() if n.startswith("bert")], "lr": args.lr_bert},
        {"params": [p for n, p in model_without_ddp.named_parameters() if n.startswith("visu.")], "lr": args.lr_visu},
        {"params": [p for n, p in model_without_ddp.named_parameters()
                    if not n.startswith(("bert", "visu."))], "lr": args.lr},
    ]
    optimizer = torch.optim.AdamW(groups, weight_decay=1e-4)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, args.lr_drop)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        tot = torch.zeros(2, device=device)
        for img, mask, ids, am, gt in train_loader:
            pred = model(img.to(device, non_blocking=True), mask.to(device), ids.to(device), am.to(device))
            loss = grounding_loss(pred, gt.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        lr_scheduler.step()
        dist.all_reduce(tot)
        acc = validate(model_without_ddp, val_loader, device)
        if rank == 0:
            print(f"Epoch {epoch}: train loss {tot[0] / tot[1]:.4f}, val Acc@0.5 {acc * 100:.2f}, "
                  f"time {time.time() - start:.0f}s", flush=True)
            os.makedirs(args.output_dir, exist_ok=True)
            ckpt = {"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                    "lr_scheduler": lr_scheduler.state_dict(), "epoch": epoch, "args": vars(args)}
            torch.save(ckpt, os.path.join(args.output_dir, "checkpoint.pth"))
            if acc > best:
                best = acc
                torch.save(ckpt, os.path.join(args.output_dir, "best_checkpoint.pth"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(get_args_parser().parse_args())
